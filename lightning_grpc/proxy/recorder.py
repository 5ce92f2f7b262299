"""Writes the proxy's spans into the Store in batches, without losing them.

One writer task takes whatever spans are waiting and sends them in one ``AddSpans`` (calls that
end while a write is in flight share the next one). A write the Store could not take for a
passing reason (unavailable, deadline) is retried with back-off until it succeeds or the recorder
closes; span ids make resends harmless. A batch refused for good (an attempt deleted meanwhile, a
span too large) is split so that only the faulty spans are given up, each logged.

:meth:`SpanRecorder.record` resolves once the span is stored, so a caller can hold the end of a
response until then (bounded by a wait it chooses).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.client.local import LocalStoreClient
from lightning_grpc.errors import (
    DeadlineExceededError,
    LightningError,
    ResourceExhaustedError,
    UnavailableError,
)
from lightning_grpc.types import Span

log = logging.getLogger("lightning_grpc.proxy")

TRANSIENT = (UnavailableError, DeadlineExceededError)
_ELIDED = "(left out: the span was larger than the Store accepts)"


def _approximate_size(span: Span) -> int:
    """Bytes a span takes on the wire, roughly: its strings, and a few bytes per number."""
    total = 256
    for value in span.attributes.values():
        if isinstance(value, str | bytes):
            total += len(value)
        elif isinstance(value, list):
            total += 10 * len(value)
        else:
            total += 16
    return total


@dataclass
class _Item:
    span: Span
    done: asyncio.Future[bool]


class SpanRecorder:
    def __init__(
        self,
        client: StoreClient | LocalStoreClient,
        *,
        max_batch: int = 1000,
        max_batch_bytes: int = 8 * 1024 * 1024,
        max_backoff: float = 5.0,
    ) -> None:
        self.client = client
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.max_backoff = max_backoff
        self.stored = 0
        self.dropped = 0
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> SpanRecorder:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="proxy-span-recorder")
        return self

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def submit(self, span: Span) -> asyncio.Future[bool]:
        """Queue a span; the future says True once stored, False if it had to be given up."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Item(span, done))
        return done

    async def record(self, span: Span, wait: float) -> bool:
        """Queue a span and wait up to ``wait`` seconds for the Store; it stays queued after that."""
        done = self.submit(span)
        if wait <= 0:
            return done.done() and done.result()
        try:
            return await asyncio.wait_for(asyncio.shield(done), wait)
        except TimeoutError:
            log.warning("event=proxy_span_slow span_id=%s waited_s=%.1f", span.span_id, wait)
            return False

    async def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (trying for up to ``timeout`` seconds), then stop."""
        self._closing = True
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._drained(), timeout)
        except TimeoutError:
            pass
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        lost = 0
        while not self._queue.empty():
            item = self._queue.get_nowait()
            lost += 1
            if not item.done.done():
                item.done.set_result(False)
        if lost:
            self.dropped += lost
            log.error("event=proxy_spans_lost count=%d reason=store_unreachable_at_shutdown", lost)

    async def _drained(self) -> None:
        await self._queue.join()

    # ------------------------------------------------------------ writer
    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            size = _approximate_size(batch[0].span)
            while len(batch) < self.max_batch and size < self.max_batch_bytes and not self._queue.empty():
                batch.append(self._queue.get_nowait())
                size += _approximate_size(batch[-1].span)
            try:
                await self._write(batch)
            except asyncio.CancelledError:
                unwritten = [item for item in batch if not item.done.done()]
                self.dropped += len(unwritten)
                if unwritten:
                    log.error(
                        "event=proxy_spans_lost count=%d reason=store_unreachable_at_shutdown", len(unwritten)
                    )
                self._finish(unwritten, False)
                raise
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _write(self, batch: list[_Item]) -> None:
        delay = 0.1
        while True:
            try:
                await self.client.add_spans([item.span for item in batch])
            except TRANSIENT as exc:
                log.warning("event=proxy_span_write_retry count=%d error=%r", len(batch), exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
                continue
            except LightningError as exc:
                await self._write_apart(batch, exc)
                return
            self._finish(batch, True)
            return

    async def _write_apart(self, batch: list[_Item], exc: LightningError) -> None:
        if len(batch) > 1:
            for item in batch:
                await self._write([item])
            return
        item = batch[0]
        if (
            isinstance(exc, ResourceExhaustedError)
            and item.span.attributes.get(semconv.LLM_REQUEST) != _ELIDED
        ):
            item.span.attributes[semconv.LLM_REQUEST] = _ELIDED
            item.span.attributes[semconv.LLM_RESPONSE] = _ELIDED
            await self._write(batch)
            return
        self.dropped += 1
        log.error(
            "event=proxy_span_refused rollout_id=%s attempt_id=%s span_id=%s error=%r",
            item.span.rollout_id,
            item.span.attempt_id,
            item.span.span_id,
            exc,
        )
        if not item.done.done():
            item.done.set_result(False)

    def _finish(self, batch: list[_Item], ok: bool) -> None:
        for item in batch:
            if ok:
                self.stored += 1
            if not item.done.done():
                item.done.set_result(ok)
