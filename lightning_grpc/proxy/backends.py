"""The model backends behind the proxy, and which one serves a call.

A backend is one OpenAI-compatible server. Several backends may serve the same model name; all
calls of one rollout then go to the same backend (rendezvous hashing on the rollout id, so a
change of the list moves only the rollouts of the backends that came or went). Calls without a
rollout go to the backend with the fewest calls in flight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import replace
from urllib.parse import urlsplit

from lightning_grpc.errors import InvalidArgumentError, NotFoundError, Reason
from lightning_grpc.types import Backend, BackendDialect, BackendStats

__all__ = ["Backend", "BackendDialect", "BackendStats", "BackendTable", "check_backend", "normalize_api_base"]


def normalize_api_base(url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1/`` -> ``http://h:p/v1``; any other path is kept as given."""
    base = url.strip().rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not carry a query or a fragment")
    if not parts.path:
        base += "/v1"
    return base


def check_backend(b: Backend, where: str = "backends") -> Backend:
    """A validated copy (normalized URL, default dialect); InvalidArgumentError names the faulty field."""
    if not b.model_name:
        raise InvalidArgumentError(f"{where}.model_name", "is required")
    try:
        api_base = normalize_api_base(b.api_base)
    except ValueError as exc:
        raise InvalidArgumentError(f"{where}.api_base", str(exc)) from None
    dialect = BackendDialect.VLLM if b.dialect == BackendDialect.UNSPECIFIED else b.dialect
    if dialect not in (BackendDialect.VLLM, BackendDialect.OPENAI):
        raise InvalidArgumentError(f"{where}.dialect", f"unknown dialect {int(b.dialect)}")
    return replace(b, api_base=api_base, dialect=BackendDialect(dialect))


def _score(rollout_id: str, backend: Backend) -> bytes:
    return hashlib.sha256(f"{rollout_id}\0{backend.api_base}".encode()).digest()


class BackendTable:
    """The current backends, replaced as a whole; per-api_base counters survive replacements."""

    def __init__(self, backends: Iterable[Backend] = ()) -> None:
        self._by_model: dict[str, list[Backend]] = {}
        self._all: list[Backend] = []
        self.stats: dict[str, BackendStats] = {}
        self.replace(backends)

    def replace(self, backends: Iterable[Backend]) -> list[Backend]:
        checked = [check_backend(b, f"backends[{i}]") for i, b in enumerate(backends)]
        seen: set[tuple[str, str]] = set()
        for i, b in enumerate(checked):
            key = (b.model_name, b.api_base)
            if key in seen:
                raise InvalidArgumentError(
                    f"backends[{i}]", f"{b.api_base} is listed twice for model {b.model_name!r}"
                )
            seen.add(key)
        by_model: dict[str, list[Backend]] = {}
        for b in checked:
            by_model.setdefault(b.model_name, []).append(b)
        self._all, self._by_model = checked, by_model  # one assignment: readers never see half a list
        for b in checked:
            self.stats.setdefault(b.api_base, BackendStats())
        return list(checked)

    @property
    def backends(self) -> list[Backend]:
        return list(self._all)

    def model_names(self) -> list[str]:
        return sorted(self._by_model)

    def resolve_model(self, requested: str) -> str:
        """The model name a call asks for; with a single model, an empty name means that one."""
        if requested in self._by_model:
            return requested
        names = self.model_names()
        if not requested and len(names) == 1:
            return names[0]
        if not names:
            raise NotFoundError(
                "the proxy has no backends; set them with SetBackends", reason=Reason.NO_BACKENDS
            )
        raise NotFoundError(
            f"model {requested!r} is not served here; the models are {', '.join(names)}",
            reason=Reason.MODEL_NOT_FOUND,
            model=requested,
        )

    def pick(self, model_name: str, rollout_id: str = "") -> Backend:
        """The backend for a call: sticky per rollout, else the least busy."""
        pool = self._by_model.get(model_name)
        if not pool:
            raise NotFoundError(f"model {model_name!r} has no backend", reason=Reason.MODEL_NOT_FOUND)
        if len(pool) == 1:
            return pool[0]
        if rollout_id:
            return max(pool, key=lambda b: _score(rollout_id, b))
        return min(pool, key=lambda b: (self.stats[b.api_base].in_flight, b.api_base))
