"""Every RPC runs through here: domain errors become a gRPC status with one ErrorInfo.

The table is :data:`lightning_grpc.errors.STATUS_OF`; the client reverses it. An unexpected
exception is logged here with its traceback and answered INTERNAL with a plain message, so a
traceback never reaches a client.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from lightning_grpc import logs
from lightning_grpc.errors import (
    InternalError,
    InvalidArgumentError,
    LightningError,
    Reason,
    UnavailableError,
)

from . import caller
from .status import abort

log = logs.get_logger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def internal_error(method: str, exc: BaseException) -> LightningError:
    """An unexpected exception of ``method``'s handler: logged with its traceback, answered INTERNAL."""
    log.error("event=rpc_internal_error method=%s error=%r", method, exc, exc_info=exc)
    return InternalError(
        "internal error in the store; the server log has the details", reason=Reason.INTERNAL
    )


class Undecodable:
    """Stands for a request message that could not be parsed (answered INVALID_ARGUMENT)."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def error(self) -> LightningError:
        return InvalidArgumentError("request", f"is not a valid {self.type_name} message")


def tolerant_parser(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: bad bytes become :class:`Undecodable`."""
    parse = message_class.FromString
    name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception:
            return Undecodable(name)

    return deserialize


class ServicerState:
    """What the adapter tracks per servicer: calls in flight, and whether the server is draining."""

    in_flight: int = 0
    shutting_down: bool = False

    def drain(self) -> None:
        """Refuse new calls, and end every client stream that is waiting for its next message."""
        self.shutting_down = True
        for task in self._waiting_streams():
            task.cancel()

    def _waiting_streams(self) -> set[asyncio.Task[Any]]:
        return self.__dict__.setdefault("_waiting", set())  # type: ignore[no-any-return]

    async def until_drained(self, requests: AsyncIterator[Req]) -> AsyncIterator[Req]:
        """The messages of a client stream, ended with UNAVAILABLE (SHUTTING_DOWN) when the server drains.

        A stream the client keeps open (a runner's span stream) would otherwise hold the drain for its
        whole grace period; ended between two messages, nothing acknowledged is lost and the client
        reconnects and resends what it has not seen acknowledged.
        """
        waiting = self._waiting_streams()
        while True:
            if self.shutting_down:
                raise _shutting_down()
            task = asyncio.current_task()  # the task reading now: a stream may be read ahead by another
            assert task is not None
            waiting.add(task)
            try:
                message = await anext(requests)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self.shutting_down:
                    raise
                task.uncancel()
                raise _shutting_down() from None
            finally:
                waiting.discard(task)
            yield message


def _shutting_down() -> UnavailableError:
    return UnavailableError(
        "the server is shutting down; retry on another server or later", reason=Reason.SHUTTING_DOWN
    )


def _refuse_if_draining(servicer: Any) -> None:
    if getattr(servicer, "shutting_down", False):
        raise _shutting_down()


def _authorized(request: Any) -> Any:
    """The request, once the caller may make it (a client stream: each message, as it comes)."""
    if caller.current_call() is None:
        return request  # no access control on this server: nothing to check, no wrapper around a stream
    if hasattr(request, "__aiter__"):
        return caller.authorized_stream(request)
    caller.authorize_request(request)
    return request


def unary(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]:
    """Wrap a unary (or client-streaming) handler."""

    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        self.in_flight = getattr(self, "in_flight", 0) + 1
        try:
            _refuse_if_draining(self)
            if isinstance(request, Undecodable):
                raise request.error()
            response = await fn(self, _authorized(request), context)
            caller.answer(response)
            return response
        except LightningError as exc:
            await abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await abort(context, internal_error(fn.__name__, exc))
        finally:
            self.in_flight -= 1
        raise AssertionError("unreachable")  # abort raises

    return handler


def streaming(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Resp]]:
    """Wrap a server-streaming (or bidirectional) handler written as an async generator."""

    @functools.wraps(fn)
    async def handler(
        self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Resp]:
        self.in_flight = getattr(self, "in_flight", 0) + 1
        try:
            _refuse_if_draining(self)
            if isinstance(request, Undecodable):
                raise request.error()
            async for item in fn(self, _authorized(request), context):
                yield item
        except LightningError as exc:
            await abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await abort(context, internal_error(fn.__name__, exc))
        finally:
            self.in_flight -= 1

    return handler


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


async def _refusing_undecodable(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for message in requests:
        if isinstance(message, Undecodable):
            raise message.error()
        yield message


def guarded(fn: Callable[..., Any], client_streaming: bool) -> Callable[..., Any]:
    """A handler of a servicer this project did not write (health, reflection), made to refuse
    undecodable requests as ours do: INVALID_ARGUMENT with an ErrorInfo.

    Works for handlers that are coroutines (answering, or writing with ``context.write``) and for
    async generators.
    """

    def checked(request: Any) -> Any:
        if client_streaming:
            return _refusing_undecodable(request)
        if isinstance(request, Undecodable):
            raise request.error()
        return request

    if inspect.isasyncgenfunction(fn):

        async def stream_handler(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            try:
                async for item in fn(checked(request), context):
                    yield item
            except LightningError as exc:
                await abort(context, exc)

        return stream_handler

    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await fn(checked(request), context)
        except LightningError as exc:
            await abort(context, exc)

    return handler


def register_service(
    service: Any,
    messages: Any,
    servicer: Any,
    server: grpc.aio.Server,
    *,
    raw_requests: dict[str, Any] | None = None,
    raw_responses: set[str] | frozenset[str] = frozenset(),
    foreign: bool = False,
) -> None:
    """Register a service as the generated helper does, but with tolerant request parsing.

    ``messages`` is the generated module holding the request and response classes;
    ``raw_requests`` replaces some request classes (wire views), and methods in ``raw_responses``
    answer with bytes already serialized. A ``foreign`` servicer (health, reflection: methods not wrapped
    in :func:`unary` or :func:`streaming`) has its handlers wrapped by :func:`guarded`.
    """
    handlers = {}
    for method in service.methods:
        request_class = (raw_requests or {}).get(method.name) or getattr(messages, method.input_type.name)
        response_class = getattr(messages, method.output_type.name)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        behaviour = getattr(servicer, method.name)
        if foreign:
            behaviour = guarded(behaviour, method.client_streaming)
        handlers[method.name] = make(
            behaviour,
            request_deserializer=tolerant_parser(request_class),
            response_serializer=None if method.name in raw_responses else response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
