"""Optional bearer-token authentication for every service but health and reflection."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from lightning_grpc.errors import Reason, UnauthenticatedError

from .adapter import status_for

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        method = details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        supplied = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                supplied = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(supplied, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler, "missing bearer token" if not supplied else "wrong bearer token")


def _refusing(handler: grpc.RpcMethodHandler | None, why: str) -> grpc.RpcMethodHandler:
    status = status_for(
        UnauthenticatedError(f"{why}; send 'authorization: Bearer <token>'", reason=Reason.BAD_TOKEN)
    )

    async def refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort_with_status(status)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort_with_status(status)
        yield  # pragma: no cover

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse_unary)
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse_unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse_unary, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)
