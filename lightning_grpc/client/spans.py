"""Sending spans to the Store: the one shipper, used by tracing (the OpenTelemetry span processor) and
by the LLM proxy's recorder.

Spans are queued per attempt and cut into batches (at most ``max_batch`` spans and ``max_batch_bytes``
bytes). A batch stays in memory until the Store acknowledges it, which it does only once the batch is
stored. What to do with a batch the Store did not take is decided here, once, on the typed error
(:attr:`lightning_grpc.errors.LightningError.transient`):

- a transient error (unavailable, deadline passed, the in-memory store full): the batch is sent again
  after a back-off, for as long as the shipper runs;
- a refusal that may be about one of its spans (malformed, too large, a sequence id taken): the batch is
  split, each span tried alone, so that only the faulty spans are given up;
- anything else (an unknown attempt): the batch is given up, counted and logged.

The Store keys spans by span id, so a batch sent twice is stored once. Two ways to the Store (*sinks*):

- :class:`StreamSink`: the bidirectional ``AddSpansStream`` over gRPC, many batches in flight; when the
  stream breaks it is opened again and every unacknowledged batch is sent again;
- :class:`CallSink`: one call per batch on a client that takes serialized spans (``add_span_bytes``),
  such as :class:`~lightning_grpc.client.local.LocalStoreClient`, a Store in the same process; many
  batches in flight too, each handed to the Store as it comes, so that they share the Store's commits.

:class:`SpanShipper` runs in the event loop that starts it. :class:`SpanStreamer` runs one on a thread
of its own, with its own event loop and channel; its :meth:`~SpanStreamer.submit` is cheap and may be
called from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from lightning_grpc import logs
from lightning_grpc.convert.framing import stream_request
from lightning_grpc.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    LightningError,
    ResourceExhaustedError,
)
from lightning_grpc.pipelined import answers_as_done
from lightning_grpc.v1 import store_service_pb2 as pb

from .channel import Metadata, call_metadata, close_loop, make_channel
from .config import ClientConfig
from .errors import from_message_error, from_rpc_error

if TYPE_CHECKING:
    from .local import LocalStoreClient
    from .store import StoreClient

Key = tuple[str, str]
#: The most batches a shipper keeps sent and unanswered, by default.
MAX_IN_FLIGHT = 64
#: The Store's answer to one batch: its id, and the error when it did not store it.
Ack = tuple[int, LightningError | None]

_METHOD = pb.DESCRIPTOR.services_by_name["StoreService"].methods_by_name["AddSpansStream"]
#: ``/lightning.v1.StoreService/AddSpansStream``, from the contract.
ADD_SPANS_STREAM = f"/{_METHOD.containing_service.full_name}/{_METHOD.name}"


# ------------------------------------------------------------------ batches and their fate


@dataclass(eq=False)
class Tracked:
    """A span whose sender waits for its fate: ``done`` is True once stored, False once given up.

    ``shrink`` may offer a smaller body once the Store refused the span alone (None: give it up).
    """

    done: asyncio.Future[bool]
    shrink: Callable[[LightningError], bytes | None] | None = None


@dataclass(eq=False)
class SpanBatch:
    """Serialized ``lightning.v1.Span`` messages of one attempt, sent and acknowledged together."""

    batch_id: int
    key: Key
    spans: list[bytes]
    #: One entry per span when someone waits for them, else None.
    tracked: list[Tracked] | None = None
    #: How many times the Store answered with a transient error.
    tries: int = 0
    #: The batch framed as an AddSpansStreamRequest, once sent on a stream.
    payload: bytes | None = None


@dataclass(eq=False)
class _Outstanding:
    """An attempt's spans submitted and not yet stored or given up, and the flushes that wait for them.

    Kept only while something is outstanding, so that a long-lived shipper holds nothing per finished
    attempt. A flush holds on to the entry itself: spans submitted later for the same attempt start a new
    entry and cannot hold up a flush made before them.
    """

    submitted: int = 0
    done: int = 0
    #: (spans of this attempt that must be done, the flush's future), in no particular order.
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)


@dataclass
class ShipperStats:
    """What a shipper did with the spans submitted to it, counted since it started."""

    #: Spans submitted.
    submitted: int = 0
    #: Spans the Store acknowledged (stored, or already stored).
    acknowledged: int = 0
    #: Spans given up: the Store refused them for good.
    rejected: int = 0
    #: Spans still unsent when the shipper closed.
    lost: int = 0
    #: Spans taken back unsent by their caller, to store with their attempt's outcome (:meth:`SpanShipper.take`).
    taken: int = 0
    #: Batches sent again after a transient error.
    retried: int = 0
    #: Streams opened again after one broke.
    reconnects: int = 0
    #: Why spans were given up, one line each (the latest few).
    rejections: list[str] = field(default_factory=list)


def ack_error(ack: pb.AddSpansStreamResponse) -> LightningError | None:
    """The typed error of a refused batch on the stream (None when stored)."""
    if not ack.HasField("error"):
        return None
    return from_message_error(ack.error)


def _may_be_one_span(error: LightningError) -> bool:
    """Whether a refusal may be the fault of one span of the batch (so splitting saves the others)."""
    return isinstance(error, InvalidArgumentError | ResourceExhaustedError | AlreadyExistsError)


# ------------------------------------------------------------------ sinks


class SpanSink(Protocol):
    """Where batches go. A session sends the batches it is given and yields the Store's answers; it
    ends with a :class:`LightningError` when the way to the Store broke (every batch not yet
    acknowledged is then sent again on the next session)."""

    target: str

    def session(self, batches: AsyncIterator[SpanBatch]) -> AsyncGenerator[Ack, None]:
        """Send ``batches``; yield (batch id, None when stored or the refusal) for each."""
        ...


class StreamSink:
    """``AddSpansStream`` over a channel; each batch goes out as the bytes of an AddSpansStreamRequest.

    The call is made on the contract's method path without the generated stub's serializer: the
    spans stay the bytes they were submitted as (:func:`lightning_grpc.convert.framing.stream_request`).
    """

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata = (), target: str = "") -> None:
        self.target = target
        self._metadata = metadata
        self._method: Any = channel.stream_stream(
            ADD_SPANS_STREAM, response_deserializer=pb.AddSpansStreamResponse.FromString
        )

    @classmethod
    def of(cls, client: StoreClient) -> StreamSink:
        """Over a :class:`~lightning_grpc.client.StoreClient`'s channel, with its token."""
        return cls(client.channel, call_metadata(client.config), client.config.target)

    async def session(self, batches: AsyncIterator[SpanBatch]) -> AsyncGenerator[Ack, None]:
        """One ``AddSpansStream`` call: send ``batches``, yield the Store's acknowledgements.

        Args:
            batches: The batches to send, as they come.

        Yields:
            (batch id, None when stored or the typed refusal).

        Raises:
            LightningError: The stream broke (unavailable, deadline, refused token...).
        """
        call = self._method(_payloads(batches), metadata=self._metadata)
        try:
            async for ack in call:
                yield ack.batch_id, ack_error(ack)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()


