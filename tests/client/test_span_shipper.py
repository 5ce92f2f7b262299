"""The one span shipper (lightning_grpc.client.spans): what it does with each answer of the Store, the same
for tracing's background streamer, the proxy's recorder over gRPC and the recorder next to an in-process Store."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc import convert, semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.client.local import LocalStoreClient
from lightning_grpc.client.spans import CallSink, SpanBatch, SpanShipper, SpanStreamer, ack_error
from lightning_grpc.errors import (
    InvalidArgumentError,
    LightningError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from lightning_grpc.proxy.recorder import SpanRecorder
from lightning_grpc.server.app import ServerConfig, start_server
from lightning_grpc.types import Span
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb


def make_span(rollout_id: str = "ro-1", attempt_id: str = "at-1", **attributes: Any) -> Span:
    return Span(
        trace_id=os.urandom(16).hex(),
        span_id=os.urandom(8).hex(),
        name="work",
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        attributes=dict(attributes),
    )


def body(span: Span) -> bytes:
    return convert.span_to_pb(span).SerializeToString()


class FakeStore(LocalStoreClient):
    """A Store in this process that takes serialized spans; ``answer`` says what to raise for a batch."""

    def __init__(self, answer: Any = None) -> None:  # no Store behind it
        self.answer = answer or (lambda spans: None)
        self.calls: list[int] = []
        self.stored: list[bytes] = []

    async def add_span_bytes(self, spans: Sequence[bytes], rollout_id: str, attempt_id: str) -> None:
        self.submit_span_bytes(spans, rollout_id, attempt_id)

    def submit_span(self, span: Any, body: bytes, rollout_id: str = "", attempt_id: str = "") -> None:
        self.submit_span_bytes([body], rollout_id, attempt_id)

    def submit_span_bytes(self, spans: Sequence[bytes], rollout_id: str = "", attempt_id: str = "") -> None:
        self.calls.append(len(spans))
        error = self.answer(list(spans))
        if error is not None:
            raise error
        self.stored.extend(spans)


def shipper(store: FakeStore, **options: Any) -> SpanShipper:
    return SpanShipper(CallSink(store), linger=0, max_backoff=0.05, **options).start()


async def test_a_full_store_is_retried_until_it_has_room() -> None:
    refusals = [ResourceExhaustedError("full", reason="STORE_MEMORY_FULL")] * 3
    store = FakeStore(lambda spans: refusals.pop() if refusals else None)
    s = shipper(store)
    done = s.track("ro-1", "at-1", body(make_span()))
    assert await asyncio.wait_for(done, 5) is True
    assert (s.stats.retried, s.stats.rejected, s.stats.acknowledged) == (3, 0, 1)
    await s.aclose()


async def test_a_refused_batch_is_split_so_only_the_bad_span_is_given_up() -> None:
    bad = body(make_span(bad=True))
    store = FakeStore(lambda spans: InvalidArgumentError("spans[1]", "is bad") if bad in spans else None)
    s = shipper(store, max_batch=10)
    good = [body(make_span(n=i)) for i in range(5)]
    futures = [s.track("ro-1", "at-1", b) for b in [*good[:2], bad, *good[2:]]]
    results = await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert store.calls[0] == 6  # one batch first, then each span alone
    assert results == [True, True, False, True, True, True]
    assert sorted(store.stored) == sorted(good)
    assert (s.stats.acknowledged, s.stats.rejected) == (5, 1)
    await s.aclose()


async def test_a_batch_for_an_unknown_attempt_is_given_up_whole() -> None:
    store = FakeStore(lambda spans: NotFoundError("no such attempt", reason="ATTEMPT_NOT_FOUND"))
    s = shipper(store, max_batch=10)
    for i in range(4):
        s.submit("ro-1", "at-gone", body(make_span(n=i)))
    assert await s.flush(timeout=5)
    assert store.calls == [4] and s.stats.rejected == 4
    assert s.stats.rejections[0].startswith("ATTEMPT_NOT_FOUND")
    await s.aclose()


async def test_the_recorder_leaves_out_the_payload_of_a_span_too_large_for_the_store() -> None:
    limit = 2000

    def answer(spans: list[bytes]) -> LightningError | None:
        if any(len(b) > limit for b in spans):
            return ResourceExhaustedError("too large", reason="SPAN_TOO_LARGE")
        return None

    store = FakeStore(answer)
    recorder = SpanRecorder(store, max_backoff=0.05).start()
    big = make_span(**{semconv.LLM_REQUEST: "x" * 5000, semconv.LLM_RESPONSE: "y"})
    small = make_span(**{semconv.LLM_REQUEST: "fine"})
    assert await asyncio.gather(recorder.record(big, wait=5), recorder.record(small, wait=5)) == [True, True]
    kept = {s.span_id: s for s in (convert.span_from_pb(span_pb2.Span.FromString(b)) for b in store.stored)}
    assert kept[big.span_id].attributes[semconv.LLM_REQUEST].startswith("(left out")
    assert kept[small.span_id].attributes[semconv.LLM_REQUEST] == "fine"
    assert (recorder.stored, recorder.dropped) == (2, 0)
    await recorder.close()


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_the_recorder_next_to_the_store_stores_a_span_itself_and_leaves_the_rest_to_the_shipper(
    tmp_path: Path, backend: str
) -> None:
    """With the Store in this process, a call's span is stored by the recorder itself, not batched by the
    shipper (in memory before ``record`` ever waits); a span the Store refuses goes to the shipper, which
    gives it up; and while the shipper holds spans of the attempt, the next span follows them, in order."""
    db = tmp_path / "store.db" if backend == "sqlite" else None
    running = await start_server(ServerConfig(port=0, db=db))
    recorder = SpanRecorder(LocalStoreClient(running.store), max_backoff=0.05).start()
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            rollout = await client.start_rollout({"direct": True})
            assert rollout.latest_attempt
            key = (rollout.rollout_id, rollout.latest_attempt.attempt_id)
            first = make_span(*key, turn=1)
            call = recorder.record(first, wait=5)
            if backend == "memory":  # stored without a single wait
                with pytest.raises(StopIteration) as answered:
                    call.send(None)
                assert answered.value.value is True
            else:
                assert await call is True
            assert [s.span_id for s in await client.query_spans(key[0])] == [first.span_id]
            assert (recorder.stored, recorder.shipper.stats.acknowledged) == (1, 0)

            assert await recorder.record(make_span(key[0], "at-missing"), wait=5) is False
            assert recorder.dropped == 1  # the shipper gave it up (logged), as every refused span

            queued, after = make_span(*key, turn=2), make_span(*key, turn=3)
            held = recorder.submit(queued)  # with the shipper, not yet stored
            assert await recorder.record(after, wait=5) is True and await held is True
            stored = await client.query_spans(key[0])
            assert [s.span_id for s in stored] == [first.span_id, queued.span_id, after.span_id]
            assert [s.sequence_id for s in stored] == [1, 2, 3]
            assert (recorder.stored, recorder.shipper.stats.acknowledged) == (3, 2)
    finally:
        await recorder.close()
        await running.stop()


async def test_what_is_unsent_at_close_is_counted_lost_and_its_waiters_hear_false() -> None:
    store = FakeStore(lambda spans: UnavailableError("down"))
    s = shipper(store)
    futures = [s.track("ro-1", "at-1", body(make_span())) for _ in range(3)]
    s.submit("ro-1", "at-1", body(make_span()))
    assert await s.aclose(timeout=0.3) == 4
    assert [f.result() for f in futures] == [False, False, False]
    assert s.stats.lost == 4


def test_a_refusal_on_the_stream_is_the_same_typed_error_as_a_call_would_raise() -> None:
    full = pb.AddSpansStreamResponse(
        batch_id=1, error=pb.BatchError(code=8, reason="STORE_MEMORY_FULL", message="full")
    )
    error = ack_error(full)
    assert isinstance(error, ResourceExhaustedError) and error.transient
    unknown = ack_error(
        pb.AddSpansStreamResponse(batch_id=2, error=pb.BatchError(code=5, reason="ATTEMPT_NOT_FOUND"))
    )
    assert isinstance(unknown, NotFoundError) and not unknown.transient
    assert ack_error(pb.AddSpansStreamResponse(batch_id=3, stored_count=1)) is None


# ------------------------------------------------------------------ a real Store whose memory is full


@pytest.mark.parametrize("path", ["streamer", "recorder", "recorder-in-process"])
async def test_spans_refused_by_a_full_store_arrive_once_it_has_room(path: str) -> None:
    """The same memory-full refusal is retried on every way spans take to the Store, then stored; a flush
    meanwhile answers False at its timeout, and True once the span is stored."""
    running = await start_server(ServerConfig(port=0, max_memory_bytes=200_000))
    target = f"127.0.0.1:{running.port}"
    try:
        async with StoreClient(target) as client:
            keep = await client.start_rollout({"keep": True})
            filler = await client.start_rollout({"filler": True})
            assert keep.latest_attempt and filler.latest_attempt
            with pytest.raises(ResourceExhaustedError):
                for _ in range(60):
                    ids = (filler.rollout_id, filler.latest_attempt.attempt_id)
                    await client.add_spans([make_span(*ids, blob="z" * 900) for _ in range(20)])
            span = make_span(keep.rollout_id, keep.latest_attempt.attempt_id, wanted=True, blob="w" * 40_000)
            if path == "streamer":
                streamer = SpanStreamer(target)
                streamer.submit(span.rollout_id, span.attempt_id, body(span))
                stats, shipper, flush = streamer.stats, streamer.shipper, streamer.aflush
            else:
                store = (
                    LocalStoreClient(running.store) if path == "recorder-in-process" else StoreClient(target)
                )
                recorder = SpanRecorder(store, max_backoff=0.1).start()
                done = recorder.submit(span)
                stats, shipper, flush = recorder.shipper.stats, recorder.shipper, recorder.shipper.flush
            for _ in range(100):
                if stats.retried:
                    break
                await asyncio.sleep(0.05)
            assert stats.retried >= 1 and stats.rejected == 0  # refused for now, not given up
            assert not await flush(span.rollout_id, span.attempt_id, timeout=0.2)
            assert shipper.attempts_pending == 1
            await client.complete_attempt(filler.rollout_id, filler.latest_attempt.attempt_id, "succeeded")
            await client.delete_rollouts([filler.rollout_id])
            assert await flush(span.rollout_id, span.attempt_id, timeout=20)
            assert shipper.attempts_pending == 0
            if path == "streamer":
                assert await streamer.aflush(timeout=20)
                await asyncio.to_thread(streamer.close)
            else:
                assert await asyncio.wait_for(done, 20) is True
                await recorder.close()
                await store.close()
            assert stats.rejected == 0 and stats.acknowledged == 1
            [stored] = await client.query_spans(keep.rollout_id)
            assert stored.attributes["wanted"] is True
    finally:
        await running.stop()


# ------------------------------------------------------------------ the in-process sink, over a SQLite file


async def listed(batches: list[SpanBatch]) -> AsyncIterator[SpanBatch]:
    for batch in batches:
        yield batch


async def test_the_in_process_sink_hands_every_batch_over_before_the_first_is_stored(tmp_path: Path) -> None:
    """Batches waiting for the SQLite Store's commit do not hold up those behind them: when the first is
    answered, the last one's spans are in the Store already (stored one after another, it would not even
    have been handed over yet), and every batch is answered once."""
    running = await start_server(ServerConfig(port=0, db=tmp_path / "store.db"))
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            rollouts = [await client.start_rollout({"i": i}) for i in range(12)]
            keys = [(r.rollout_id, r.latest_attempt.attempt_id) for r in rollouts if r.latest_attempt]
            batches = [
                SpanBatch(i, key, [body(make_span(*key, n=n)) for n in range(3)])
                for i, key in enumerate(keys, 1)
            ]
            acks = CallSink(LocalStoreClient(running.store)).session(listed(batches))
            first_id, first_error = await anext(acks)
            assert first_error is None
            last = keys[-1] if first_id != len(keys) else keys[0]
            assert len(await client.query_spans(last[0])) == 3  # the other answers not read yet
            answered = [first_id] + [batch_id async for batch_id, error in acks if error is None]
            assert sorted(answered) == [b.batch_id for b in batches]
            for rollout_id, _ in keys:
                assert [s.sequence_id for s in await client.query_spans(rollout_id)] == [1, 2, 3]
    finally:
        await running.stop()


async def test_the_in_process_sink_answers_a_refused_batch_with_its_error_and_keeps_an_attempts_order(
    tmp_path: Path,
) -> None:
    """Batches handed over together: a batch for an unknown attempt is answered with NotFoundError while
    the others are stored, and two batches of one attempt are numbered in the order they came."""
    running = await start_server(ServerConfig(port=0, db=tmp_path / "store.db"))
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            rollout = await client.start_rollout({"order": True})
            assert rollout.latest_attempt
            key = (rollout.rollout_id, rollout.latest_attempt.attempt_id)
            early, late = make_span(*key, turn=1), make_span(*key, turn=2)
            batches = [
                SpanBatch(1, key, [body(early)]),
                SpanBatch(
                    2, (rollout.rollout_id, "at-missing"), [body(make_span(rollout.rollout_id, "at-missing"))]
                ),
                SpanBatch(3, key, [body(late)]),
            ]
            sink = CallSink(LocalStoreClient(running.store))
            answers = {batch_id: error async for batch_id, error in sink.session(listed(batches))}
            assert answers[1] is None and answers[3] is None
            assert isinstance(answers[2], NotFoundError)
            stored = await client.query_spans(rollout.rollout_id)
            assert [(s.span_id, s.sequence_id) for s in stored] == [(early.span_id, 1), (late.span_id, 2)]
    finally:
        await running.stop()


async def test_a_shipper_keeps_nothing_of_an_attempt_once_its_spans_are_stored(tmp_path: Path) -> None:
    """A long-lived shipper (a runner's, the proxy's) holds nothing of an attempt once its spans are stored:
    each attempt's flush answers True and forgets it; spans submitted for it later are counted afresh."""
    running = await start_server(ServerConfig(port=0, db=tmp_path / "store.db"))
    s = SpanShipper(CallSink(LocalStoreClient(running.store)), linger=0.05).start()
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            rollouts = [await client.start_rollout({"i": i}) for i in range(60)]
            keys = [(r.rollout_id, r.latest_attempt.attempt_id) for r in rollouts if r.latest_attempt]
            for key in keys:
                s.submit(*key, body(make_span(*key)))
                s.submit(*key, body(make_span(*key)))
            assert s.attempts_pending == len(keys) and s.pending == 2 * len(keys)
            flushed = await asyncio.gather(*(s.flush(*key, timeout=10) for key in keys))
            assert flushed == [True] * len(keys)
            assert s.attempts_pending == 0 and s.pending == 0
            s.submit(*keys[0], body(make_span(*keys[0], late=True)))  # the same attempt again
            assert s.attempts_pending == 1
            assert await s.flush(keys[0][0], timeout=10)
            assert s.attempts_pending == 0
            assert len(await client.query_spans(keys[0][0])) == 3
            assert s.stats.acknowledged == 2 * len(keys) + 1
    finally:
        await s.aclose()
        await running.stop()


