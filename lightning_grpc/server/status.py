"""A domain error as the gRPC status a client receives: its code from :data:`lightning_grpc.errors.STATUS_OF`
and one ``google.rpc.ErrorInfo`` (reason, domain, metadata), which the client reverses."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from lightning_grpc.errors import ERROR_DOMAIN, STATUS_OF, LightningError
from lightning_grpc.logs import clip

MAX_MESSAGE_CHARS = 1000
MAX_METADATA_CHARS = 200


def status_for(error: LightningError) -> grpc.Status:
    """The rich status of a domain error. Echoed values are clipped: details travel in headers."""
    code = grpc.StatusCode[STATUS_OF.get(type(error), error.code_name)]
    metadata = {k: clip(v, MAX_METADATA_CHARS) for k, v in error.metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    message = clip(error.message, MAX_MESSAGE_CHARS)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: LightningError) -> None:
    await context.abort_with_status(status_for(error))
