"""gRPC errors back into the typed errors of :mod:`lightning_grpc.errors`."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from lightning_grpc.errors import ERROR_DOMAIN, LightningError, error_from_status
from lightning_grpc.v1 import store_service_pb2 as pb

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def from_rpc_error(exc: grpc.RpcError) -> LightningError:
    """The typed error a server raised (reason and metadata from its ErrorInfo)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = exc.details() if hasattr(exc, "details") else str(exc)
    reason, metadata = code.name, {}
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except Exception:
        status = None
    if status is not None:
        message = status.message
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == ERROR_DOMAIN:
                    reason, metadata = info.reason, dict(info.metadata)
    return error_from_status(code.name, message or "", reason, metadata)


def from_message_error(error: pb.BatchError) -> LightningError:
    """The typed error of one message a stream's server refused (a span batch, a runner session's call)."""
    return error_from_status(_CODE_NAMES.get(error.code, "UNKNOWN"), error.message, error.reason, {})