async def test_spans_taken_back_are_forgotten_and_those_given_back_are_sent(tmp_path: Path) -> None:
    """``take`` hands over an attempt's unsent spans and forgets them (a flush has nothing to wait for);
    spans already sent stay; nothing is taken while a flush waits; ``give_back`` sends them after all."""
    running = await start_server(ServerConfig(port=0, db=tmp_path / "store.db"))
    s = SpanShipper(CallSink(LocalStoreClient(running.store)), linger=60.0).start()
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            r = await client.start_rollout({"i": 0})
            assert r.latest_attempt is not None
            key = (r.rollout_id, r.latest_attempt.attempt_id)
            assert s.settled(*key) and s.take(*key) == []
            first = [body(make_span(*key, n=i)) for i in range(3)]
            for span in first:
                s.submit(*key, span)
            assert not s.settled(*key)
            taken = s.take(*key)
            assert taken == first and s.settled(*key) and s.settled()
            assert (s.pending, s.attempts_pending, s.stats.taken) == (0, 0, 3)
            assert await s.flush(*key, timeout=1)  # nothing to wait for
            assert await client.query_spans(r.rollout_id) == []  # and nothing was sent

            s.submit(*key, body(make_span(*key, n=3)))
            waiting = asyncio.create_task(s.flush(*key, timeout=10))
            await asyncio.sleep(0.05)
            assert s.take(*key) == []  # a flush waits for this one: it is sent, not taken
            assert await waiting

            s.give_back(*key, taken)
            assert (s.pending, s.stats.taken) == (3, 0)
            assert await s.flush(*key, timeout=10)
            stored = await client.query_spans(r.rollout_id)
            assert sorted(sp.attributes["n"] for sp in stored) == [0, 1, 2, 3]
            assert s.stats.acknowledged == 4 and s.settled()
    finally:
        await s.aclose()
        await running.stop()


