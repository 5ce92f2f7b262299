"""The proxy's objects: its backends.

Imported on its own (``lightning_grpc.convert.proxy``), not through :mod:`lightning_grpc.convert`:
the proxy package imports the client, which imports ``convert``.
"""

from __future__ import annotations

from lightning_grpc.types import Backend, BackendDialect
from lightning_grpc.v1 import proxy_service_pb2 as pb


def backend_from_pb(m: pb.Backend) -> Backend:
    try:
        dialect = BackendDialect(m.dialect)
    except ValueError:
        dialect = m.dialect  # type: ignore[assignment]  # refused by the table's check, with the field named
    return Backend(
        model_name=m.model_name,
        api_base=m.api_base,
        dialect=dialect,
        backend_model=m.backend_model,
        api_key=m.api_key,
        policy_version=m.policy_version,
    )


def backend_to_pb(b: Backend, out: pb.Backend, *, api_key: bool = False) -> None:
    """A backend, with its API key only when asked (a client setting backends): the key never leaves the proxy."""
    out.model_name = b.model_name
    out.api_base = b.api_base
    out.dialect = int(b.dialect)  # type: ignore[assignment]
    out.backend_model = b.backend_model
    if api_key:
        out.api_key = b.api_key
    out.policy_version = b.policy_version
