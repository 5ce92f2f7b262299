"""Workload driver for gRPC targets: lightning-grpc servers and the no-op ceiling.

    python bench/grpc_peer.py --target 127.0.0.1:PORT span-ingest --writers 8 --spans 20000 --shape unary64
    python bench/grpc_peer.py --target 127.0.0.1:PORT rollout-cycle --rollouts 2000 --workers 32

Prints one JSON object. Requests are serialized before timing starts, so the client spends as
little CPU as possible and the same bytes go to every target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spanshape import SPAN_NAME, span_attributes

from lightning_grpc import convert
from lightning_grpc.client import StoreClient
from lightning_grpc.types import Span
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb

SERVICE = "/lightning.v1.StoreService"
PLACEHOLDER = "f" * 16
MAX_MESSAGE = 64 * 1024 * 1024


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(values, 0.5) * 1000, 3),
        "p99_ms": round(percentile(values, 0.99) * 1000, 3),
    }


class SpanFactory:
    """Serialized benchmark spans with unique span ids, made by patching a template."""

    def __init__(self, trace_id: str) -> None:
        template = convert.span_to_pb(
            Span(
                trace_id=trace_id,
                span_id=PLACEHOLDER,
                name=SPAN_NAME,
                start_time_unix_nano=time.time_ns(),
                end_time_unix_nano=time.time_ns() + 412_500_000,
                attributes=span_attributes(0),
            )
        ).SerializeToString()
        cut = template.index(PLACEHOLDER.encode())
        self.head, self.tail = template[:cut], template[cut + 16 :]
        self.size = len(template)

    def span(self, index: int) -> bytes:
        return self.head + f"{index:016x}".encode() + self.tail

    def field(self, tag: int, index: int) -> bytes:
        """The span as a length-delimited field with the given tag byte."""
        return convert.length_delimited(tag, self.span(index))


def add_spans_request(rollout_id: str, attempt_id: str, spans: list[bytes]) -> bytes:
    head = pb.AddSpansRequest(rollout_id=rollout_id, attempt_id=attempt_id).SerializeToString()
    return head + b"".join(spans)


def stream_request(batch_id: int, rollout_id: str, attempt_id: str, spans: list[bytes]) -> bytes:
    head = pb.AddSpansStreamRequest(batch_id=batch_id, rollout_id=rollout_id, attempt_id=attempt_id)
    return head.SerializeToString() + b"".join(spans)


def channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        target,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
        ],
    )


async def make_attempts(target: str, writers: int, setup: bool) -> list[tuple[str, str]]:
    if not setup:
        return [(f"ro-ceiling-{w}", f"at-ceiling-{w}") for w in range(writers)]
    async with StoreClient(target) as client:
        out = []
        for w in range(writers):
            r = await client.start_rollout({"writer": w}, worker_id=f"bench-{w}")
            assert r.latest_attempt is not None
            out.append((r.rollout_id, r.latest_attempt.attempt_id))
        return out


# ------------------------------------------------------------------ span ingest


async def span_ingest(args: argparse.Namespace) -> dict[str, Any]:
    batch = {"single": 1, "unary64": 64, "stream64": 64}[args.shape]
    per_writer = args.spans // args.writers
    attempts = await make_attempts(args.target, args.writers, args.setup)
    tag = 0x22 if args.shape == "stream64" else 0x1A
    plans: list[list[bytes]] = []
    sizes: dict[bytes, int] = {}
    for w, (rid, aid) in enumerate(attempts):
        factory = SpanFactory(uuid.uuid4().hex)
        requests = []
        for start in range(0, per_writer, batch):
            spans = [
                factory.field(tag, w * 10_000_000 + i) for i in range(start, min(start + batch, per_writer))
            ]
            if args.shape == "stream64":
                requests.append(stream_request(len(requests) + 1, rid, aid, spans))
            else:
                requests.append(add_spans_request(rid, aid, spans))
            sizes[requests[-1]] = len(spans)
        plans.append(requests)
    span_bytes = SpanFactory("0" * 32).size
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + args.max_seconds
    done = [0]

    async def unary_writer(ch: grpc.aio.Channel, requests: list[bytes]) -> None:
        nonlocal errors
        call = ch.unary_unary(f"{SERVICE}/AddSpans")
        for req in requests:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            try:
                await call(req, timeout=60)
            except grpc.aio.AioRpcError:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
            done[0] += sizes[req]

    async def stream_writer(ch: grpc.aio.Channel, requests: list[bytes]) -> None:
        window = asyncio.Semaphore(8)
        sent: dict[int, float] = {}
        counts = [sizes[r] for r in requests]

        async def produce():  # type: ignore[no-untyped-def]
            for i, req in enumerate(requests, 1):
                if time.perf_counter() > deadline:
                    return
                await window.acquire()
                sent[i] = time.perf_counter()
                yield req

        call = ch.stream_stream(f"{SERVICE}/AddSpansStream")(produce())
        async for raw in call:
            ack = pb.AddSpansStreamResponse.FromString(raw)
            latencies.append(time.perf_counter() - sent.pop(ack.batch_id))
            done[0] += counts[ack.batch_id - 1]
            window.release()

    async with channel(args.target) as ch:
        writer = stream_writer if args.shape == "stream64" else unary_writer
        t0 = time.perf_counter()
        await asyncio.gather(*(writer(ch, plan) for plan in plans))
        elapsed = time.perf_counter() - t0
    return {
        "workload": "span_ingest",
        "shape": args.shape,
        "writers": args.writers,
        "spans_done": done[0],
        "span_bytes": span_bytes,
        "seconds": round(elapsed, 3),
        "spans_per_s": round(done[0] / elapsed, 1),
        "calls": len(latencies),
        "errors": errors,
        **latency_ms(latencies),
    }


# ------------------------------------------------------------------ rollout cycle


async def rollout_cycle(args: argparse.Namespace) -> dict[str, Any]:
    factory = SpanFactory(uuid.uuid4().hex)
    async with StoreClient(args.target) as client:
        ids = []
        for start in range(0, args.rollouts, 500):
            chunk = await client.enqueue_rollouts(
                [{"input": {"i": i}} for i in range(start, min(start + 500, args.rollouts))]
            )
            ids += [r.rollout_id for r in chunk]
        remaining = [len(ids)]
        dequeue_latency: list[float] = []
        deadline = time.perf_counter() + args.max_seconds
        counter = [0]
        empty_polls = [0]
        last_done = [0.0]  # when the last rollout was reported done

        def five_spans() -> list[span_pb2.Span]:
            spans = []
            for _ in range(5):
                counter[0] += 1
                spans.append(span_pb2.Span.FromString(factory.span(counter[0])))
            return spans

        async def claim(k: int, via: Any = client) -> Any:
            t0 = time.perf_counter()
            got = await via.dequeue_rollout(worker_id=f"bench-{k}", wait=0.2)
            if got is None:
                empty_polls[0] += 1
            else:
                dequeue_latency.append(time.perf_counter() - t0)
            return got

        async def separate(k: int) -> None:
            """Three calls per rollout: dequeue, add its spans, report success."""
            while remaining[0] > 0 and time.perf_counter() < deadline:
                got = await claim(k)
                if got is None or got.latest_attempt is None:
                    continue
                aid = got.latest_attempt.attempt_id
                await client.add_spans(five_spans(), rollout_id=got.rollout_id, attempt_id=aid)
                await client.complete_attempt(got.rollout_id, aid, "succeeded")
                remaining[0] -= 1
                last_done[0] = time.perf_counter()

        async def one_call(k: int, via: Any = client) -> None:
            """One call per rollout (one message, ``via`` a runner session): report success with the spans and
            claim the next rollout."""
            got = None
            while remaining[0] > 0 and time.perf_counter() < deadline:
                if got is None:
                    got = await claim(k, via)
                    continue
                t0 = time.perf_counter()
                _, _, nxt = await via.complete_and_dequeue(
                    got.rollout_id,
                    got.latest_attempt.attempt_id,
                    "succeeded",
                    spans=five_spans(),
                    worker_id=f"bench-{k}",
                    wait=0.2 if remaining[0] > 1 else None,
                )
                remaining[0] -= 1
                last_done[0] = time.perf_counter()
                got = nxt[0] if nxt else None
                if got is not None:
                    dequeue_latency.append(time.perf_counter() - t0)

        async def session(k: int) -> None:
            """:func:`one_call` over the worker's own runner session."""
            async with client.runner_session() as runner:
                await one_call(k, runner)

        worker = {"combined": one_call, "separate": separate, "session": session}[args.api]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(args.workers)))
        workers_done = time.perf_counter() - t0
        completed = len(ids) - remaining[0]
        # the rate is taken to the last report, as bench/agl_peer.py takes it: a worker whose last claim
        # found the queue empty waits out its 0.2 s with nothing left to do before it returns
        elapsed = last_done[0] - t0 if completed else workers_done
    return {
        "workload": "rollout_cycle",
        "workers": args.workers,
        "rollouts": args.rollouts,
        "completed": completed,
        "seconds": round(elapsed, 3),
        "workers_done_seconds": round(workers_done, 3),
        "rollouts_per_s": round(completed / elapsed, 1),
        "api": args.api,
        # round trips a rollout (for the session: messages on the worker's one stream)
        "calls_per_rollout": {"combined": 1, "separate": 3, "session": 1}[args.api],
        "dequeue_wait_s": 0.2,
        "empty_dequeues": empty_polls[0],
        **{f"dequeue_{k}": v for k, v in latency_ms(dequeue_latency).items()},
    }