# ------------------------------------------------------------------ a stream that broke


async def test_every_batch_after_a_broken_stream_goes_on_the_next_one(
    server_process: Any, tmp_path: Any
) -> None:
    """A stream that broke with a batch in flight leaves nothing behind that takes batches meant for the next
    stream (grpc.aio goes on reading the request iterator of a call that has ended): the batch in flight at
    the break, and every batch submitted after the reconnect, are sent on the new stream and stored."""
    db = str(tmp_path / "store.db")
    server = server_process("--db", db, "--port", "0").start()
    target = server.address
    async with StoreClient(target) as client:
        r = await client.start_rollout({"x": 1})
    assert r.latest_attempt is not None
    ids = (r.rollout_id, r.latest_attempt.attempt_id)
    streamer = SpanStreamer(target, linger=0)
    try:
        streamer.submit(*ids, body(make_span(*ids, n=0)))
        assert await streamer.aflush(timeout=10)  # the stream is open
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # the next batch goes out and is never answered
        streamer.submit(*ids, body(make_span(*ids, n=1)))
        assert not await streamer.aflush(timeout=0.5)
        server.kill()  # the stream breaks with that batch in flight
        await asyncio.to_thread(server_process("--db", db, "--port", str(server.port)).start)
        assert await streamer.aflush(timeout=10), "the batch in flight at the break was never stored"
        for n in range(2, 7):
            streamer.submit(*ids, body(make_span(*ids, n=n)))
            assert await streamer.aflush(timeout=10), f"span {n}, sent after the reconnect, was never stored"
        async with StoreClient(target) as client:
            stored = await client.query_spans(r.rollout_id)
        assert sorted(s.attributes["n"] for s in stored) == list(range(7))
        assert streamer.stats.reconnects >= 1 and streamer.stats.rejected == 0
    finally:
        await asyncio.to_thread(streamer.close, 2)
