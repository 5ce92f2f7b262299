"""Ship serialized spans to the Store over the bidirectional AddSpansStream.

Spans are grouped per attempt into batches; each batch stays in memory until the Store
acknowledges it (which it does only after storing it). When the stream breaks, the streamer
reconnects and sends every unacknowledged batch again; the Store keys spans by span id, so
nothing is stored twice. A batch the Store refuses for good (unknown attempt, malformed span) is
dropped with a warning and counted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from lightning_grpc.convert.framing import stream_request
from lightning_grpc.v1 import store_service_pb2 as pb

log = logging.getLogger("lightning_grpc.tracing")

_METHOD = "/lightning.v1.StoreService/AddSpansStream"
Key = tuple[str, str]


@dataclass
class _Batch:
    batch_id: int
    key: Key
    count: int
    payload: bytes


@dataclass
class StreamerStats:
    submitted: int = 0
    acknowledged: int = 0
    rejected: int = 0
    reconnects: int = 0
    rejections: list[str] = field(default_factory=list)


class SpanStreamer:
    """A background thread with its own event loop and channel; ``submit`` is thread-safe and cheap."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        max_batch: int = 256,
        linger: float = 0.05,
        max_in_flight: int = 64,
        channel_options: list[tuple[str, object]] | None = None,
    ) -> None:
        self.target = target
        self.max_batch = max_batch
        self.linger = linger
        self.max_in_flight = max_in_flight
        self.stats = StreamerStats()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._options = channel_options or [
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
        self._lock = threading.Lock()
        self._pending: dict[Key, list[bytes]] = collections.defaultdict(list)
        self._submitted: dict[Key, int] = collections.defaultdict(int)
        self._done: dict[Key, int] = collections.defaultdict(int)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="lightning-span-streamer", daemon=True)
        self._thread.start()
        self._ready.wait()

    # ---------------------------------------------------------------- public, any thread
    def submit(self, rollout_id: str, attempt_id: str, span: bytes) -> None:
        """Queue one serialized ``lightning.v1.Span`` for its attempt."""
        key = (rollout_id, attempt_id)
        with self._lock:
            bucket = self._pending[key]
            bucket.append(span)
            self._submitted[key] += 1
            self.stats.submitted += 1
            full = len(bucket) >= self.max_batch
        if full:
            self._loop.call_soon_threadsafe(self._wake.set)

    def flush(
        self, rollout_id: str | None = None, attempt_id: str | None = None, timeout: float = 30.0
    ) -> bool:
        """Block until every span submitted so far (for one attempt, or all) is stored. False on timeout."""
        fut: Future[bool] = asyncio.run_coroutine_threadsafe(
            self._flush(rollout_id, attempt_id, timeout), self._loop
        )
        return fut.result(timeout + 5)

    async def aflush(
        self, rollout_id: str | None = None, attempt_id: str | None = None, timeout: float = 30.0
    ) -> bool:
        """``flush`` for coroutines (does not block the caller's event loop)."""
        fut = asyncio.run_coroutine_threadsafe(self._flush(rollout_id, attempt_id, timeout), self._loop)
        return await asyncio.wrap_future(fut)

    def close(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self.flush(timeout=timeout)
        self._closing = True
        self._loop.call_soon_threadsafe(self._wake.set)
        self._loop.call_soon_threadsafe(self._has_work.set)
        self._thread.join(timeout)

    # ---------------------------------------------------------------- the loop thread
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        self._has_work = asyncio.Event()
        self._acked = asyncio.Condition()
        self._unacked: collections.OrderedDict[int, _Batch] = collections.OrderedDict()
        self._to_send: asyncio.Queue[_Batch] = asyncio.Queue()
        self._next_batch = 1
        self._ready.set()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        channel = grpc.aio.insecure_channel(self.target, options=self._options)
        batcher = asyncio.create_task(self._batch_forever())
        try:
            await self._stream_forever(channel)
        finally:
            batcher.cancel()
            await channel.close()

    async def _batch_forever(self) -> None:
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), self.linger)
            except TimeoutError:
                pass
            self._wake.clear()
            self._cut_batches()

    def _cut_batches(self) -> None:
        with self._lock:
            taken = {k: v for k, v in self._pending.items() if v}
            self._pending.clear()
        for key, spans in taken.items():
            for start in range(0, len(spans), self.max_batch):
                chunk = spans[start : start + self.max_batch]
                batch_id = self._next_batch
                self._next_batch += 1
                payload = stream_request(batch_id, key[0], key[1], chunk)
                batch = _Batch(batch_id, key, len(chunk), payload)
                self._unacked[batch_id] = batch
                self._to_send.put_nowait(batch)
                self._has_work.set()

    async def _stream_forever(self, channel: grpc.aio.Channel) -> None:
        backoff = 0.1
        while not (self._closing and not self._unacked):
            if not self._unacked:  # open a stream only when there is something to send
                await self._has_work.wait()
                self._has_work.clear()
                continue
            # Everything unacknowledged goes (again) on the new stream, oldest first.
            resend = list(self._unacked.values())
            while not self._to_send.empty():
                self._to_send.get_nowait()
            window = asyncio.Semaphore(self.max_in_flight)
            method: Any = channel.stream_stream(
                _METHOD, response_deserializer=pb.AddSpansStreamResponse.FromString
            )
            call = method(self._requests(resend, window), metadata=self._metadata)
            try:
                async for ack in call:
                    window.release()
                    backoff = 0.1
                    await self._acknowledge(ack)
                    if self._closing and not self._unacked:
                        call.cancel()
                        return
            except grpc.aio.AioRpcError as exc:
                if not self._unacked:
                    continue  # the stream went idle and broke; nothing to resend
                if self._closing and not self._unacked:
                    return
                self.stats.reconnects += 1
                (log.warning if self._unacked else log.info)(
                    "event=span_stream_broken target=%s code=%s unacked=%d retry_in=%.1fs",
                    self.target,
                    exc.code().name,
                    len(self._unacked),
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except asyncio.CancelledError:
                call.cancel()
                raise

    async def _requests(self, resend: list[_Batch], window: asyncio.Semaphore) -> AsyncIterator[bytes]:
        for batch in resend:
            await window.acquire()
            yield batch.payload
        while True:
            if self._closing and not self._unacked:
                return
            try:
                batch = await asyncio.wait_for(self._to_send.get(), 0.5)
            except TimeoutError:
                continue
            if batch.batch_id not in self._unacked:
                continue
            await window.acquire()
            yield batch.payload

    async def _acknowledge(self, ack: pb.AddSpansStreamResponse) -> None:
        batch = self._unacked.pop(ack.batch_id, None)
        if batch is None:
            return  # a duplicate acknowledgement of a resent batch
        if ack.HasField("error"):
            self.stats.rejected += batch.count
            reason = f"{ack.error.reason}: {ack.error.message}"
            if len(self.stats.rejections) < 100:
                self.stats.rejections.append(reason)
            log.warning(
                "event=span_batch_refused rollout_id=%s attempt_id=%s spans=%d reason=%s",
                batch.key[0],
                batch.key[1],
                batch.count,
                reason,
            )
        else:
            self.stats.acknowledged += batch.count
        with self._lock:
            self._done[batch.key] += batch.count
        async with self._acked:
            self._acked.notify_all()

    async def _flush(self, rollout_id: str | None, attempt_id: str | None, timeout: float) -> bool:
        with self._lock:
            if rollout_id is None:
                targets = dict(self._submitted)
            else:
                keys = [
                    k
                    for k in self._submitted
                    if k[0] == rollout_id and (attempt_id is None or k[1] == attempt_id)
                ]
                targets = {k: self._submitted[k] for k in keys}
        self._wake.set()
        deadline = time.monotonic() + timeout

        def done() -> bool:
            with self._lock:
                return all(self._done[k] >= n for k, n in targets.items())

        async with self._acked:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._acked.wait(), remaining)
                except TimeoutError:
                    return done()
        return True