async def _payloads(batches: AsyncIterator[SpanBatch]) -> AsyncIterator[bytes]:
    async for batch in batches:
        if batch.payload is None:
            batch.payload = stream_request(batch.batch_id, batch.key[0], batch.key[1], batch.spans)
        yield batch.payload


class SpanWriter(Protocol):
    """A client that stores serialized spans (such as :class:`~.local.LocalStoreClient`)."""

    async def add_span_bytes(self, spans: Sequence[bytes], rollout_id: str, attempt_id: str) -> Any:
        """Store serialized ``lightning.v1.Span`` messages of one attempt."""
        ...


class CallSink:
    """One ``add_span_bytes`` call per batch; the Store's errors are its answers, so a session never breaks.

    Each batch is handed to the Store as soon as it is read, in the order read, without waiting for the
    batches before it to be stored: a durable Store commits every batch it holds together, where storing
    one batch after another would cost each batch the commits of all those queued ahead of it (the proxy,
    whose answers wait for their spans, then held each call for as long).
    """

    def __init__(self, writer: SpanWriter, target: str = "in-process", *, depth: int = MAX_IN_FLIGHT) -> None:
        self.writer = writer
        self.target = target
        #: The most batches handed over and not yet answered (the shipper's window bounds them too).
        self.depth = depth

    async def session(self, batches: AsyncIterator[SpanBatch]) -> AsyncGenerator[Ack, None]:
        """Store each batch with one call, and answer each once it is stored (or refused).

        Args:
            batches: The batches to store, as they come.

        Yields:
            (batch id, None when stored or the typed refusal).
        """
        async with contextlib.aclosing(answers_as_done(batches, self._store, self.depth)) as acks:
            async for ack in acks:
                yield ack

    async def _store(self, batch: SpanBatch) -> Ack:
        try:
            await self.writer.add_span_bytes(batch.spans, batch.key[0], batch.key[1])
        except LightningError as exc:
            return batch.batch_id, exc
        return batch.batch_id, None


