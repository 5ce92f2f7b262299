"""Workload driver for Agent Lightning 0.3.0's store, through its own HTTP client and OTLP/HTTP route.

    bench/.venv-agl/bin/python bench/agl_peer.py --url http://127.0.0.1:PORT span-ingest --writers 8 \\
        --spans 20000 --path otlp64
    bench/.venv-agl/bin/python bench/agl_peer.py --url http://127.0.0.1:PORT rollout-cycle --rollouts 2000

Runs in bench/.venv-agl (see agl_setup.py) against a server from agl_server.py and prints one JSON object.
Spans come from spanshape.py, as for every other peer, and are built before timing starts. Every timed
loop is bounded by its count and by --max-seconds; a run cut short says so and reports what it did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agl_setup import apply_offline_env

apply_offline_env()

import aiohttp  # noqa: E402
from agentlightning.store.client_server import LightningStoreClient  # noqa: E402
from agentlightning.types import AttemptedRollout, EnqueueRolloutRequest, Span  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue  # noqa: E402
from opentelemetry.proto.resource.v1.resource_pb2 import Resource  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Status  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan  # noqa: E402
from spanshape import SPAN_NAME, span_attributes  # noqa: E402

ROLLOUT_ID_ATTR = "agentlightning.rollout_id"
ATTEMPT_ID_ATTR = "agentlightning.attempt_id"
PROTOBUF = "application/x-protobuf"
SPAN_SECONDS = 0.4125
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
CLIENT_LOGGER = "agentlightning.store.client"


# ------------------------------------------------------------------ small helpers


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_ms(values: Sequence[float], prefix: str = "") -> dict[str, float]:
    return {
        f"{prefix}p50_ms": round(percentile(values, 0.5) * 1000, 3),
        f"{prefix}p99_ms": round(percentile(values, 0.99) * 1000, 3),
    }


def peer_info() -> dict[str, str]:
    return {
        "peer": "agentlightning",
        "version": metadata.version("agentlightning"),
        "litellm_version": metadata.version("litellm"),
        "agentops_version": metadata.version("agentops"),
    }


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class ClientLogCounter(logging.Handler):
    """Counts what the reference client logs about retries and swallowed dequeue failures."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.retry_waits = 0
        self.retry_wait_seconds = 0.0
        self.dequeue_failures = 0
        self.unhealthy = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Waiting ") and "before retrying" in message:
            self.retry_waits += 1
            self.retry_wait_seconds += float(message.split()[1])
        elif message.startswith("dequeue_rollout failed"):
            self.dequeue_failures += 1
        elif message.startswith("Server is not healthy"):
            self.unhealthy += 1

    def report(self) -> dict[str, Any]:
        return {
            "client_retries": self.retry_waits,
            "client_retry_sleep_s": self.retry_wait_seconds,
            "client_unhealthy_probes": self.unhealthy,
            "client_dequeue_failures_logged": self.dequeue_failures,
        }


def watch_client_log() -> ClientLogCounter:
    counter = ClientLogCounter()
    log = logging.getLogger(CLIENT_LOGGER)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(counter)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    log.addHandler(stderr)
    return counter


@dataclass
class Tally:
    """Results shared by the concurrent tasks of one timed phase."""

    latencies: list[float] = field(default_factory=list)
    calls: dict[str, list[float]] = field(default_factory=lambda: {"sequence_id": [], "add_span": []})
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def error(self, exc: BaseException) -> None:
        self.errors[type(exc).__name__] += 1


# ------------------------------------------------------------------ span payloads


def new_trace_id() -> str:
    return uuid.uuid4().hex


def agl_span(rollout_id: str, attempt_id: str, trace_id: str, index: int) -> Span:
    """The benchmark span as the reference's pydantic Span (sequence id set when it is sent)."""
    start = time.time()
    return Span.from_attributes(
        attributes=span_attributes(index),
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=0,
        name=SPAN_NAME,
        trace_id=trace_id,
        span_id=f"{index:016x}",
        start_time=start,
        end_time=start + SPAN_SECONDS,
    )


def any_value(value: object) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=str(value))


def key_values(attributes: dict[str, object]) -> list[KeyValue]:
    return [KeyValue(key=key, value=any_value(value)) for key, value in attributes.items()]


