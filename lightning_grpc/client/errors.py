"""gRPC errors back into the typed errors of :mod:`lightning_grpc.errors`."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from lightning_grpc.errors import ERROR_DOMAIN, LightningError, UnavailableError, error_from_status
from lightning_grpc.v1 import store_service_pb2 as pb

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


#: The reason of a stream that ended while grpc.aio was sending on it, its status unknown (see below).
STATUS_LOST = "STREAM_STATUS_LOST"


def status_lost_to_a_write(exc: grpc.RpcError) -> bool:
    """Whether grpc.aio reported its own failed write instead of the status a stream ended with.

    A message written on a client stream just as the server ends the call (refuses the caller, answers
    UNIMPLEMENTED, drains) fails in the library, and the call then ends with INTERNAL, "Failed
    execute_batch", whatever code the server sent. Opening the stream again tells the real answer.
    """
    if not hasattr(exc, "code") or not hasattr(exc, "debug_error_string"):
        return False
    # A server's own INTERNAL reads "INTERNAL:<its message>" here, whatever that message says.
    return bool(
        exc.code() == grpc.StatusCode.INTERNAL
        and (exc.debug_error_string() or "").startswith('Failed "execute_batch"')
    )


def from_rpc_error(exc: grpc.RpcError) -> LightningError:
    """The typed error a server raised (reason and metadata from its ErrorInfo).

    A stream whose status grpc.aio replaced with its own failed write (:func:`status_lost_to_a_write`) is
    UNAVAILABLE with reason ``STREAM_STATUS_LOST``: the stream broke, and nothing says the server failed.
    """
    if status_lost_to_a_write(exc):
        return UnavailableError(
            "the stream ended while a message was being written on it, and the server's status was lost; "
            "open it again to learn it",
            reason=STATUS_LOST,
        )
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
