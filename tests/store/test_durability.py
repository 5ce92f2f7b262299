"""Durability with the SQLite backend: what the server acknowledged survives ``kill -9``.

``test_acknowledged_writes_survive_kill_9`` runs ``lightning-grpc serve`` on one database file and
kills it with SIGKILL at a random moment, several times, while concurrent clients enqueue rollouts
(caller-chosen ids), claim them and stream spans over both the unary ``AddSpans`` and the
bidirectional ``AddSpansStream``, and report outcomes. The clients record only what the server
acknowledged. After every restart (same file, a new port) every acknowledged rollout, claim,
outcome and span must be there, each span exactly once with the sequence id it was given; then
the requests that were in flight at the kill are sent again and must not duplicate anything.

``test_sigterm_drains_in_flight_calls`` checks a graceful stop: long-polling dequeues and writes
in flight finish or end cleanly, the process exits 0, and everything acknowledged is there after a
restart. ``test_two_servers_cannot_share_a_port`` checks that a second server on a taken port
fails to start, exits non-zero, and leaves the first one (and its database) alone.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import random
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lightning_grpc.client.errors import status_lost_to_a_write
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess

SEED = 20_251_121
KILL_CYCLES = 6
CALL_TIMEOUT = 20.0
SUCCEEDED = 3
ROLLOUT_SUCCEEDED = 5
QUEUED = (1, 4)  # QUEUING, REQUEUING
HEX = "0123456789abcdef"


def new_trace_id(rng: random.Random) -> str:
    return "".join(rng.choice(HEX) for _ in range(32))


# ====================================================================== what was acknowledged


@dataclass
class SpanBatch:
    rollout_id: str
    attempt_id: str
    spans: list[span_pb2.Span]


@dataclass
class Ledger:
    """What the server acknowledged, and what it was asked but never answered."""

    rollouts: dict[str, pb.RolloutSpec] = field(default_factory=dict)
    unanswered_enqueues: list[list[pb.RolloutSpec]] = field(default_factory=list)
    #: Rollouts a request that was never answered may or may not have created.
    maybe_rollouts: set[str] = field(default_factory=set)
    #: attempt id -> rollout id, for every acknowledged claim (dequeue or StartRollout).
    attempts: dict[str, str] = field(default_factory=dict)
    unanswered_dequeues: list[pb.DequeueRolloutsRequest] = field(default_factory=list)
    #: (rollout id, attempt id, span id) of every acknowledged span.
    spans: set[tuple[str, str, str]] = field(default_factory=set)
    #: The sequence id AddSpans answered for a span.
    sequence_ids: dict[tuple[str, str], int] = field(default_factory=dict)
    unanswered_batches: list[SpanBatch] = field(default_factory=list)
    succeeded: set[str] = field(default_factory=set)
    unanswered_completions: list[tuple[str, str]] = field(default_factory=list)
    #: How many requests were resent after a kill, and how many of those the store had already done.
    resent: collections.Counter[str] = field(default_factory=collections.Counter)
    already_done: collections.Counter[str] = field(default_factory=collections.Counter)
    in_flight_at_kills: list[int] = field(default_factory=list)

    def record_batch(self, batch: SpanBatch, sequence_ids: Iterable[int] | None = None) -> None:
        for span in batch.spans:
            self.spans.add((batch.rollout_id, batch.attempt_id, span.span_id))
        if sequence_ids is not None:
            for span, seq in zip(batch.spans, sequence_ids, strict=True):
                known = self.sequence_ids.setdefault((batch.attempt_id, span.span_id), seq)
                assert known == seq, f"span {span.span_id} was given sequence id {seq}, earlier {known}"


async def stream_ending(call: Any) -> str:
    """The code a stream call that has ended ended with, read as :func:`failure_code` reads a raised error."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return "OK"
    ended = grpc.aio.AioRpcError(
        code,
        grpc.aio.Metadata(),
        await call.trailing_metadata(),
        await call.details(),
        await call.debug_error_string(),
    )
    return failure_code(ended)