def pb_span(trace_id: str, index: int) -> PbSpan:
    start = time.time_ns()
    return PbSpan(
        trace_id=bytes.fromhex(trace_id),
        span_id=index.to_bytes(8, "big"),
        name=SPAN_NAME,
        kind=PbSpan.SPAN_KIND_CLIENT,
        start_time_unix_nano=start,
        end_time_unix_nano=start + int(SPAN_SECONDS * 1e9),
        attributes=key_values(span_attributes(index)),
        status=Status(code=Status.STATUS_CODE_OK),
    )


def scope_spans(trace_id: str, indices: Sequence[int]) -> ScopeSpans:
    return ScopeSpans(
        scope=InstrumentationScope(name="lightning-grpc-bench"),
        spans=[pb_span(trace_id, i) for i in indices],
    )


def otlp_body(rollout_id: str, attempt_id: str, scope: ScopeSpans) -> bytes:
    """An ExportTraceServiceRequest whose resource names the rollout and attempt, as the reference's exporter
    does; the server then issues the sequence ids itself."""
    resource = Resource(attributes=key_values({ROLLOUT_ID_ATTR: rollout_id, ATTEMPT_ID_ATTR: attempt_id}))
    request = ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[scope])]
    )
    return request.SerializeToString()


async def post_otlp(session: aiohttp.ClientSession, url: str, body: bytes) -> None:
    async with session.post(url, data=body, headers={"Content-Type": PROTOBUF}) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"OTLP export answered HTTP {resp.status}")


async def add_span_with_sequence(client: LightningStoreClient, span: Span) -> None:
    """What the reference does per span when it writes through its client (add_otel_span): one call for a
    sequence id, one call to add the span."""
    span.sequence_id = await client.get_next_span_sequence_id(span.rollout_id, span.attempt_id)
    await client.add_span(span)


# ------------------------------------------------------------------ shared setup


async def start_attempts(client: LightningStoreClient, count: int, label: str) -> list[tuple[str, str]]:
    out = []
    for i in range(count):
        attempted = await client.start_rollout(input={label: i}, worker_id=f"bench-{label}-{i}")
        out.append((attempted.rollout_id, attempted.attempt.attempt_id))
    return out


async def enqueue(client: LightningStoreClient, count: int, chunk: int, label: str) -> list[str]:
    ids: list[str] = []
    for start in range(0, count, chunk):
        requests = [EnqueueRolloutRequest(input={label: i}) for i in range(start, min(start + chunk, count))]
        ids += [r.rollout_id for r in await client.enqueue_many_rollouts(requests)]
    return ids


async def stored_spans(client: LightningStoreClient, attempts: Sequence[tuple[str, str]]) -> tuple[int, bool]:
    """How many spans the store holds for these attempts, and whether those read back carry exactly the
    attributes that were sent (the span id encodes the spanshape index)."""
    total, intact = 0, True
    for rollout_id, attempt_id in attempts:
        items = (await client.query_spans(rollout_id, attempt_id)).items
        total += len(items)
        intact = intact and all(s.attributes == span_attributes(int(s.span_id, 16)) for s in items)
    return total, intact


# ------------------------------------------------------------------ 1. span ingest


async def single_writer(
    client: LightningStoreClient, spans: list[Span], deadline: float, tally: Tally
) -> None:
    """Per span: the sequence-id call, then add_span (timed separately and together)."""
    for span in spans:
        if time.perf_counter() > deadline:
            return
        t0 = time.perf_counter()
        try:
            span.sequence_id = await client.get_next_span_sequence_id(span.rollout_id, span.attempt_id)
            t1 = time.perf_counter()
            await client.add_span(span)
        except Exception as exc:
            tally.error(exc)
            continue
        t2 = time.perf_counter()
        tally.latencies.append(t2 - t0)
        tally.calls["sequence_id"].append(t1 - t0)
        tally.calls["add_span"].append(t2 - t1)
        tally.done += 1