def sink_for(client: StoreClient | LocalStoreClient) -> SpanSink:
    """The stream of a gRPC client; direct calls for a Store in this process."""
    from . import local

    if isinstance(client, local.LocalStoreClient):
        return CallSink(client)
    return StreamSink.of(client)


class _Outbox:
    """The batches of one session, in the order they are to go: first those to send again, then each new one.

    Closed when its session ends, so that whatever still reads it stops: grpc.aio goes on reading the request
    iterator of a call that has already ended (it cancels that reader only when the call is cancelled while
    still running), and a reader left waiting on a queue shared by every session would take the next batch
    meant for the new session and drop it.
    """

    def __init__(self, resend: list[SpanBatch], max_in_flight: int) -> None:
        self.queue: collections.deque[SpanBatch] = collections.deque(resend)
        self.ready = asyncio.Event()
        #: Batches sent and not yet answered, at most ``max_in_flight``; released by each answer.
        self.window = asyncio.Semaphore(max_in_flight)
        self.closed = False
        if resend:
            self.ready.set()

    def put(self, batch: SpanBatch) -> None:
        if not self.closed:
            self.queue.append(batch)
            self.ready.set()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ready.set()
        self.window.release()  # a reader waiting for room wakes, and stops

    async def batches(self, unacked: Mapping[int, SpanBatch]) -> AsyncIterator[SpanBatch]:
        """The batches to send, as they come, while ``unacked`` holds them; ends once the outbox is closed."""
        while True:
            while not self.queue and not self.closed:
                self.ready.clear()
                await self.ready.wait()
            if self.closed:
                return
            batch = self.queue.popleft()
            if batch.batch_id not in unacked:
                continue  # acknowledged meanwhile
            await self.window.acquire()
            if self.closed:
                return
            yield batch


# ------------------------------------------------------------------ the shipper


