"""Writes the proxy's spans into the Store, without losing them, through the span shipper.

Each call's span goes to a :class:`~lightning_grpc.client.spans.SpanShipper`: over the Store's span
stream, or straight into a Store in this process (:class:`LocalStoreClient`). Spans are batched per
attempt without lingering (calls that end while a batch is in flight share the next one), and the
shipper makes the one retry-or-give-up decision: what the Store could not take for a passing reason
(unavailable, deadline, memory full) is sent again with back-off until it is stored or the recorder
closes; span ids make resends harmless. A batch refused for good is split so that only the faulty
spans are given up, each logged. What is the proxy's own stays here: a span larger than the Store
accepts is sent once more with its request and response left out.

:meth:`SpanRecorder.record` resolves once the span is stored, so a caller can hold the end of a
response until then (bounded by a wait it chooses). With the Store in this process it hands the span to
the Store itself, with nothing in between: stored at once in memory, or as soon as its commit is durable.
Under load the shipper's hand-overs (its batcher, its sender, the answer) each waited for a turn of the
busy event loop, and that wait held every answer for a few milliseconds. The shipper still takes the
span when the Store refuses it or its commit fails (it retries or gives up, as for any span), and while
it holds spans of the same attempt (so that an attempt's spans keep the order its calls ended in).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable
from typing import Literal

from lightning_grpc import convert, logs, semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.client.local import LocalStoreClient
from lightning_grpc.client.spans import SpanShipper, sink_for
from lightning_grpc.errors import LightningError, ResourceExhaustedError
from lightning_grpc.types import Span

log = logs.get_logger(__name__)

_ELIDED = "(left out: the span was larger than the Store accepts)"


def _without_payload(span: Span, error: LightningError) -> bytes | None:
    """The span with its request and response left out, once, when the Store found it too large."""
    if not isinstance(error, ResourceExhaustedError) or span.attributes.get(semconv.LLM_REQUEST) == _ELIDED:
        return None
    span.attributes[semconv.LLM_REQUEST] = _ELIDED
    span.attributes[semconv.LLM_RESPONSE] = _ELIDED
    return convert.span_to_pb(span).SerializeToString()


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
        self.shipper = SpanShipper(
            sink_for(client),
            max_batch=max_batch,
            max_batch_bytes=max_batch_bytes,
            linger=0,
            max_backoff=max_backoff,
            log=log,
            name="proxy_span",
        )
        self._started = False
        self._stored_directly = 0
        #: Commits of spans handed to the Store here, not yet durable.
        self._commits: set[asyncio.Future[bool]] = set()

    def start(self) -> SpanRecorder:
        if not self._started:
            self._started = True
            self.shipper.start()
        return self

    @property
    def stored(self) -> int:
        return self.shipper.stats.acknowledged + self._stored_directly

    @property
    def dropped(self) -> int:
        """Spans refused for good, and spans still unsent when the recorder closed."""
        return self.shipper.stats.rejected + self.shipper.stats.lost

    @property
    def pending(self) -> int:
        return self.shipper.pending

    def submit(self, span: Span) -> asyncio.Future[bool]:
        """Queue a span; the future says True once stored, False if it had to be given up."""
        return self._track(span, convert.span_to_pb(span).SerializeToString())

    def _track(self, span: Span, body: bytes) -> asyncio.Future[bool]:
        return self.shipper.track(
            span.rollout_id, span.attempt_id, body, shrink=functools.partial(_without_payload, span)
        )

    async def record(self, span: Span, wait: float) -> bool:
        """Store a span, waiting up to ``wait`` seconds for the Store; one not stored by then stays queued."""
        message = convert.span_to_pb(span)
        body = message.SerializeToString()
        done = self._store_here(span, message, body)
        if done is True:
            return True
        if done is None:
            done = self._track(span, body)
        elif done.done():
            return done.result()
        if wait <= 0:
            return done.done() and done.result()
        try:
            return await asyncio.wait_for(asyncio.shield(done), wait)
        except TimeoutError:
            log.warning("event=proxy_span_slow span_id=%s waited_s=%.1f", span.span_id, wait)
            return False

    def _store_here(
        self, span: Span, message: convert.SpanMessage, body: bytes
    ) -> Literal[True] | asyncio.Future[bool] | None:
        """Hand the span to a Store in this process: True when it is stored already (a Store that needs no
        commit), a future that says whether its commit stored it, or None where the shipper is to take it: no
        Store here, spans of the attempt still with the shipper, or a span the Store refused (the shipper
        retries what passes and gives up the rest, logged)."""
        if not isinstance(self.client, LocalStoreClient) or not self.shipper.settled(
            span.rollout_id, span.attempt_id
        ):
            return None
        try:
            durable = self.client.submit_span(message, body, span.rollout_id, span.attempt_id)
        except LightningError:
            return None
        if durable is None:
            self._stored_directly += 1
            return True
        commit = asyncio.ensure_future(self._committed_or_resent(durable, span, body))
        self._commits.add(commit)
        commit.add_done_callback(self._commits.discard)
        return commit

    async def _committed_or_resent(self, durable: Awaitable[None], span: Span, body: bytes) -> bool:
        """Whether the span is stored: its commit, or else the shipper's resend (its span id makes a
        resend of a span that was stored after all harmless)."""
        try:
            await durable
        except Exception as exc:  # a commit that failed, whatever the error: the shipper takes the span
            log.info("event=proxy_span_commit_failed span_id=%s error=%r", span.span_id, exc)
            return await self._track(span, body)
        self._stored_directly += 1
        return True

    async def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (trying for up to ``timeout`` seconds), then stop."""
        if self._commits:  # their spans go to the shipper if their commit fails
            await asyncio.wait(set(self._commits), timeout=timeout)
        if self._started:
            await self.shipper.aclose(timeout)