async def otlp_writer(
    session: aiohttp.ClientSession, url: str, bodies: list[tuple[bytes, int]], deadline: float, tally: Tally
) -> None:
    for body, count in bodies:
        if time.perf_counter() > deadline:
            return
        t0 = time.perf_counter()
        try:
            await post_otlp(session, url, body)
        except Exception as exc:
            tally.error(exc)
            continue
        tally.latencies.append(time.perf_counter() - t0)
        tally.done += count


def otlp_plan(rollout_id: str, attempt_id: str, indices: list[int], batch: int) -> list[tuple[bytes, int]]:
    trace_id = new_trace_id()
    plan = []
    for start in range(0, len(indices), batch):
        chunk = indices[start : start + batch]
        plan.append((otlp_body(rollout_id, attempt_id, scope_spans(trace_id, chunk)), len(chunk)))
    return plan


async def span_ingest(args: argparse.Namespace, client: LightningStoreClient) -> dict[str, Any]:
    batch = {"single": 1, "otlp1": 1, "otlp64": 64}[args.path]
    attempts = await start_attempts(client, args.writers, "ingest")
    counts = split_evenly(args.spans, args.writers)
    index_sets = [[w * 10_000_000 + i for i in range(n)] for w, n in enumerate(counts)]
    tally = Tally()
    single_plans: list[list[Span]] = []
    otlp_plans: list[list[tuple[bytes, int]]] = []
    if args.path == "single":
        for (rid, aid), indices in zip(attempts, index_sets, strict=True):
            trace_id = new_trace_id()
            single_plans.append([agl_span(rid, aid, trace_id, i) for i in indices])
    else:
        otlp_plans = [
            otlp_plan(rid, aid, ix, batch) for (rid, aid), ix in zip(attempts, index_sets, strict=True)
        ]
    otlp_url = client.otlp_traces_endpoint()
    deadline = time.perf_counter() + args.max_seconds
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        if args.path == "single":
            await asyncio.gather(*(single_writer(client, plan, deadline, tally) for plan in single_plans))
        else:
            await asyncio.gather(*(otlp_writer(session, otlp_url, p, deadline, tally) for p in otlp_plans))
        elapsed = time.perf_counter() - t0
    stored, intact = await stored_spans(client, attempts)
    sample = agl_span("r", "a", new_trace_id(), 0)
    return {
        "workload": "span_ingest",
        "path": args.path,
        "how": {
            "single": "get_next_span_sequence_id + add_span per span (the client's add_otel_span path)",
            "otlp1": "one OTLP/HTTP protobuf POST per span (the OTel tracer's SimpleSpanProcessor path)",
            "otlp64": "OTLP/HTTP protobuf POSTs of 64 spans; the server issues sequence ids",
        }[args.path],
        "calls_per_span": 2 if args.path == "single" else round(1 / batch, 4),
        "writers": args.writers,
        "spans": args.spans,
        "spans_done": tally.done,
        "complete": tally.done == args.spans,
        "stored": stored,
        "stored_attributes_intact": intact,
        "span_json_bytes": len(sample.model_dump_json()),
        "span_otlp_bytes": pb_span(new_trace_id(), 0).ByteSize(),
        "seconds": round(elapsed, 3),
        "spans_per_s": round(tally.done / elapsed, 1) if elapsed > 0 else 0.0,
        "calls": len(tally.latencies) * (2 if args.path == "single" else 1),
        "latency_unit": "span (both calls)" if args.path == "single" else "POST",
        "errors": sum(tally.errors.values()),
        "error_types": dict(tally.errors),
        **latency_ms(tally.latencies),
        **(latency_ms(tally.calls["add_span"], "add_span_call_") if args.path == "single" else {}),
        **(latency_ms(tally.calls["sequence_id"], "sequence_id_call_") if args.path == "single" else {}),
    }


# ------------------------------------------------------------------ 2. rollout cycle


@dataclass
class CycleState:
    total: int
    deadline: float
    claimed: int = 0
    dequeue: list[float] = field(default_factory=list)
    empty_polls: int = 0
    completed: int = 0
    #: When the last rollout was reported done (perf_counter).
    last_done: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)