class SpanShipper:
    """Batches, sends, acknowledges and, when the Store could not take them, retries or gives up spans.

    Create it anywhere, then :meth:`start` it inside the event loop it is to run in. :meth:`submit`,
    :meth:`take`, :meth:`give_back` and :meth:`settled` may be called from any thread; :meth:`track`,
    :meth:`flush` and :meth:`aclose` from that loop.
    ``linger`` is how long spans wait for more of their attempt before a batch is cut (0: at once;
    spans that arrive while a batch is in flight still share the next one). Log lines are
    ``event={name}_batch_retry``, ``{name}_batch_refused``, ``{name}_stream_broken`` and
    ``{name}s_lost``, on ``log``.
    """

    def __init__(
        self,
        sink: SpanSink,
        *,
        max_batch: int = 256,
        max_batch_bytes: int = 8 * 1024 * 1024,
        linger: float = 0.05,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_backoff: float = 5.0,
        log: logging.Logger | None = None,
        name: str = "span",
    ) -> None:
        self.sink = sink
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.linger = linger
        self.max_in_flight = max_in_flight
        self.max_backoff = max_backoff
        self.log = log or logs.get_logger(__name__)
        self.name = name
        self.stats = ShipperStats()
        self._lock = threading.Lock()
        self._pending: dict[Key, list[bytes]] = collections.defaultdict(list)
        self._pending_tracked: dict[Key, list[tuple[bytes, Tracked]]] = collections.defaultdict(list)
        self._outstanding: dict[Key, _Outstanding] = {}
        self._submitted = 0
        self._done = 0
        self._unacked: collections.OrderedDict[int, SpanBatch] = collections.OrderedDict()
        self._next_batch = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ---------------------------------------------------------------- public
    def start(self) -> SpanShipper:
        """Start sending, from the running event loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            self._wake = asyncio.Event()
            self._has_work = asyncio.Event()
            self._outbox = _Outbox([], self.max_in_flight)
            self._tasks = [
                asyncio.create_task(self._batch_forever(), name=f"{self.name}-batcher"),
                asyncio.create_task(self._send_forever(), name=f"{self.name}-sender"),
            ]
        return self

    @property
    def pending(self) -> int:
        """Spans submitted and not yet stored or given up."""
        with self._lock:
            return self._submitted - self._done

    @property
    def attempts_pending(self) -> int:
        """Attempts with spans submitted and not yet stored or given up (nothing is kept of the others)."""
        with self._lock:
            return len(self._outstanding)

    def submit(self, rollout_id: str, attempt_id: str, span: bytes) -> None:
        """Queue one serialized ``lightning.v1.Span`` of an attempt (any thread)."""
        key = (rollout_id, attempt_id)
        with self._lock:
            bucket = self._pending[key]
            bucket.append(span)
            self._count_submitted(key)
            full = len(bucket) >= self.max_batch
        if full or not self.linger:
            self._wake_up()

    def take(self, rollout_id: str, attempt_id: str) -> list[bytes]:
        """Take back the attempt's spans not sent yet (any thread): the caller stores them itself, with the
        attempt's outcome (``CompleteAttempt``'s spans, one commit and no batch of their own), and this
        shipper forgets them. Spans already sent stay (flush for them), as do tracked ones; nothing is taken
        while a flush waits for the attempt. :meth:`give_back` returns them if the caller cannot store them.
        """
        key = (rollout_id, attempt_id)
        with self._lock:
            entry = self._outstanding.get(key)
            spans = self._pending.get(key)
            if entry is None or not spans or entry.waiters:
                return []
            del self._pending[key]
            entry.submitted -= len(spans)
            self._submitted -= len(spans)
            self.stats.taken += len(spans)
            if entry.done >= entry.submitted:
                del self._outstanding[key]
        return spans

    def give_back(self, rollout_id: str, attempt_id: str, spans: list[bytes]) -> None:
        """Queue again spans :meth:`take` took, which their caller could not store (any thread)."""
        if not spans:
            return
        key = (rollout_id, attempt_id)
        with self._lock:
            self._pending[key][:0] = spans  # ahead of any submitted since they were taken
            entry = self._outstanding.get(key)
            if entry is None:
                entry = self._outstanding[key] = _Outstanding()
            entry.submitted += len(spans)
            self._submitted += len(spans)
            self.stats.taken -= len(spans)
        self._wake_up()

    def settled(self, rollout_id: str | None = None, attempt_id: str | None = None) -> bool:
        """Whether nothing submitted (for one attempt, or all) waits to be stored or given up: a flush
        would answer True at once (any thread)."""
        with self._lock:
            return not self._entries(rollout_id, attempt_id)

    def track(
        self,
        rollout_id: str,
        attempt_id: str,
        span: bytes,
        shrink: Callable[[LightningError], bytes | None] | None = None,
    ) -> asyncio.Future[bool]:
        """Queue a span and return its fate: True once stored, False once given up (see :class:`Tracked`)."""
        tracked = Tracked(asyncio.get_running_loop().create_future(), shrink)
        key = (rollout_id, attempt_id)
        with self._lock:
            bucket = self._pending_tracked[key]
            bucket.append((span, tracked))
            self._count_submitted(key)
            full = len(bucket) >= self.max_batch
        if full or not self.linger:
            self._wake_up()
        return tracked.done

    async def flush(
        self, rollout_id: str | None = None, attempt_id: str | None = None, timeout: float = 30.0
    ) -> bool:
        """Wait until every span submitted so far (for one attempt, or all) is stored or given up.

        False when ``timeout`` seconds passed first.
        """
        loop = asyncio.get_running_loop()
        waiters: list[asyncio.Future[None]] = []
        with self._lock:
            targets = self._entries(rollout_id, attempt_id)
            if not targets:
                return True
            if self._loop is None or self._closed:
                return False
            for entry in targets:
                if entry.done < entry.submitted:
                    waiter: asyncio.Future[None] = loop.create_future()
                    entry.waiters.append((entry.submitted, waiter))
                    waiters.append(waiter)
        if not waiters:
            return True
        self._wake.set()
        _, late = await asyncio.wait(waiters, timeout=max(timeout, 0.0))
        for waiter in late:
            waiter.cancel()  # its entry drops it when that attempt's spans next finish
        return not late

    def _entries(self, rollout_id: str | None, attempt_id: str | None) -> list[_Outstanding]:
        """The outstanding entries a flush waits for (called with the lock held)."""
        if rollout_id is not None and attempt_id is not None:
            entry = self._outstanding.get((rollout_id, attempt_id))
            return [] if entry is None else [entry]
        return [
            entry for (rid, _), entry in self._outstanding.items() if rollout_id is None or rid == rollout_id
        ]

    def _count_submitted(self, key: Key) -> None:
        """One more span of ``key`` submitted (called with the lock held)."""
        entry = self._outstanding.get(key)
        if entry is None:
            entry = self._outstanding[key] = _Outstanding()
        entry.submitted += 1
        self._submitted += 1
        self.stats.submitted += 1

    async def aclose(self, timeout: float = 10.0) -> int:
        """Send what is queued (for up to ``timeout`` seconds), then stop; returns the spans lost."""
        if self._closed:
            return 0
        if self._loop is not None:
            await self.flush(timeout=timeout)
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        lost = self._give_up_everything()
        if lost:
            self.stats.lost += lost
            self.log.error("event=%ss_lost count=%d reason=store_unreachable_at_shutdown", self.name, lost)
        return lost

    # ---------------------------------------------------------------- batching
    def _wake_up(self) -> None:
        if self._loop is None or self._closed:
            return  # not started: start() cuts whatever waits
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _batch_forever(self) -> None:
        while True:
            if self.linger:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.linger)
                except TimeoutError:
                    pass
            else:
                await self._wake.wait()
            self._wake.clear()
            self._cut_batches()

    def _cut_batches(self) -> None:
        with self._lock:
            if not self._pending and not self._pending_tracked:
                return
            taken, self._pending = self._pending, collections.defaultdict(list)
            tracked, self._pending_tracked = self._pending_tracked, collections.defaultdict(list)
        for key, spans in taken.items():
            for start, end in self._ranges(spans):
                self._new_batch(key, spans[start:end])
        for key, items in tracked.items():
            bodies = [body for body, _ in items]
            for start, end in self._ranges(bodies):
                self._new_batch(key, bodies[start:end], [t for _, t in items[start:end]])

    def _ranges(self, spans: list[bytes]) -> Iterator[tuple[int, int]]:
        """Batches of at most ``max_batch`` spans and ``max_batch_bytes`` bytes (or one larger span)."""
        for start in range(0, len(spans), self.max_batch):
            end = min(start + self.max_batch, len(spans))
            if sum(map(len, spans[start:end])) <= self.max_batch_bytes:
                yield start, end
                continue
            first, size = start, 0
            for i in range(start, end):
                n = len(spans[i])
                if i > first and size + n > self.max_batch_bytes:
                    yield first, i
                    first, size = i, 0
                size += n
            yield first, end

    def _new_batch(self, key: Key, spans: list[bytes], tracked: list[Tracked] | None = None) -> None:
        batch = SpanBatch(self._next_batch, key, spans, tracked)
        self._next_batch += 1
        self._unacked[batch.batch_id] = batch
        self._outbox.put(batch)
        self._has_work.set()

    # ---------------------------------------------------------------- sending
    async def _send_forever(self) -> None:
        backoff = 0.1
        while True:
            if not self._unacked:  # open a session only when there is something to send
                await self._has_work.wait()
                self._has_work.clear()
                continue
            # Everything unacknowledged goes (again) on the new session, oldest first.
            self._outbox = outbox = _Outbox(list(self._unacked.values()), self.max_in_flight)
            try:
                async with contextlib.aclosing(self.sink.session(outbox.batches(self._unacked))) as acks:
                    async for batch_id, error in acks:
                        outbox.window.release()
                        backoff = 0.1
                        self._acknowledge(batch_id, error)
                raise ConnectionResetError("the Store ended the session")
            except Exception as exc:  # the way to the Store broke: open it again, resend
                outbox.close()
                if not self._unacked:
                    continue  # the session went idle and broke; nothing to resend
                self.stats.reconnects += 1
                self.log.warning(
                    "event=%s_stream_broken target=%s error=%r unacked=%d retry_in=%.1fs",
                    self.name,
                    self.sink.target,
                    exc,
                    len(self._unacked),
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
            finally:
                outbox.close()

    def _send_again(self, batch: SpanBatch) -> None:
        if batch.batch_id in self._unacked and not self._closed:
            self._outbox.put(batch)

    # ---------------------------------------------------------------- the Store's answers
    def _acknowledge(self, batch_id: int, error: LightningError | None) -> None:
        batch = self._unacked.get(batch_id)
        if batch is None:
            return  # a second answer to a batch sent twice
        if error is None:
            del self._unacked[batch_id]
            self._finish(batch, stored=True)
        elif error.transient:
            batch.tries += 1
            delay = min(0.1 * 2 ** (batch.tries - 1), self.max_backoff)
            self.stats.retried += 1
            self.log.warning(
                "event=%s_batch_retry rollout_id=%s attempt_id=%s spans=%d error=%r retry_in=%.1fs",
                self.name,
                batch.key[0],
                batch.key[1],
                len(batch.spans),
                error,
                delay,
            )
            assert self._loop is not None
            self._loop.call_later(delay, self._send_again, batch)
        else:
            del self._unacked[batch_id]
            if len(batch.spans) > 1 and _may_be_one_span(error):
                for i, span in enumerate(batch.spans):
                    self._new_batch(batch.key, [span], [batch.tracked[i]] if batch.tracked else None)
            else:
                self._refused(batch, error)

    def _refused(self, batch: SpanBatch, error: LightningError) -> None:
        if len(batch.spans) == 1 and batch.tracked and batch.tracked[0].shrink is not None:
            smaller = batch.tracked[0].shrink(error)
            if smaller is not None:
                self._new_batch(batch.key, [smaller], batch.tracked)
                return
        count = len(batch.spans)
        self.stats.rejected += count
        reason = f"{error.reason}: {error.message}"
        if len(self.stats.rejections) < 100:
            self.stats.rejections.append(reason)
        self.log.warning(
            "event=%s_batch_refused rollout_id=%s attempt_id=%s spans=%d reason=%s",
            self.name,
            batch.key[0],
            batch.key[1],
            count,
            reason,
        )
        self._finish(batch, stored=False)

    def _finish(self, batch: SpanBatch, stored: bool) -> None:
        if stored:
            self.stats.acknowledged += len(batch.spans)
        with self._lock:
            ready = self._count_done(batch.key, len(batch.spans))
        for waiter in ready:
            if not waiter.done():
                waiter.set_result(None)
        for tracked in batch.tracked or ():
            if not tracked.done.done():
                tracked.done.set_result(stored)

    def _count_done(self, key: Key, count: int) -> list[asyncio.Future[None]]:
        """``count`` spans of ``key`` stored or given up (lock held): the flushes this completes. The
        entry goes once nothing of its attempt is outstanding."""
        entry = self._outstanding.get(key)
        if entry is None:
            return []
        entry.done += count
        self._done += count
        ready = [w for n, w in entry.waiters if n <= entry.done or w.done()]
        if ready:
            entry.waiters = [(n, w) for n, w in entry.waiters if n > entry.done and not w.done()]
        if entry.done >= entry.submitted:
            del self._outstanding[key]
        return ready

    def _give_up_everything(self) -> int:
        """At close: every span not stored yet counts as lost; whoever waits for one hears False."""
        with self._lock:
            lost = self._submitted - self._done
            waiting = [t for items in self._pending_tracked.values() for _, t in items]
            flushes = [w for entry in self._outstanding.values() for _, w in entry.waiters]
            self._pending.clear()
            self._pending_tracked.clear()
            self._outstanding.clear()
            self._done = self._submitted
        for waiter in flushes:
            if not waiter.done():
                waiter.set_result(None)  # given up counts as done: the flush answers at once
        waiting.extend(t for batch in self._unacked.values() for t in batch.tracked or ())
        self._unacked.clear()
        for tracked in waiting:
            if not tracked.done.done():
                tracked.done.set_result(False)
        return lost


# ------------------------------------------------------------------ on a thread of its own


class SpanStreamer:
    """A :class:`SpanShipper` over ``AddSpansStream`` on a background thread with its own event loop and
    channel (from :func:`~.channel.make_channel`: TLS, token and all of ``ClientConfig``).

    ``submit`` is thread-safe and cheap; ``flush`` blocks, ``aflush`` awaits without blocking the
    caller's loop.
    """

    def __init__(
        self,
        target: str | ClientConfig,
        *,
        token: str | None = None,
        max_batch: int = 256,
        linger: float = 0.05,
        max_in_flight: int = MAX_IN_FLIGHT,
        log: logging.Logger | None = None,
    ) -> None:
        self.config = target if isinstance(target, ClientConfig) else ClientConfig(target=target, token=token)
        self.target = self.config.target
        self.max_batch = max_batch
        self.linger = linger
        self.max_in_flight = max_in_flight
        self._log = log or logs.get_logger(__name__)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="lightning-span-streamer", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    @property
    def stats(self) -> ShipperStats:
        """The counts of the shipper running on this streamer's thread."""
        return self.shipper.stats

    # ---------------------------------------------------------------- public, any thread
    def submit(self, rollout_id: str, attempt_id: str, span: bytes) -> None:
        """Queue one serialized ``lightning.v1.Span`` for its attempt."""
        self.shipper.submit(rollout_id, attempt_id, span)

    def take(self, rollout_id: str, attempt_id: str) -> list[bytes]:
        """The attempt's spans not sent yet, taken back to store with its outcome (:meth:`SpanShipper.take`)."""
        return self.shipper.take(rollout_id, attempt_id)

    def give_back(self, rollout_id: str, attempt_id: str, spans: list[bytes]) -> None:
        """Queue again spans :meth:`take` took, which could not be stored with the outcome."""
        self.shipper.give_back(rollout_id, attempt_id, spans)

    def flush(
        self, rollout_id: str | None = None, attempt_id: str | None = None, timeout: float = 30.0
    ) -> bool:
        """Block until every span submitted so far (for one attempt, or all) is stored. False on timeout."""
        fut: Future[bool] = asyncio.run_coroutine_threadsafe(
            self.shipper.flush(rollout_id, attempt_id, timeout), self._loop
        )
        return fut.result(timeout + 5)

    async def aflush(
        self, rollout_id: str | None = None, attempt_id: str | None = None, timeout: float = 30.0
    ) -> bool:
        """``flush`` for coroutines (does not block the caller's event loop)."""
        if self.shipper.settled(rollout_id, attempt_id):
            return True  # nothing to wait for: no trip to the streamer's thread and back
        fut = asyncio.run_coroutine_threadsafe(
            self.shipper.flush(rollout_id, attempt_id, timeout), self._loop
        )
        return await asyncio.wrap_future(fut)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then stop the thread."""
        if self._closing:
            return
        self._closing = True
        fut = asyncio.run_coroutine_threadsafe(self._stop(timeout), self._loop)
        try:
            fut.result(timeout + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    # ---------------------------------------------------------------- the loop thread
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:
            self._failed = exc
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            close_loop(self._loop)

    async def _start(self) -> None:
        self._channel = make_channel(self.config)
        sink = StreamSink(self._channel, call_metadata(self.config), self.target)
        self.shipper = SpanShipper(
            sink,
            max_batch=self.max_batch,
            linger=self.linger,
            max_in_flight=self.max_in_flight,
            log=self._log,
        ).start()

    async def _stop(self, timeout: float) -> None:
        await self.shipper.aclose(timeout)
        await self._channel.close()