def failure_code(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        if status_lost_to_a_write(exc):
            return "LOCAL_WRITE_FAILED"  # grpc.aio's own error for a stream write on a dead connection
        return exc.code().name
    return type(exc).__name__


# ====================================================================== traffic


class Traffic:
    """Concurrent clients of one server process, recording what it acknowledged."""

    def __init__(
        self,
        address: str,
        ledger: Ledger,
        rng: random.Random,
        cycle: int,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.channel = channel or grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.StoreServiceStub(self.channel)
        self.ledger = ledger
        self.rng = rng
        self.cycle = cycle
        self.ids = itertools.count()
        self.in_flight = 0
        self.acknowledged = 0
        self.killed = False
        self.stop = asyncio.Event()
        self.failures: list[str] = []

    async def close(self) -> None:
        await self.channel.close()

    def next_span_id(self) -> str:
        return f"{self.cycle:04x}{next(self.ids):012x}"

    def failed(self, what: str, exc: BaseException) -> None:
        """A failure is only acceptable once the server was killed: UNAVAILABLE, or a write on a span
        stream that the lost connection already ended (which grpc.aio reports in its own ways)."""
        code = failure_code(exc)
        if not self.killed or code not in ("UNAVAILABLE", "InvalidStateError", "LOCAL_WRITE_FAILED"):
            self.failures.append(f"{what} failed with {code} (killed={self.killed}): {exc}")

    async def call(self, method: str, request: Any) -> Any:
        self.in_flight += 1
        try:
            response = await getattr(self.stub, method)(request, timeout=CALL_TIMEOUT)
        finally:
            self.in_flight -= 1
        self.acknowledged += 1
        return response

    # ------------------------------------------------------------ clients
    async def enqueuer(self, n: int) -> None:
        while not self.stop.is_set():
            specs = []
            for _ in range(self.rng.randint(1, 4)):
                rid = f"dur-{self.cycle}-e{n}-{next(self.ids)}"
                spec = pb.RolloutSpec(rollout_id=rid, group_id=f"g{n}")
                spec.input.struct_value.fields["cycle"].number_value = self.cycle
                spec.metadata.fields["writer"].string_value = f"enqueuer-{n}"
                specs.append(spec)
            try:
                answer = await self.call("EnqueueRollouts", pb.EnqueueRolloutsRequest(rollouts=specs))
            except Exception as exc:
                self.failed("EnqueueRollouts", exc)
                self.ledger.unanswered_enqueues.append(specs)
                return
            assert [r.rollout_id for r in answer.rollouts] == [s.rollout_id for s in specs]
            for spec in specs:
                self.ledger.rollouts[spec.rollout_id] = spec
            await asyncio.sleep(self.rng.uniform(0.01, 0.04))  # about as fast as the workers claim them

    async def worker(self, n: int, use_stream: bool) -> None:
        stream = self.stub.AddSpansStream() if use_stream else None
        batch_ids = itertools.count(1)
        try:
            while not self.stop.is_set():
                request = pb.DequeueRolloutsRequest(
                    worker_id=f"worker-{n}",
                    max_rollouts=1,
                    request_id=f"dq-{self.cycle}-{n}-{next(self.ids)}",
                )
                request.wait_timeout.FromMilliseconds(200)
                try:
                    answer = await self.call("DequeueRollouts", request)
                except Exception as exc:
                    self.failed("DequeueRollouts", exc)
                    self.ledger.unanswered_dequeues.append(request)
                    return
                for rollout in answer.rollouts:
                    self.ledger.attempts[rollout.latest_attempt.attempt_id] = rollout.rollout_id
                for rollout in answer.rollouts:
                    rid, aid = rollout.rollout_id, rollout.latest_attempt.attempt_id
                    trace_id = new_trace_id(self.rng)
                    batches = [
                        SpanBatch(rid, aid, self.make_spans(trace_id, self.rng.randint(1, 6)))
                        for _ in range(self.rng.randint(2, 4))
                    ]
                    if stream is not None:
                        ok = await self.send_on_stream(stream, batches, batch_ids)
                    else:
                        ok = await self.send_unary(batches)
                    if not ok:
                        return
                    if self.rng.random() < 0.5:
                        done = pb.CompleteAttemptRequest(rollout_id=rid, attempt_id=aid, status=SUCCEEDED)  # type: ignore[arg-type]
                        try:
                            await self.call("CompleteAttempt", done)
                        except Exception as exc:
                            self.failed("CompleteAttempt", exc)
                            self.ledger.unanswered_completions.append((rid, aid))
                            return
                        self.ledger.succeeded.add(rid)
        finally:
            if stream is not None:
                stream.cancel()

    def make_spans(self, trace_id: str, count: int) -> list[span_pb2.Span]:
        spans = []
        for i in range(count):
            span_id = self.next_span_id()
            span = span_pb2.Span(
                span_id=span_id,
                trace_id=trace_id,
                parent_span_id=spans[0].span_id if spans else "",
                name=f"span-{span_id}",
                start_time_unix_nano=time.time_ns(),
                end_time_unix_nano=time.time_ns() + i,
            )
            span.attributes["tokens"].int_array_value.values.extend(range(i + 3))
            spans.append(span)
        return spans

    async def send_unary(self, batches: list[SpanBatch]) -> bool:
        for k, batch in enumerate(batches):
            request = pb.AddSpansRequest(
                rollout_id=batch.rollout_id, attempt_id=batch.attempt_id, spans=batch.spans
            )
            try:
                answer = await self.call("AddSpans", request)
            except Exception as exc:
                self.failed("AddSpans", exc)
                self.ledger.unanswered_batches.extend(batches[k:])
                return False
            assert (answer.stored_count, answer.duplicate_count) == (len(batch.spans), 0), answer
            self.ledger.record_batch(batch, answer.sequence_ids)
        return True

    async def send_on_stream(self, stream: Any, batches: list[SpanBatch], batch_ids: Iterator[int]) -> bool:
        """Write every batch, then read their acknowledgements: several are in flight at once."""
        numbered = {next(batch_ids): batch for batch in batches}
        waiting = dict(numbered)
        written = 0
        try:
            for batch_id, batch in numbered.items():
                self.in_flight += 1
                written += 1
                await stream.write(
                    pb.AddSpansStreamRequest(
                        batch_id=batch_id,
                        rollout_id=batch.rollout_id,
                        attempt_id=batch.attempt_id,
                        spans=batch.spans,
                    )
                )
            while waiting:
                ack = await stream.read()
                assert ack is not grpc.aio.EOF, "the span stream ended with batches unacknowledged"
                batch = waiting.pop(ack.batch_id)
                self.in_flight -= 1
                self.acknowledged += 1
                assert not ack.HasField("error"), f"batch refused: {ack.error}"
                assert (ack.stored_count, ack.duplicate_count) == (len(batch.spans), 0), ack
                self.ledger.record_batch(batch)
        except Exception as exc:
            self.in_flight -= written - (len(numbered) - len(waiting))
            self.failed("AddSpansStream", exc)
            self.ledger.unanswered_batches.extend(waiting.values())
            return False
        return True


# ====================================================================== checking a restarted server


async def list_all(stub: Any, method: str, request: Any, items: str) -> list[Any]:
    out: list[Any] = []
    while True:
        answer = await getattr(stub, method)(request, timeout=CALL_TIMEOUT)
        out.extend(getattr(answer, items))
        if not answer.next_page_token:
            return out
        request.page_token = answer.next_page_token


async def verify(stub: Any, ledger: Ledger, backend: str = "sqlite") -> dict[str, int]:
    """Everything acknowledged is there, each span exactly once; nothing else is."""
    rollouts = {
        r.rollout_id: r
        for r in await list_all(stub, "ListRollouts", pb.ListRolloutsRequest(page_size=1000), "rollouts")
    }
    missing = set(ledger.rollouts) - set(rollouts)
    assert not missing, f"{len(missing)} acknowledged rollouts lost, e.g. {sorted(missing)[:5]}"
    maybe = ledger.maybe_rollouts | {s.rollout_id for specs in ledger.unanswered_enqueues for s in specs}
    phantom = set(rollouts) - set(ledger.rollouts) - maybe
    assert not phantom, f"rollouts nobody asked for: {sorted(phantom)[:5]}"
    for rid in ledger.succeeded:
        assert rollouts[rid].status == ROLLOUT_SUCCEEDED, (
            f"{rid} was acknowledged SUCCEEDED, is {rollouts[rid].status}"
        )
    claimed: dict[str, set[str]] = collections.defaultdict(set)
    for aid, rid in ledger.attempts.items():
        claimed[rid].add(aid)
    expected_spans: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)
    for rid, aid, span_id in ledger.spans:
        expected_spans[rid].add((aid, span_id))
    total_attempts = total_spans = 0
    for rid, rollout in rollouts.items():
        if rollout.attempt_count == 0:
            assert rid not in claimed, f"{rid} was claimed (acknowledged) but has no attempt"
            assert rollout.status in QUEUED, f"{rid} has no attempt and is {rollout.status}"
            continue
        attempts = await list_all(
            stub, "ListAttempts", pb.ListAttemptsRequest(rollout_id=rid, page_size=1000), "attempts"
        )
        total_attempts += len(attempts)
        attempt_ids = {a.attempt_id for a in attempts}
        assert claimed[rid] <= attempt_ids, f"{rid}: acknowledged attempts lost: {claimed[rid] - attempt_ids}"
        selector = pb.SpanSelector(rollout_id=rid)
        spans = await list_all(
            stub, "ListSpans", pb.ListSpansRequest(selector=selector, page_size=10_000), "spans"
        )
        total_spans += len(spans)
        counts = collections.Counter((s.attempt_id, s.span_id) for s in spans)
        duplicated = [key for key, n in counts.items() if n > 1]
        assert not duplicated, f"{rid}: spans stored more than once: {duplicated[:5]}"
        lost = expected_spans.get(rid, set()) - set(counts)
        assert not lost, f"{rid}: {len(lost)} acknowledged spans lost, e.g. {sorted(lost)[:3]}"
        for span in spans:
            assert span.name == f"span-{span.span_id}", f"span {span.span_id} came back as {span.name!r}"
            assert list(span.attributes["tokens"].int_array_value.values), (
                f"span {span.span_id} lost attributes"
            )
            seq = ledger.sequence_ids.get((span.attempt_id, span.span_id))
            assert seq is None or seq == span.sequence_id, (
                f"span {span.span_id}: sequence id {span.sequence_id}, acknowledged {seq}"
            )
        per_attempt = collections.defaultdict(list)
        for span in spans:
            per_attempt[span.attempt_id].append(span.sequence_id)
        for aid, seqs in per_attempt.items():
            assert len(seqs) == len(set(seqs)) and min(seqs) > 0, f"attempt {aid}: sequence ids {seqs}"
    stats = await stub.GetStatistics(pb.GetStatisticsRequest(), timeout=CALL_TIMEOUT)
    assert stats.backend == backend
    assert (stats.total_rollouts, stats.total_attempts, stats.total_spans) == (
        len(rollouts),
        total_attempts,
        total_spans,
    ), stats
    return {"rollouts": len(rollouts), "attempts": total_attempts, "spans": total_spans}


async def resend_unanswered(stub: Any, ledger: Ledger) -> None:
    """Send again what was in flight when the server died: done once, never twice."""
    enqueues, ledger.unanswered_enqueues = ledger.unanswered_enqueues, []
    for specs in enqueues:
        answer = await stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=specs), timeout=CALL_TIMEOUT)
        assert [r.rollout_id for r in answer.rollouts] == [s.rollout_id for s in specs]
        ledger.resent["enqueue"] += 1
        for spec in specs:
            ledger.rollouts[spec.rollout_id] = spec
    dequeues, ledger.unanswered_dequeues = ledger.unanswered_dequeues, []
    for request in dequeues:
        request.ClearField("wait_timeout")
        answer = await stub.DequeueRollouts(request, timeout=CALL_TIMEOUT)
        ledger.resent["dequeue"] += 1
        for rollout in answer.rollouts:
            ledger.attempts[rollout.latest_attempt.attempt_id] = rollout.rollout_id
    batches, ledger.unanswered_batches = ledger.unanswered_batches, []
    for batch in batches:
        request = pb.AddSpansRequest(
            rollout_id=batch.rollout_id, attempt_id=batch.attempt_id, spans=batch.spans
        )
        answer = await stub.AddSpans(request, timeout=CALL_TIMEOUT)
        assert answer.stored_count + answer.duplicate_count == len(batch.spans), answer
        ledger.resent["spans"] += 1
        ledger.already_done["spans"] += answer.duplicate_count > 0
        ledger.record_batch(batch, answer.sequence_ids)
    completions, ledger.unanswered_completions = ledger.unanswered_completions, []
    for rid, aid in completions:
        done = pb.CompleteAttemptRequest(rollout_id=rid, attempt_id=aid, status=SUCCEEDED)  # type: ignore[arg-type]
        await stub.CompleteAttempt(done, timeout=CALL_TIMEOUT)
        ledger.resent["complete"] += 1
        ledger.succeeded.add(rid)