SpanAdder = Callable[[AttemptedRollout, int], Awaitable[None]]


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def otlp_body_with_ids(rollout_id: str, attempt_id: str, scope_part: bytes) -> bytes:
    """Completes a prebuilt ResourceSpans fragment (its scope_spans) with the resource naming the rollout
    and attempt, known only at dequeue time. Two serialized fragments of one message concatenate into that
    message, so only the small resource is serialized here."""
    resource = Resource(attributes=key_values({ROLLOUT_ID_ATTR: rollout_id, ATTEMPT_ID_ATTR: attempt_id}))
    resource_spans = ResourceSpans(resource=resource).SerializeToString() + scope_part
    return b"\x0a" + varint(len(resource_spans)) + resource_spans  # ExportTraceServiceRequest field 1


def cycle_span_adder(
    args: argparse.Namespace, client: LightningStoreClient, session: aiohttp.ClientSession
) -> SpanAdder:
    """Prebuilds every rollout's span payloads and returns how a worker sends those of its slot."""
    trace_id = new_trace_id()
    n = args.spans_per_rollout
    if args.span_path == "single":
        plans = [
            [agl_span("", "", trace_id, slot * n + i) for i in range(n)] for slot in range(args.rollouts)
        ]

        async def add_single(rollout: AttemptedRollout, slot: int) -> None:
            for span in plans[slot]:
                span.rollout_id, span.attempt_id = rollout.rollout_id, rollout.attempt.attempt_id
                await add_span_with_sequence(client, span)

        return add_single

    batch = 1 if args.span_path == "otlp1" else n
    parts = [
        [
            ResourceSpans(
                scope_spans=[scope_spans(trace_id, range(slot * n + i, slot * n + min(i + batch, n)))]
            ).SerializeToString()
            for i in range(0, n, batch)
        ]
        for slot in range(args.rollouts)
    ]
    url = client.otlp_traces_endpoint()

    async def add_otlp(rollout: AttemptedRollout, slot: int) -> None:
        for part in parts[slot]:
            await post_otlp(
                session, url, otlp_body_with_ids(rollout.rollout_id, rollout.attempt.attempt_id, part)
            )

    return add_otlp


async def cycle_worker(
    client: LightningStoreClient, k: int, state: CycleState, add_spans: SpanAdder, poll_s: float
) -> None:
    while state.claimed < state.total and time.perf_counter() < state.deadline:
        t0 = time.perf_counter()
        rollout = await client.dequeue_rollout(worker_id=f"bench-{k}")
        state.dequeue.append(time.perf_counter() - t0)
        if rollout is None:
            state.empty_polls += 1
            await asyncio.sleep(poll_s)
            continue
        slot = state.claimed
        state.claimed += 1
        try:
            await add_spans(rollout, slot)
            await client.update_attempt(rollout.rollout_id, rollout.attempt.attempt_id, status="succeeded")
        except Exception as exc:
            state.errors[type(exc).__name__] += 1
            continue
        state.completed += 1
        state.last_done = time.perf_counter()


async def rollout_cycle(args: argparse.Namespace, client: LightningStoreClient) -> dict[str, Any]:
    t_setup = time.perf_counter()
    ids = await enqueue(client, args.rollouts, 500, "cycle")
    setup_s = time.perf_counter() - t_setup
    async with aiohttp.ClientSession() as session:
        add_spans = cycle_span_adder(args, client, session)
        state = CycleState(total=len(ids), deadline=time.perf_counter() + args.max_seconds)
        t0 = time.perf_counter()
        await asyncio.gather(
            *(cycle_worker(client, k, state, add_spans, args.poll_interval) for k in range(args.workers))
        )
        workers_done = time.perf_counter() - t0
        # the rate is taken to the last report, as bench/grpc_peer.py takes it (not to the workers' return)
        elapsed = state.last_done - t0 if state.completed else workers_done
    succeeded = await client.query_rollouts(status_in=["succeeded"], limit=1)
    sample = (await client.query_spans(ids[0])).items if ids else []
    n = args.spans_per_rollout
    calls_for_spans = {"single": 2 * n, "otlp1": n, "otlp5": 1}[args.span_path]
    return {
        "workload": "rollout_cycle",
        "workers": args.workers,
        "rollouts": args.rollouts,
        "completed": state.completed,
        "complete": state.completed == args.rollouts,
        "succeeded_in_store": succeeded.total,
        "spans_of_first_rollout": len(sample),
        "first_rollout_spans_intact": all(
            s.attributes == span_attributes(int(s.span_id, 16)) for s in sample
        ),
        "span_path": args.span_path,
        "spans_per_rollout": n,
        "calls_per_rollout": 1 + calls_for_spans + 1,
        "empty_poll_sleep_s": args.poll_interval,
        "empty_polls": state.empty_polls,
        "enqueue_seconds_untimed": round(setup_s, 3),
        "seconds": round(elapsed, 3),
        "workers_done_seconds": round(workers_done, 3),
        "rollouts_per_s": round(state.completed / elapsed, 1) if elapsed > 0 else 0.0,
        "dequeue_calls": len(state.dequeue),
        "errors": sum(state.errors.values()),
        "error_types": dict(state.errors),
        **latency_ms(state.dequeue, "dequeue_"),
    }


