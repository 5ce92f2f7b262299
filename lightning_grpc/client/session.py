"""RunnerSession: a runner's claims, heartbeats and outcomes over one RunnerSession stream.

A busy runner makes a few calls a rollout (claim, heartbeats, report). Over one stream each of them is a
message instead of a call, so the server does not set up a call for every one of them. Each message is
answered on its own, as soon as the server is done with it, so any number of tasks can use one session
at once. When the stream breaks (UNAVAILABLE: the server restarts, a standby takes over), the session opens
a new one and sends again every message it has no answer to; all of them are safe to repeat (claims carry a
request id, reports are fenced by the attempt). A server without RunnerSession (an older release) is asked
with the unary RPCs instead. A stream that ends while a message is being written on it can end with
grpc.aio's own INTERNAL instead of the server's status; it is opened again at once, to learn that status.
A stream that stays open but answers nothing (no answer to any message since one that went unanswered for
its whole timeout was sent) is given up: that call raises DeadlineExceededError, and a new stream takes every
message still owed, so one stuck stream cannot leave a runner's heartbeats and claims unanswered for good.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from lightning_grpc import logs
from lightning_grpc.access import SESSION_CALLS
from lightning_grpc.errors import DeadlineExceededError, LightningError, UnavailableError
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc

from .channel import Metadata
from .config import ClientConfig
from .errors import from_message_error, from_rpc_error, status_lost_to_a_write
from .runner_calls import RunnerCalls

log = logs.get_logger(__name__)

#: How many times in a row a stream whose status grpc.aio lost to a failed write is opened again at once.
_LOST_STATUS_REOPENS = 3

#: The RPCs a session carries: the RPC's name -> the field of RunnerSessionRequest/Response holding it.
_FIELD_OF = {method: name for name, method in SESSION_CALLS.items()}


@dataclass
class _Owed:
    """A message sent and not answered yet."""

    message: pb.RunnerSessionRequest
    answer: asyncio.Future[Any]
    #: The stream it was last sent on (a new stream sends it again).
    stream: int = field(default=-1)
    #: When it was last sent (the event loop's clock).
    sent_at: float = field(default=0.0)


class RunnerSession(RunnerCalls):
    """The runner's calls of a :class:`~lightning_grpc.client.StoreClient` over one RunnerSession stream.

    Made by :meth:`StoreClient.runner_session`; use it as ``async with`` (or call :meth:`close`). Its
    methods are those of the client (``dequeue_rollouts``, ``dequeue_rollout``, ``heartbeat_attempt``,
    ``complete_attempt``, ``complete_and_dequeue``), with the same arguments, answers and errors; they may be
    called from many tasks at once. Each waits for its answer up to the client's ``timeout`` (plus the
    claim's ``wait``), and raises :class:`~lightning_grpc.errors.DeadlineExceededError` after it.
    """

    def __init__(
        self,
        config: ClientConfig,
        stub: pb_grpc.StoreServiceStub,
        metadata: Metadata,
        unary: Callable[[str, Any, float | None], Awaitable[Any]],
    ) -> None:
        self._config, self._stub, self._metadata, self._unary_call = config, stub, metadata, unary
        self._ids = itertools.count(1)
        self._owed: dict[int, _Owed] = {}
        self._stream: Any = None
        self._streams = 0  # streams opened so far; the current one is number self._streams - 1
        self._reader: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()  # a stream takes one write at a time
        self._unary = False  # the server has no RunnerSession: each message is its unary call
        self._closed = False
        self._answered_at = 0.0  # when the current stream last answered (the event loop's clock)
        self._replacing: asyncio.Task[None] | None = None  # a silent stream being given up

    @property
    def config(self) -> ClientConfig:  # type: ignore[override]
        """The client's configuration (timeouts, retries)."""
        return self._config

    async def __aenter__(self) -> RunnerSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream; calls still waiting for their answer raise UnavailableError."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        if self._stream is not None:
            self._stream.cancel()
        self._fail_owed(UnavailableError("the runner session was closed", reason="SESSION_CLOSED"))

    # ------------------------------------------------------------------ one call
    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        if self._closed:
            raise UnavailableError("the runner session was closed", reason="SESSION_CLOSED")
        if self._unary:
            return await self._unary_call(method, request, timeout)
        name = _FIELD_OF[method]
        message_id = next(self._ids)
        message = pb.RunnerSessionRequest(message_id=message_id)
        getattr(message, name).CopyFrom(request)
        owed = _Owed(message, asyncio.get_running_loop().create_future())
        self._owed[message_id] = owed
        try:
            async with asyncio.timeout(timeout or self.config.timeout):
                await self._send(owed)
                answer = await owed.answer
        except TimeoutError:
            self._give_up_if_silent(owed)
            raise DeadlineExceededError(f"no answer to {method} on the runner session in time") from None
        finally:
            self._owed.pop(message_id, None)
        if isinstance(answer, _Unary):
            return await self._unary_call(method, request, timeout)
        if answer.HasField("error"):
            raise from_message_error(answer.error)
        return getattr(answer, name)

    async def _send(self, owed: _Owed) -> None:
        async with self._writing:
            if self._stream is None:
                self._open()
            if owed.stream == self._streams - 1 or owed.answer.done():
                return  # the stream was opened again meanwhile, and sent it
            owed.stream, owed.sent_at = self._streams - 1, asyncio.get_running_loop().time()
            try:
                await self._stream.write(owed.message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the stream broke: the reader opens another and sends it again

    def _new_stream(self) -> Any:
        """A new stream (written with ``write``); the caller holds the write lock."""
        self._stream = self._stub.RunnerSession(metadata=self._metadata)  # type: ignore[call-arg]
        self._streams += 1
        self._answered_at = asyncio.get_running_loop().time()
        return self._stream

    def _open(self) -> None:
        self._new_stream()
        self._reader = asyncio.create_task(self._read(self._stream), name="lightning-runner-session")

    # ------------------------------------------------------------------ answers, and a broken stream
    async def _read(self, stream: Any) -> None:
        failures = lost = 0
        while True:
            try:
                async for answer in stream:
                    failures = lost = 0
                    self._answered_at = asyncio.get_running_loop().time()
                    owed = self._owed.get(answer.message_id)
                    if owed is not None and not owed.answer.done():
                        owed.answer.set_result(answer)
                error: grpc.aio.AioRpcError | None = None
            except grpc.aio.AioRpcError as exc:
                error = exc
            if self._closed or stream is not self._stream:
                return  # closed, or given up as silent: another stream and reader took its messages
            if error is not None and status_lost_to_a_write(error) and lost < _LOST_STATUS_REOPENS:
                lost += 1  # not the server's answer: ask again at once (a refusal, UNIMPLEMENTED, a drain)
                log.debug("event=runner_session_status_lost owed=%d", len(self._owed))
                stream = await self._reopen(replacing=stream)
                if stream is None:
                    return  # given up as silent meanwhile: the new stream has a reader of its own
                continue
            if error is not None and error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unary = True  # an older server: every message, owed or to come, is its unary call
                for owed in self._owed.values():
                    if not owed.answer.done():
                        owed.answer.set_result(_Unary())
                return
            failures += 1
            retry = self.config.retry
            if (error is not None and error.code() != grpc.StatusCode.UNAVAILABLE) or (
                retry is None or failures >= retry.max_attempts
            ):
                async with self._writing:  # a message sent from now on opens a new stream
                    if stream is self._stream:  # (not given up meanwhile: its messages are on another)
                        self._stream = None
                        self._fail_owed(from_rpc_error(error) if error is not None else _ended())
                return
            delay = min(retry.max_backoff, retry.initial_backoff * retry.backoff_multiplier ** (failures - 1))
            log.info(
                "event=runner_session_broken error=%r retry_in=%.2fs owed=%d", error, delay, len(self._owed)
            )
            await asyncio.sleep(delay)
            stream = await self._reopen(replacing=stream)
            if stream is None:
                return  # given up as silent meanwhile (or closed): the new stream has a reader of its own

    def _give_up_if_silent(self, owed: _Owed) -> None:
        """After ``owed`` went unanswered for its whole timeout: when its stream is still the current one, has
        answered nothing since ``owed`` was sent, and nothing for half the client's timeout at least (not a
        stream just opened), that stream is given up for a new one."""
        if self._closed or self._stream is None or owed.stream != self._streams - 1:
            return
        silent_for = asyncio.get_running_loop().time() - self._answered_at
        if self._answered_at > owed.sent_at or silent_for < self.config.timeout / 2:
            return  # the stream answers (this message is slow, not lost), or it is new
        log.warning(
            "event=runner_session_silent owed=%d silent_for=%.1fs: opening a new stream",
            len(self._owed),
            silent_for,
        )
        self._replacing = asyncio.get_running_loop().create_task(
            self._replace(self._stream), name="lightning-runner-session"
        )

    async def _replace(self, silent: Any) -> None:
        """A new stream and reader in place of ``silent`` (unless another took its place meanwhile), every
        message still owed sent on it; ``silent`` is then cancelled (its reader sees it is not current)."""
        stream = await self._reopen(replacing=silent)
        if stream is None:
            return
        self._reader = asyncio.create_task(self._read(stream), name="lightning-runner-session")
        silent.cancel()

    async def _reopen(self, replacing: Any) -> Any:
        """A new stream in place of ``replacing``, with every message still owed sent on it again, in the order
        they were first sent; None when ``replacing`` is no longer the current stream (another took its place,
        or the session was closed)."""
        async with self._writing:
            if self._closed or self._stream is not replacing:
                return None
            self._new_stream()
            for message_id in sorted(self._owed):
                owed = self._owed.get(message_id)  # (one whose call gave up while others were written: gone)
                if owed is None or owed.answer.done():
                    continue
                owed.stream, owed.sent_at = self._streams - 1, asyncio.get_running_loop().time()
                try:
                    await self._stream.write(owed.message)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    break  # broken again: the reader sees it
            return self._stream

    def _fail_owed(self, error: LightningError) -> None:
        for owed in self._owed.values():
            if not owed.answer.done():
                owed.answer.set_exception(error)


class _Unary:
    """The answer that says: ask this message's unary RPC instead (the server has no RunnerSession)."""


def _ended() -> UnavailableError:
    return UnavailableError("the server ended the runner session", reason="SESSION_ENDED")


__all__ = ["RunnerSession"]
