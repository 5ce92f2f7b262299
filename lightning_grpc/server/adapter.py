"""Every RPC runs through here: domain errors become a gRPC status with one ErrorInfo.

The table is :data:`lightning_grpc.errors.STATUS_OF`; the client reverses it. An unexpected
exception is logged here with its traceback and answered INTERNAL with a plain message, so a
traceback never reaches a client.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from lightning_grpc.errors import ERROR_DOMAIN, STATUS_OF, InternalError, LightningError

log = logging.getLogger("lightning_grpc.server")

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def status_for(error: LightningError) -> grpc.Status:
    code = grpc.StatusCode[STATUS_OF.get(type(error), error.code_name)]
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=error.message, details=[detail])
    )


async def abort(context: grpc.aio.ServicerContext, error: LightningError) -> None:
    await context.abort_with_status(status_for(error))


def _internal(method: str, exc: BaseException) -> LightningError:
    log.error("event=rpc_internal_error method=%s error=%r", method, exc, exc_info=exc)
    return InternalError("internal error in the store; the server log has the details", reason="INTERNAL")


def unary(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """Wrap a unary (or client-streaming) handler."""

    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await fn(self, request, context)
        except LightningError as exc:
            await abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await abort(context, _internal(fn.__name__, exc))
        raise AssertionError("unreachable")  # abort raises

    return handler


def streaming(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    """Wrap a server-streaming (or bidirectional) handler written as an async generator."""

    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        try:
            async for item in fn(self, request, context):
                yield item
        except LightningError as exc:
            await abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await abort(context, _internal(fn.__name__, exc))

    return handler