# ------------------------------------------------------------------ 3. completion latency


async def wait_finished(
    client: LightningStoreClient, rollout_id: str, wait_timeout: float, poll_s: float, deadline: float
) -> tuple[float, int]:
    """Polls wait_for_rollouts until the rollout is finished; returns when it learned that, and its calls."""
    calls = 0
    while time.perf_counter() < deadline:
        calls += 1
        finished = await client.wait_for_rollouts(rollout_ids=[rollout_id], timeout=wait_timeout)
        if any(r.rollout_id == rollout_id and r.status in TERMINAL for r in finished):
            return time.perf_counter(), calls
        if poll_s > 0:
            await asyncio.sleep(poll_s)
    raise TimeoutError(f"rollout {rollout_id} not seen finished before the time budget ran out")


async def completion_latency(args: argparse.Namespace, client: LightningStoreClient) -> dict[str, Any]:
    samples: list[float] = []
    polls: list[int] = []
    errors: Counter[str] = Counter()
    deadline = time.perf_counter() + args.max_seconds
    for s in range(args.samples):
        if time.perf_counter() > deadline:
            break
        attempted = await client.start_rollout(input={"latency": s}, worker_id="bench-latency")
        waiter = asyncio.create_task(
            wait_finished(client, attempted.rollout_id, args.wait_timeout, args.poll_interval, deadline)
        )
        await asyncio.sleep(0.02)  # the waiter is polling by now
        t0 = time.perf_counter()
        await client.update_attempt(attempted.rollout_id, attempted.attempt.attempt_id, status="succeeded")
        try:
            learned, calls = await waiter
        except TimeoutError as exc:
            errors[type(exc).__name__] += 1
            continue
        samples.append(learned - t0)
        polls.append(calls)
    return {
        "workload": "completion_latency",
        "via": "wait_for_rollouts polling",
        "wait_timeout_s": args.wait_timeout,
        "poll_sleep_s": args.poll_interval,
        "tight_loop": args.poll_interval == 0,
        "samples": len(samples),
        "requested_samples": args.samples,
        "mean_wait_calls_per_sample": round(sum(polls) / len(polls), 1) if polls else 0.0,
        "errors": sum(errors.values()),
        **latency_ms(samples),
    }


# ------------------------------------------------------------------ 4. queries


async def fill_spans(client: LightningStoreClient, rollout_id: str, attempt_id: str, count: int) -> None:
    async with aiohttp.ClientSession() as session:
        for body, _ in otlp_plan(rollout_id, attempt_id, list(range(count)), 64):
            await post_otlp(session, client.otlp_traces_endpoint(), body)