# ====================================================================== the tests


def serve_args(db: Path, port: int = 0, grace: float = 2.0) -> list[str]:
    return ["--port", str(port), "--db", str(db), "--grace", str(grace), "--log-level", "INFO"]


async def start(server_process: type[ServerProcess], *args: str) -> ServerProcess:
    """Start a server process without blocking the event loop (traffic may be running on it)."""
    return await asyncio.to_thread(lambda: server_process(*args).start())


async def wait_for_traffic(traffic: Traffic, acknowledged: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while traffic.acknowledged < acknowledged:
        assert not traffic.failures, traffic.failures
        assert time.monotonic() < deadline, f"only {traffic.acknowledged} acknowledgements in {timeout} s"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(170)
async def test_acknowledged_writes_survive_kill_9(
    tmp_path: Path, server_process: type[ServerProcess]
) -> None:
    rng = random.Random(SEED)
    db = tmp_path / "store.db"
    ledger = Ledger()
    server = await start(server_process, *serve_args(db))
    for cycle in range(KILL_CYCLES):
        traffic = Traffic(server.address, ledger, rng, cycle)
        tasks = [asyncio.create_task(traffic.enqueuer(n)) for n in range(2)]
        tasks += [asyncio.create_task(traffic.worker(n, use_stream=n % 2 == 0)) for n in range(4)]
        await wait_for_traffic(traffic, 20)
        await asyncio.sleep(rng.uniform(0.05, 0.8))
        traffic.killed = True
        ledger.in_flight_at_kills.append(traffic.in_flight)
        await asyncio.to_thread(server.kill)
        traffic.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await traffic.close()
        assert not traffic.failures, "\n".join(traffic.failures)
        assert server.proc is not None and server.proc.returncode == -signal.SIGKILL

        server = await start(server_process, *serve_args(db))
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.StoreServiceStub(channel)
            await verify(stub, ledger)
            await resend_unanswered(stub, ledger)
            await verify(stub, ledger)

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.StoreServiceStub(channel)
        # Dequeue never loses a rollout: drain the queue, then every acknowledged rollout has an attempt.
        while (
            await stub.DequeueRollouts(pb.DequeueRolloutsRequest(max_rollouts=10_000), timeout=CALL_TIMEOUT)
        ).rollouts:
            pass
        totals = await verify(stub, ledger)
        rollouts = await list_all(stub, "ListRollouts", pb.ListRolloutsRequest(page_size=1000), "rollouts")
        assert all(r.attempt_count > 0 for r in rollouts if r.rollout_id in ledger.rollouts)
    assert await asyncio.to_thread(server.terminate) == 0
    assert sum(ledger.in_flight_at_kills) > 0, "no kill hit a request in flight"
    assert sum(ledger.resent.values()) > 0, "nothing was in flight at any kill"
    print(
        f"\nkill -9 x{KILL_CYCLES}: {totals}, in flight at the kills {ledger.in_flight_at_kills}, "
        f"resent {dict(ledger.resent)}, of which already done {dict(ledger.already_done)}"
    )
    assert totals["spans"] >= 100 and totals["rollouts"] >= 50, totals


@pytest.mark.timeout(120)
async def test_sigterm_drains_in_flight_calls(tmp_path: Path, server_process: type[ServerProcess]) -> None:
    db = tmp_path / "store.db"
    grace = 3.0
    server = await start(server_process, *serve_args(db, grace=grace))
    ledger = Ledger()
    rng = random.Random(SEED + 1)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.StoreServiceStub(channel)
        started = await stub.StartRollout(
            pb.StartRolloutRequest(rollout=pb.RolloutSpec(rollout_id="drain-0"), worker_id="worker-0"),
            timeout=CALL_TIMEOUT,
        )
        rid, aid = "drain-0", started.rollout.latest_attempt.attempt_id
        ledger.rollouts[rid] = pb.RolloutSpec(rollout_id=rid)
        ledger.attempts[aid] = rid
        trace_id = new_trace_id(rng)
        draining = asyncio.Event()
        outcomes: dict[str, str] = {}
        counter = itertools.count()

        def spans(count: int) -> list[span_pb2.Span]:
            out = []
            for _ in range(count):
                span_id = f"{next(counter):016x}"
                out.append(span_pb2.Span(span_id=span_id, trace_id=trace_id, name=f"span-{span_id}"))
                out[-1].attributes["tokens"].int_array_value.values.append(1)
            return out

        async def long_poll(n: int) -> tuple[str, int, float]:
            request = pb.DequeueRolloutsRequest(worker_id=f"poller-{n}", request_id=f"poll-{n}")
            request.wait_timeout.FromSeconds(60)
            try:
                answer = await stub.DequeueRollouts(request, timeout=90)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, 0, time.monotonic()
            for rollout in answer.rollouts:
                ledger.attempts[rollout.latest_attempt.attempt_id] = rollout.rollout_id
            return "OK", len(answer.rollouts), time.monotonic()

        async def unary_writer(n: int) -> None:
            while True:
                batch = SpanBatch(rid, aid, spans(3))
                new_id = f"drain-{n}-{next(counter)}"
                try:
                    answer = await stub.AddSpans(
                        pb.AddSpansRequest(rollout_id=rid, attempt_id=aid, spans=batch.spans),
                        timeout=CALL_TIMEOUT,
                    )
                    ledger.record_batch(batch, answer.sequence_ids)
                    ledger.maybe_rollouts.add(new_id)
                    await stub.StartRollout(
                        pb.StartRolloutRequest(rollout=pb.RolloutSpec(rollout_id=new_id)),
                        timeout=CALL_TIMEOUT,
                    )
                    ledger.rollouts[new_id] = pb.RolloutSpec(rollout_id=new_id)
                except grpc.aio.AioRpcError as exc:
                    outcomes[f"unary-{n}"] = exc.code().name
                    draining.set()
                    return

        async def stream_writer() -> None:
            """Streams batches until it sees the server draining, then half-closes and reads the rest."""
            call = stub.AddSpansStream()
            sent: dict[int, SpanBatch] = {}
            try:
                for batch_id in itertools.count(1):
                    if draining.is_set():
                        break
                    batch = SpanBatch(rid, aid, spans(2))
                    sent[batch_id] = batch
                    await call.write(
                        pb.AddSpansStreamRequest(
                            batch_id=batch_id, rollout_id=rid, attempt_id=aid, spans=batch.spans
                        )
                    )
                    ack = await call.read()
                    assert not ack.HasField("error"), ack.error
                    ledger.record_batch(sent.pop(ack.batch_id))
                    await asyncio.sleep(0.01)
                await call.done_writing()
                while (ack := await call.read()) is not grpc.aio.EOF:
                    ledger.record_batch(sent.pop(ack.batch_id))
                outcomes["stream"] = await stream_ending(call)
            except grpc.aio.AioRpcError as exc:
                outcomes["stream"] = failure_code(exc)
            except asyncio.InvalidStateError:  # the server ended the stream (drain) between two batches
                outcomes["stream"] = await stream_ending(call)

        async def burst_write(n: int) -> None:
            """One of many writes sent together just before SIGTERM: it must finish, or be refused."""
            batch = SpanBatch(rid, aid, spans(2))
            request = pb.AddSpansRequest(rollout_id=rid, attempt_id=aid, spans=batch.spans)
            try:
                answer = await stub.AddSpans(request, timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                outcomes[f"burst-{n}"] = exc.code().name
                return
            outcomes[f"burst-{n}"] = "OK"
            ledger.record_batch(batch, answer.sequence_ids)

        pollers = [asyncio.create_task(long_poll(n)) for n in range(3)]
        writers = [asyncio.create_task(unary_writer(n)) for n in range(4)]
        writers.append(asyncio.create_task(stream_writer()))
        await asyncio.sleep(0.8)
        assert not any(t.done() for t in pollers + writers), "calls ended before the server was stopped"
        assert server.proc is not None
        writers += [asyncio.create_task(burst_write(n)) for n in range(16)]
        await asyncio.sleep(0.005)  # the burst is on the wire
        sent_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        polled = await asyncio.wait_for(asyncio.gather(*pollers), grace + 5)
        await asyncio.wait_for(asyncio.gather(*writers), grace + 5)
        exit_code = await asyncio.to_thread(server.proc.wait, grace + 10)
        stopped_after = time.monotonic() - sent_at

    for code, claimed, at in polled:  # ended at once, with the status that says: reconnect
        assert code == "UNAVAILABLE", f"a long-polling dequeue ended with {code} instead of UNAVAILABLE"
        assert at - sent_at < 1.0, f"a long-poll answered {at - sent_at:.1f} s after SIGTERM"
        assert claimed == 0
    # the span stream ends between two batches: every batch it saw acknowledged is kept (verified below).
    # LOCAL_WRITE_FAILED: a batch was being written as the server ended the stream, and grpc.aio put its own
    # INTERNAL in place of the server's status (see failure_code); a runner's stream opens again to learn it
    stream = outcomes.pop("stream")
    assert stream in ("OK", "UNAVAILABLE", "LOCAL_WRITE_FAILED"), f"the span stream ended with {stream}"
    # A write in flight at SIGTERM finishes within the grace period; only new calls are refused,
    # with UNAVAILABLE, which clients retry. CANCELLED would leave them not knowing what happened.
    cancelled = sorted(name for name, code in outcomes.items() if code not in ("OK", "UNAVAILABLE"))
    assert not cancelled, f"calls in flight at SIGTERM ended badly: {[(n, outcomes[n]) for n in cancelled]}"
    assert all(outcomes[f"unary-{n}"] == "UNAVAILABLE" for n in range(4)), outcomes
    assert exit_code == 0, f"exit code {exit_code}\n{''.join(server.lines[-20:])}"
    assert stopped_after < grace + 5, f"the server took {stopped_after:.1f} s to stop"
    log = "".join(server.lines)
    assert "event=server_draining" in log and "event=server_stopped" in log
    assert len(ledger.spans) > 20, f"too little traffic before the stop: {len(ledger.spans)} spans"

    server = await start(server_process, *serve_args(db))
    async with grpc.aio.insecure_channel(server.address) as channel:
        await verify(pb_grpc.StoreServiceStub(channel), ledger)
    assert await asyncio.to_thread(server.terminate) == 0


def health_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT
        )
        return int(answer.status)


def enqueue(address: str, *rollout_ids: str) -> None:
    with grpc.insecure_channel(address) as channel:
        specs = [pb.RolloutSpec(rollout_id=rid) for rid in rollout_ids]
        pb_grpc.StoreServiceStub(channel).EnqueueRollouts(
            pb.EnqueueRolloutsRequest(rollouts=specs), timeout=CALL_TIMEOUT
        )


def listed(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        answer = pb_grpc.StoreServiceStub(channel).ListRollouts(
            pb.ListRolloutsRequest(page_size=1000), timeout=CALL_TIMEOUT
        )
        return {r.rollout_id for r in answer.rollouts}


@pytest.mark.parametrize("same_file", [False, True], ids=["own-db", "same-db"])
def test_two_servers_cannot_share_a_port(
    tmp_path: Path, server_process: type[ServerProcess], same_file: bool
) -> None:
    first_db = tmp_path / "first.db"
    first = server_process(*serve_args(first_db)).start()
    enqueue(first.address, "before-1", "before-2")

    second_db = first_db if same_file else tmp_path / "second.db"
    second = server_process(*serve_args(second_db, port=first.port))
    with pytest.raises(RuntimeError, match="server did not start"):
        second.start()
    assert second.proc is not None
    exit_code = second.proc.wait(20)
    assert exit_code != 0, "the second server exited 0 although it could not listen"
    assert "event=server_started" not in "".join(second.lines)

    assert first.proc is not None and first.proc.poll() is None, "the first server died"
    assert health_of(first.address) == health_pb2.HealthCheckResponse.SERVING
    enqueue(first.address, "after-1")
    assert listed(first.address) == {"before-1", "before-2", "after-1"}
    assert first.terminate() == 0
    again = server_process(*serve_args(first_db)).start()
    assert listed(again.address) == {"before-1", "before-2", "after-1"}
    assert again.terminate() == 0


async def test_sigterm_ends_open_streams_and_waits_at_once_with_a_status_that_says_reconnect(
    tmp_path: Path, server_process: type[ServerProcess]
) -> None:
    """Connected runners keep a span stream open and long-poll; a drain must not wait out its grace for them."""
    from lightning_grpc.v1 import trainer_service_pb2 as tpb
    from lightning_grpc.v1 import trainer_service_pb2_grpc as tpb_grpc

    grace = 20.0
    server = await start(server_process, *serve_args(tmp_path / "store.db", grace=grace))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.StoreServiceStub(channel)
        trainer = tpb_grpc.TrainerServiceStub(channel)
        started = await stub.StartRollout(pb.StartRolloutRequest(rollout=pb.RolloutSpec(), worker_id="w"))
        rid, aid = started.rollout.rollout_id, started.rollout.latest_attempt.attempt_id
        stream = stub.AddSpansStream()  # a runner's span stream: open, idle between batches
        span = span_pb2.Span(span_id="0" * 15 + "1", trace_id="0" * 31 + "1", name="step")
        await stream.write(pb.AddSpansStreamRequest(batch_id=1, rollout_id=rid, attempt_id=aid, spans=[span]))
        assert (await stream.read()).stored_count == 1
        tail = stub.TailSpans(pb.TailSpansRequest(selector=pb.SpanSelector(rollout_id=rid), follow=True))
        watch = stub.WatchRollouts(pb.WatchRolloutsRequest())
        training = trainer.WatchTraining(tpb.WatchTrainingRequest(follow=True))
        poll = pb.DequeueRolloutsRequest(worker_id="idle-runner")
        poll.wait_timeout.FromSeconds(60)
        batch = tpb.GetBatchRequest(min_groups=1)
        batch.wait.FromSeconds(60)
        dequeue = stub.DequeueRollouts(poll, timeout=90)
        batches = trainer.GetBatch(batch, timeout=90)  # streams its chunks

        async def ending(call: Any) -> tuple[str, str]:
            try:
                while await call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, exc.details() or ""
            return "OK", ""

        async def answer(call: Any) -> tuple[str, str]:
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, exc.details() or ""
            return "OK", ""

        await asyncio.sleep(0.5)  # every call is in the server
        assert server.proc is not None
        sent_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        endings = await asyncio.wait_for(
            asyncio.gather(
                ending(stream),
                ending(tail),
                ending(watch),
                ending(training),
                ending(batches),
                answer(dequeue),
            ),
            10,
        )
        exit_code = await asyncio.to_thread(server.proc.wait, 10)
        stopped_after = time.monotonic() - sent_at
    assert exit_code == 0
    assert stopped_after < 5, f"the drain took {stopped_after:.1f} s with streams open (grace {grace} s)"
    for code, details in endings:
        assert code == "UNAVAILABLE" and "shutting down" in details, endings


# ---------------------------------------------------------------------- a full disk


async def test_a_full_disk_refuses_writes_loses_nothing_acknowledged_and_recovers(tmp_path: Path) -> None:
    """The database stops growing (SQLite's page limit, as a full disk does): writes are refused with
    RESOURCE_EXHAUSTED (STORE_OUT_OF_SPACE), the write caught in the failing commit with UNAVAILABLE and
    held, reads answer UNAVAILABLE rather than hang; once there is room the held write is stored, new
    writes succeed without a restart, and everything acknowledged before is still there."""
    from lightning_grpc.client import StoreClient
    from lightning_grpc.errors import ResourceExhaustedError, UnavailableError
    from lightning_grpc.server.app import ServerConfig, start_server
    from lightning_grpc.store.sqlite import SqliteBackend
    from tests.helpers import make_spans

    db = tmp_path / "full.db"
    running = await start_server(ServerConfig(port=0, db=db, grace=1.0))
    backend = running.store.backend
    assert isinstance(backend, SqliteBackend)
    client = StoreClient(running.address, retry=None, timeout=10)
    try:
        acknowledged = [
            r.rollout_id for r in await client.enqueue_rollouts([{"input": i} for i in range(20)])
        ]
        [claimed] = await client.dequeue_rollouts(worker_id="w")
        assert claimed.latest_attempt is not None
        rid, aid = claimed.rollout_id, claimed.latest_attempt.attempt_id
        await client.add_spans(make_spans(10), rollout_id=rid, attempt_id=aid)

        backend.set_max_bytes(db.stat().st_size)  # no more room
        big = make_spans(40)
        for span in big:
            span.attributes["blob"] = "x" * 20_000
        with pytest.raises(UnavailableError) as held:
            await client.add_spans(big, rollout_id=rid, attempt_id=aid)
        assert held.value.reason == "STORE_OUT_OF_SPACE" and held.value.transient
        assert backend.out_of_space
        for write in (
            lambda: client.enqueue_rollouts([{"input": "more"}]),
            lambda: client.heartbeat_attempt(rid, aid),
            lambda: client.add_spans(make_spans(1), rollout_id=rid, attempt_id=aid),
        ):
            with pytest.raises(ResourceExhaustedError) as refused:
                await write()
            assert refused.value.reason == "STORE_OUT_OF_SPACE" and refused.value.transient
            assert "disk is full" in refused.value.message
        with pytest.raises(UnavailableError) as unread:
            await client.statistics()
        assert unread.value.reason == "STORE_OUT_OF_SPACE"
        assert not running.store._broken  # out of space is not a broken store

        backend.set_max_bytes(None)  # space returns
        deadline = time.monotonic() + 10
        while backend.out_of_space and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not backend.out_of_space
        stats = await client.statistics()
        assert stats.total_spans == 50  # the held batch was written, once
        more = await client.enqueue_rollouts([{"input": "after"}])
        await client.complete_attempt(rid, aid, "succeeded")
    finally:
        await client.close()
        await running.stop()

    # everything acknowledged is on disk: a new server on the same file finds it
    again = await start_server(ServerConfig(port=0, db=db, grace=1.0))
    client = StoreClient(again.address, retry=None)
    try:
        found = {r.rollout_id for r in await client.query_rollouts()}
        assert set(acknowledged) <= found and more[0].rollout_id in found
        assert len(await client.query_spans(rid)) == 50
        assert (await client.get_rollout(rid)).status.name == "SUCCEEDED"
    finally:
        await client.close()
        await again.stop()


async def test_a_completion_that_claims_the_next_rollout_answers_once_both_are_stored(tmp_path: Path) -> None:
    """CompleteAttempt with dequeue_next stages the claim without waiting for the outcome's commit, and
    answers once both are stored: another connection to the file reads both. When the disk fills under
    it, the call is answered UNAVAILABLE (held), and the same request sent again once there is room gets
    the claim it may have made back, not a second one."""
    import sqlite3

    from lightning_grpc import convert
    from lightning_grpc.client import StoreClient
    from lightning_grpc.errors import UnavailableError
    from lightning_grpc.server.app import ServerConfig, start_server
    from lightning_grpc.store.sqlite import SqliteBackend
    from lightning_grpc.types import AttemptStatus, RolloutStatus
    from tests.helpers import make_spans

    db = tmp_path / "claims.db"
    running = await start_server(ServerConfig(port=0, db=db, grace=1.0))
    backend = running.store.backend
    assert isinstance(backend, SqliteBackend)
    client = StoreClient(running.address, retry=None, timeout=10)

    def stored() -> tuple[dict[str, int], list[str]]:
        """Each rollout's status, and the rollouts with an active attempt of worker w, as the file has them."""
        with sqlite3.connect(db) as conn:
            status = dict(conn.execute("SELECT rollout_id, status FROM rollouts").fetchall())
            attempts = conn.execute(
                "SELECT rollout_id, status FROM attempts WHERE worker_id = 'w'"
            ).fetchall()
        return status, sorted(rid for rid, s in attempts if AttemptStatus(s).is_active)

    try:
        await client.enqueue_rollouts([{"input": i} for i in range(4)])
        [first] = await client.dequeue_rollouts(worker_id="w")
        assert first.latest_attempt is not None
        _, done, [second] = await client.complete_and_dequeue(
            first.rollout_id, first.latest_attempt.attempt_id, "succeeded", spans=make_spans(3), worker_id="w"
        )
        status, active = stored()
        assert status[first.rollout_id] == int(done.status) and done.status.name == "SUCCEEDED"
        assert status[second.rollout_id] == int(second.status) and active == [second.rollout_id]

        assert second.latest_attempt is not None
        request = pb.CompleteAttemptRequest(
            rollout_id=second.rollout_id, attempt_id=second.latest_attempt.attempt_id, status=3
        )
        for span in make_spans(20):  # an outcome that needs more room than the file has
            span.attributes["blob"] = "x" * 20_000
            convert.span_to_pb(span, request.spans.add())
        request.dequeue_next.worker_id = "w"
        request.dequeue_next.request_id = "claim-after-second"
        backend.set_max_bytes(db.stat().st_size)  # no more room
        with pytest.raises(UnavailableError) as held:
            await client._call("CompleteAttempt", request)
        assert held.value.reason == "STORE_OUT_OF_SPACE"

        backend.set_max_bytes(None)  # space returns
        deadline = time.monotonic() + 10
        while backend.out_of_space and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        answer = await client._call("CompleteAttempt", request)  # sent again, as a client retries it
        assert answer.rollout.status == RolloutStatus.SUCCEEDED and len(answer.next_rollouts) == 1
        status, active = stored()
        assert status[second.rollout_id] == RolloutStatus.SUCCEEDED
        assert active == [answer.next_rollouts[0].rollout_id]
        assert len(await client.query_spans(second.rollout_id)) == 20
    finally:
        await client.close()
        await running.stop()


async def fill_until_full(client: Any, rid: str, aid: str) -> None:
    """Write big spans into an attempt until the store is out of space (the last write is held)."""
    from lightning_grpc.errors import UnavailableError
    from tests.helpers import make_spans

    for _ in range(200):
        big = make_spans(20)
        for span in big:
            span.attributes["blob"] = "x" * 20_000
        try:
            await client.add_spans(big, rollout_id=rid, attempt_id=aid)
        except UnavailableError as held:
            assert held.reason == "STORE_OUT_OF_SPACE"
            return
    raise AssertionError("the store never filled up")


async def test_time_the_store_cannot_write_does_not_count_against_a_runner(tmp_path: Path) -> None:
    """The disk is full for longer than the attempts' unresponsive timeout and past their wall-time limit:
    heartbeats are refused meanwhile, yet a runner that keeps beating is not ended UNRESPONSIVE or TIMEOUT
    and completes once space returns. A silent attempt still ends UNRESPONSIVE, the outage not counted."""
    from lightning_grpc.client import StoreClient
    from lightning_grpc.errors import ResourceExhaustedError
    from lightning_grpc.server.app import ServerConfig, start_server
    from lightning_grpc.store.sqlite import SqliteBackend
    from lightning_grpc.types import RolloutConfig

    db = tmp_path / "outage.db"
    running = await start_server(ServerConfig(port=0, db=db, grace=1.0))
    backend = running.store.backend
    assert isinstance(backend, SqliteBackend)
    client = StoreClient(running.address, retry=None, timeout=10)
    silence = 1.5
    try:
        config = RolloutConfig(timeout=4.0, unresponsive_timeout=silence)
        await client.enqueue_rollouts(
            [{"input": "live", "config": config}, {"input": "silent", "config": config}]
        )
        live, silent = await client.dequeue_rollouts(worker_id="w", limit=2)
        assert live.latest_attempt is not None and silent.latest_attempt is not None
        lid, sid = live.latest_attempt.attempt_id, silent.latest_attempt.attempt_id
        await client.heartbeat_attempt(silent.rollout_id, sid)

        backend.set_max_bytes(db.stat().st_size)  # the disk fills up
        await fill_until_full(client, live.rollout_id, lid)
        outage_began = time.monotonic()
        refused = 0
        while time.monotonic() - outage_began < 4.5:  # longer than the silence allowed, and past the timeout
            with pytest.raises(ResourceExhaustedError) as full:
                await client.heartbeat_attempt(live.rollout_id, lid)
            assert full.value.reason == "STORE_OUT_OF_SPACE"
            refused += 1
            await asyncio.sleep(0.5)
        assert refused >= 8
        backend.set_max_bytes(None)  # space returns
        deadline = time.monotonic() + 10
        while backend.out_of_space and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not backend.out_of_space
        outage_ended = time.monotonic()

        beat = await client.heartbeat_attempt(live.rollout_id, lid)
        assert not beat.should_stop and beat.attempt.status.name == "RUNNING", beat
        attempt, rollout = await client.complete_attempt(live.rollout_id, lid, "succeeded")
        assert attempt.status.name == "SUCCEEDED" and rollout.status.name == "SUCCEEDED"

        # the silent attempt was not ended during the outage, and is ended once its silence, less the
        # outage, passes its limit
        (ended,) = await client.wait_for_rollouts([silent.rollout_id], timeout=15)
        ended_after = time.monotonic() - outage_ended
        assert ended.latest_attempt is not None
        assert ended.latest_attempt.status.name == "UNRESPONSIVE", ended.latest_attempt
        assert ended.latest_attempt.end_time is not None
        assert ended_after < silence + 3
    finally:
        await client.close()
        await running.stop()


async def test_deleting_finished_rollouts_makes_room_while_the_store_is_full(tmp_path: Path) -> None:
    """A store at its size limit (serve --max-db-size) takes deletes: deleting finished rollouts frees room,
    the write held for want of space is stored, and writes resume with the same limit, without a restart."""
    from lightning_grpc.client import StoreClient
    from lightning_grpc.errors import ResourceExhaustedError
    from lightning_grpc.server.app import ServerConfig, start_server
    from tests.helpers import make_spans

    db = tmp_path / "limited.db"
    limit = 3 * 1024 * 1024
    running = await start_server(ServerConfig(port=0, db=db, grace=1.0, max_db_bytes=limit))
    backend = running.store.backend
    client = StoreClient(running.address, retry=None, timeout=10)
    try:
        finished = []
        for i in range(4):  # finished rollouts holding most of the room
            done = await client.start_rollout({"old": i}, worker_id="w")
            assert done.latest_attempt is not None
            big = make_spans(25)
            for span in big:
                span.attributes["blob"] = "y" * 20_000
            await client.add_spans(big, rollout_id=done.rollout_id, attempt_id=done.latest_attempt.attempt_id)
            await client.complete_attempt(done.rollout_id, done.latest_attempt.attempt_id, "succeeded")
            finished.append(done.rollout_id)
        keeper = await client.start_rollout({"keep": True}, worker_id="w")
        assert keeper.latest_attempt is not None
        kid = keeper.latest_attempt.attempt_id
        await fill_until_full(client, keeper.rollout_id, kid)
        with pytest.raises(ResourceExhaustedError):
            await client.enqueue_rollouts([{"input": "refused while full"}])
        held_spans = running.store._attempts[kid].span_count  # acknowledged and held alike

        deleted = await client.delete_rollouts(finished)  # taken while full
        assert deleted.deleted_rollouts == len(finished) and deleted.deleted_spans == 100
        deadline = time.monotonic() + 10
        while backend.out_of_space and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not backend.out_of_space, "the held write was not stored after the delete made room"
        assert backend.max_bytes == limit  # the same limit: no restart, no larger size
        more = await client.enqueue_rollouts([{"input": "after"}])
        attempt, _ = await client.complete_attempt(keeper.rollout_id, kid, "succeeded")
        assert attempt.status.name == "SUCCEEDED"
        stored = len(await client.query_spans(keeper.rollout_id))
        assert stored == held_spans  # every span acknowledged or held, the held batch included
    finally:
        await client.close()
        await running.stop()

    again = await start_server(ServerConfig(port=0, db=db, grace=1.0))
    client = StoreClient(again.address, retry=None)
    try:
        found = {r.rollout_id for r in await client.query_rollouts()}
        assert keeper.rollout_id in found and more[0].rollout_id in found
        assert not found & set(finished)
        assert len(await client.query_spans(keeper.rollout_id)) == stored
    finally:
        await client.close()
        await again.stop()


async def test_the_sync_level_is_an_explicit_option_and_full_is_the_default(tmp_path: Path) -> None:
    import sqlite3

    from lightning_grpc.server.app import ServerConfig, start_server

    for level, expected in ((None, 2), ("normal", 1), ("full", 2)):  # PRAGMA synchronous: 1 NORMAL, 2 FULL
        config = ServerConfig(port=0, db=tmp_path / f"{level}.db", grace=0.5)
        if level:
            config = dataclasses.replace(config, sqlite_sync=level)
        running = await start_server(config)
        try:
            conn = running.store.backend._write_conn  # type: ignore[attr-defined]
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == expected
        finally:
            await running.stop()
    with pytest.raises(ValueError, match="synchronous must be one of full, normal"):
        from lightning_grpc.store.sqlite import SqliteBackend

        SqliteBackend(tmp_path / "x.db", synchronous="sometimes")
    del sqlite3


async def test_new_store_files_have_16_kib_pages_and_older_4_kib_files_keep_working(tmp_path: Path) -> None:
    """A store file made by serve has PAGE_SIZE pages; a file that already has 4 KiB pages (made by a release
    before, or by anyone) keeps them, and what is written to it is read back after a restart."""
    import sqlite3

    from lightning_grpc.client import StoreClient
    from lightning_grpc.server.app import ServerConfig
    from lightning_grpc.store.sqlite import PAGE_SIZE
    from tests.helpers import make_spans, serving

    assert PAGE_SIZE == 16384
    old = tmp_path / "old.db"
    made = sqlite3.connect(old)
    made.execute("PRAGMA page_size=4096")
    made.execute("VACUUM")  # the file exists, with 4 KiB pages
    made.close()

    def page_size(running: Any) -> int:
        return int(running.store.backend._write_conn.execute("PRAGMA page_size").fetchone()[0])

    for db, pages in ((tmp_path / "new.db", PAGE_SIZE), (old, 4096)):
        config = ServerConfig(port=0, db=db, grace=0.5)
        written: dict[str, int] = {}
        async with serving(config) as running, StoreClient(running.address, retry=None, timeout=10) as client:
            assert page_size(running) == pages, db.name
            for i in range(3):
                got = await client.start_rollout({"i": i}, worker_id="w")
                assert got.latest_attempt is not None
                spans = make_spans(40)
                await client.add_spans(
                    spans, rollout_id=got.rollout_id, attempt_id=got.latest_attempt.attempt_id
                )
                written[got.rollout_id] = len(spans)
        async with serving(config) as running, StoreClient(running.address, retry=None, timeout=10) as client:
            assert page_size(running) == pages, db.name
            for rollout_id, count in written.items():
                assert len(await client.query_spans(rollout_id)) == count, (db.name, rollout_id)