# ------------------------------------------------------------------ completion latency


async def completion_latency(args: argparse.Namespace) -> dict[str, Any]:
    samples: list[float] = []
    async with StoreClient(args.target) as client:
        for _ in range(args.samples):
            r = await client.start_rollout({"latency": True})
            assert r.latest_attempt is not None
            if args.via == "wait":
                waiter = asyncio.create_task(client.wait_for_rollouts([r.rollout_id], timeout=30))
            else:
                waiter = asyncio.create_task(_watch_until_finished(client, r.rollout_id))
            await asyncio.sleep(0.02)  # the waiter is parked on the server
            t0 = time.perf_counter()
            await client.complete_attempt(r.rollout_id, r.latest_attempt.attempt_id, "succeeded")
            await waiter
            samples.append(time.perf_counter() - t0)
    return {"workload": "completion_latency", "via": args.via, "samples": len(samples), **latency_ms(samples)}


async def _watch_until_finished(client: StoreClient, rollout_id: str) -> None:
    async for event in client.watch_rollouts(rollout_ids=[rollout_id]):
        if event.rollout is not None and event.rollout.status.is_terminal:
            return


# ------------------------------------------------------------------ queries


async def queries(args: argparse.Namespace) -> dict[str, Any]:
    factory = SpanFactory(uuid.uuid4().hex)
    async with StoreClient(args.target) as client, channel(args.target) as ch:
        r = await client.start_rollout({"queries": True})
        assert r.latest_attempt is not None
        spans = [span_pb2.Span.FromString(factory.span(i)) for i in range(args.spans)]
        await client.add_spans(spans, rollout_id=r.rollout_id, attempt_id=r.latest_attempt.attempt_id)
        for start in range(0, args.rollouts, 1000):
            await client.enqueue_rollouts(
                [{"input": i} for i in range(start, min(start + 1000, args.rollouts))]
            )
        claimed = await client.dequeue_rollouts(min(1000, args.rollouts // 5), worker_id="bench")
        for c in claimed[: len(claimed) // 2]:
            assert c.latest_attempt is not None
            await client.complete_attempt(c.rollout_id, c.latest_attempt.attempt_id, "succeeded")
        list_spans = ch.unary_unary(f"{SERVICE}/ListSpans")
        list_rollouts = ch.unary_unary(f"{SERVICE}/ListRollouts")
        span_req = pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id=r.rollout_id)).SerializeToString()
        rollout_req = pb.ListRolloutsRequest(statuses=[1], page_size=100).SerializeToString()  # QUEUING
        span_lat, rollout_lat = [], []
        got_spans = got_rollouts = 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            raw = await list_spans(span_req)
            span_lat.append(time.perf_counter() - t0)
            got_spans = len(pb.ListSpansResponse.FromString(raw).spans)
            t0 = time.perf_counter()
            raw = await list_rollouts(rollout_req)
            rollout_lat.append(time.perf_counter() - t0)
            got_rollouts = len(pb.ListRolloutsResponse.FromString(raw).rollouts)
    return {
        "workload": "queries",
        "spans_of_rollout": {"spans": got_spans, **latency_ms(span_lat)},
        "list_rollouts_first_page": {
            "rollouts": args.rollouts,
            "page": got_rollouts,
            **latency_ms(rollout_lat),
        },
        "repeat": args.repeat,
    }


# ------------------------------------------------------------------ fill (memory after many spans)


async def fill(args: argparse.Namespace) -> dict[str, Any]:
    writers = args.writers
    attempts = await make_attempts(args.target, writers, True)
    per_writer = args.spans // writers
    batch = 512
    t0 = time.perf_counter()

    async def writer(w: int, rid: str, aid: str, ch: grpc.aio.Channel) -> int:
        factory = SpanFactory(uuid.uuid4().hex)
        call = ch.unary_unary(f"{SERVICE}/AddSpans")
        sent = 0
        for start in range(0, per_writer, batch):
            n = min(batch, per_writer - start)
            req = add_spans_request(
                rid, aid, [factory.field(0x1A, w * 100_000_000 + start + i) for i in range(n)]
            )
            await call(req, timeout=120)
            sent += n
        return sent

    async with channel(args.target) as ch:
        counts = await asyncio.gather(*(writer(w, rid, aid, ch) for w, (rid, aid) in enumerate(attempts)))
    elapsed = time.perf_counter() - t0
    return {
        "workload": "fill",
        "spans": sum(counts),
        "seconds": round(elapsed, 1),
        "spans_per_s": round(sum(counts) / elapsed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    sub = parser.add_subparsers(dest="workload", required=True)
    p = sub.add_parser("span-ingest")
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--spans", type=int, default=20_000)
    p.add_argument("--shape", choices=["single", "unary64", "stream64"], default="unary64")
    p.add_argument("--setup", action="store_true", help="create real rollouts first (not for the ceiling)")
    p = sub.add_parser("rollout-cycle")
    p.add_argument("--rollouts", type=int, default=2000)
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--api", choices=["combined", "separate", "session"], default="combined")
    p = sub.add_parser("completion-latency")
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--via", choices=["wait", "watch"], default="wait")
    p = sub.add_parser("queries")
    p.add_argument("--spans", type=int, default=200)
    p.add_argument("--rollouts", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=50)
    p = sub.add_parser("fill")
    p.add_argument("--spans", type=int, default=1_000_000)
    p.add_argument("--writers", type=int, default=8)
    args = parser.parse_args()
    runner = {
        "span-ingest": span_ingest,
        "rollout-cycle": rollout_cycle,
        "completion-latency": completion_latency,
        "queries": queries,
        "fill": fill,
    }[args.workload]
    result = asyncio.run(runner(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