async def mix_statuses(client: LightningStoreClient, claim: int) -> None:
    """Claims some queued rollouts and finishes half of them, so that statuses vary."""
    claimed = await client.dequeue_many_rollouts(limit=claim, worker_id="bench-queries")
    for rollout in claimed[: len(claimed) // 2]:
        await client.update_attempt(rollout.rollout_id, rollout.attempt.attempt_id, status="succeeded")


async def timed_repeat(
    call: Callable[[], Awaitable[int]], repeat: int, deadline: float
) -> tuple[list[float], int]:
    latencies: list[float] = []
    got = 0
    for _ in range(repeat):
        if time.perf_counter() > deadline:
            break
        t0 = time.perf_counter()
        got = await call()
        latencies.append(time.perf_counter() - t0)
    return latencies, got


async def queries(args: argparse.Namespace, client: LightningStoreClient) -> dict[str, Any]:
    t_setup = time.perf_counter()
    ((rollout_id, attempt_id),) = await start_attempts(client, 1, "queries")
    await fill_spans(client, rollout_id, attempt_id, args.spans)
    await enqueue(client, args.rollouts, 1000, "queries")
    await mix_statuses(client, min(1000, args.rollouts // 5))
    setup_s = time.perf_counter() - t_setup

    async def spans_of_rollout() -> int:
        return len((await client.query_spans(rollout_id)).items)

    async def queued_first_page() -> int:
        return len((await client.query_rollouts(status_in=["queuing"], limit=100)).items)

    deadline = time.perf_counter() + args.max_seconds
    span_lat, got_spans = await timed_repeat(spans_of_rollout, args.repeat, deadline)
    rollout_lat, got_page = await timed_repeat(queued_first_page, args.repeat, deadline)
    queued_total = (await client.query_rollouts(status_in=["queuing"], limit=1)).total
    return {
        "workload": "queries",
        "spans_of_rollout": {"spans": got_spans, "repeat": len(span_lat), **latency_ms(span_lat)},
        "list_rollouts_first_page": {
            "rollouts": args.rollouts,
            "queuing": queued_total,
            "page": got_page,
            "repeat": len(rollout_lat),
            **latency_ms(rollout_lat),
        },
        "repeat": args.repeat,
        "setup_seconds_untimed": round(setup_s, 3),
    }


# ------------------------------------------------------------------ main


WORKLOADS: dict[str, Callable[[argparse.Namespace, LightningStoreClient], Awaitable[dict[str, Any]]]] = {
    "span-ingest": span_ingest,
    "rollout-cycle": rollout_cycle,
    "completion-latency": completion_latency,
    "queries": queries,
}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    counter = watch_client_log()
    client = LightningStoreClient(args.url)
    try:
        result = await WORKLOADS[args.workload](args, client)
    except Exception as exc:  # still one JSON object, saying what failed
        result = {"workload": args.workload.replace("-", "_"), "failed": f"{type(exc).__name__}: {exc}"}
    finally:
        await client.close()
    return {**peer_info(), **result, "max_seconds": args.max_seconds, **counter.report()}


def add_budget(sub: argparse.ArgumentParser) -> None:
    """--max-seconds may also follow the workload name; it then overrides the global one."""
    sub.add_argument("--max-seconds", type=float, default=argparse.SUPPRESS, help="as the global option")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="e.g. http://127.0.0.1:4747")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="time budget of the timed phase")
    sub = parser.add_subparsers(dest="workload", required=True)
    p = sub.add_parser("span-ingest")
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--spans", type=int, default=20_000)
    p.add_argument("--path", choices=["single", "otlp1", "otlp64"], default="otlp64")
    add_budget(p)
    p = sub.add_parser("rollout-cycle")
    p.add_argument("--rollouts", type=int, default=2000)
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--spans-per-rollout", type=int, default=5)
    p.add_argument(
        "--span-path",
        choices=["single", "otlp1", "otlp5"],
        default="otlp5",
        help="otlp5: one OTLP POST of the rollout's spans (the default AgentOps tracer batches and exports "
        "over OTLP); otlp1: one POST per span (OTel tracer); single: add_otel_span per span (2 calls)",
    )
    p.add_argument("--poll-interval", type=float, default=0.05, help="sleep after an empty dequeue")
    add_budget(p)
    p = sub.add_parser("completion-latency")
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--wait-timeout", type=float, default=0.1, help="0 to 0.1: the most the client allows")
    p.add_argument("--poll-interval", type=float, default=0.0, help="sleep between polls; 0 = tight loop")
    add_budget(p)
    p = sub.add_parser("queries")
    p.add_argument("--spans", type=int, default=200)
    p.add_argument("--rollouts", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=50)
    add_budget(p)
    args = parser.parse_args(argv)
    if args.workload == "completion-latency" and not 0 <= args.wait_timeout <= 0.1:
        parser.error("--wait-timeout must be between 0 and 0.1 (the reference client refuses more)")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    if "failed" in result:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
