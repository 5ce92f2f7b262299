"""The scaling curve's driver for lightning-grpc: fill a store with finished rollouts, then measure it.

    python bench/scaling_grpc.py --target 127.0.0.1:PORT fill --count 9000 --ids-out ids.txt
    python bench/scaling_grpc.py --target 127.0.0.1:PORT measure --ids-file ids.txt

bench/scaling.py runs it against a `serve` of each backend (bench/scaling_agl.py is Agent Lightning's side).
`fill` prints a progress line per chunk, then one JSON object; `measure` prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpc_peer import SERVICE, SpanFactory, channel, latency_ms

from lightning_grpc.client import StoreClient
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb

#: CompleteAttemptRequest.spans (field 6, length-delimited).
COMPLETE_SPANS_TAG = 0x32
ATTEMPT_SUCCEEDED = 3  # ATTEMPT_STATUS_SUCCEEDED
ROLLOUT_QUEUING, ROLLOUT_SUCCEEDED = 1, 5


async def bounded(calls: Iterable[Callable[[], Awaitable[Any]]], limit: int) -> None:
    """Run the calls with at most ``limit`` in flight."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


def progress(**fields: Any) -> None:
    print(json.dumps({"progress": True, **fields}), flush=True)


# ------------------------------------------------------------------ fill


async def fill(args: argparse.Namespace) -> dict[str, Any]:
    """``count`` finished rollouts of ``spans`` spans each: per chunk one EnqueueRollouts, one
    DequeueRollouts, then one CompleteAttempt per rollout carrying its spans (``concurrency`` in flight)."""
    factory = SpanFactory("a" * 32)
    span_fields = b"".join(factory.field(COMPLETE_SPANS_TAG, i) for i in range(args.spans))
    done = 0
    t0 = time.perf_counter()
    deadline = t0 + args.max_seconds
    async with StoreClient(args.target) as client, channel(args.target) as ch:
        complete = ch.unary_unary(f"{SERVICE}/CompleteAttempt")

        def completion(rid: str, aid: str) -> Callable[[], Awaitable[Any]]:
            head = pb.CompleteAttemptRequest(rollout_id=rid, attempt_id=aid, status=ATTEMPT_SUCCEEDED)
            body = head.SerializeToString() + span_fields
            return lambda: complete(body, timeout=120)

        with open(args.ids_out, "a") as ids_out:
            while done < args.count and time.perf_counter() < deadline:
                n = min(args.chunk, args.count - done)
                await client.enqueue_rollouts([{"input": {"fill": done + i}} for i in range(n)])
                claimed = await client.dequeue_rollouts(n, worker_id="scaling-fill")
                calls = []
                for r in claimed:
                    assert r.latest_attempt is not None
                    calls.append(completion(r.rollout_id, r.latest_attempt.attempt_id))
                await bounded(calls, args.concurrency)
                ids_out.write("".join(r.rollout_id + "\n" for r in claimed))
                done += len(claimed)
                progress(filled=done, seconds=round(time.perf_counter() - t0, 1))
    elapsed = time.perf_counter() - t0
    return {
        "workload": "scaling_fill",
        "filled": done,
        "complete": done == args.count,
        "spans_per_rollout": args.spans,
        "seconds": round(elapsed, 2),
        "rollouts_per_s": round(done / elapsed, 1) if elapsed > 0 else 0.0,
    }


# ------------------------------------------------------------------ measure


async def timed(
    call: Callable[[], Awaitable[Any]], samples: int, max_seconds: float, min_samples: int = 5
) -> list[float]:
    """Latencies of ``call``: ``samples`` of them, fewer (never under ``min_samples``) once time is up."""
    await call()  # warm-up, untimed
    out: list[float] = []
    deadline = time.perf_counter() + max_seconds
    while len(out) < samples and (len(out) < min_samples or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    ids = Path(args.ids_file).read_text().split()
    rng = random.Random(args.seed)
    picks = [rng.choice(ids) for _ in range(args.samples + 1)]
    finished_added = 0
    out: dict[str, Any] = {"workload": "scaling_measure"}
    async with StoreClient(args.target) as client:
        # 1. one old rollout's spans, a random one each time
        it = iter(picks)
        got: list[int] = []

        async def spans_of_rollout() -> None:
            got.append(len(await client.query_spans(next(it))))

        lat = await timed(spans_of_rollout, args.samples, args.max_seconds)
        out["spans_of_rollout"] = {"samples": len(lat), "spans": min(got), **latency_ms(lat)}

        # 2. the first page of a filter that matches every finished rollout
        pages: list[tuple[int, int]] = []

        async def first_page(status: str) -> None:
            page = await client.list_rollouts(status_in=[status], page_size=args.page)
            pages.append((len(page.items), page.total_size))

        lat = await timed(lambda: first_page("succeeded"), args.list_samples, args.max_seconds)
        out["list_succeeded"] = {
            "samples": len(lat),
            "page": pages[-1][0],
            "matches": pages[-1][1],
            **latency_ms(lat),
        }

        # 3. the first page of a filter that matches a few: the queued rollouts
        await client.enqueue_rollouts([{"input": {"queued": i}} for i in range(args.queued)])
        queued = args.queued
        pages.clear()
        lat = await timed(lambda: first_page("queuing"), args.list_samples, args.max_seconds)
        out["list_queuing"] = {
            "samples": len(lat),
            "page": pages[-1][0],
            "matches": pages[-1][1],
            **latency_ms(lat),
        }

        # 4. one dequeue's latency, the queue holding a few rollouts (refilled below 5); each claimed
        # rollout is then finished, untimed
        dequeue_lat: list[float] = []
        deadline = time.perf_counter() + args.max_seconds
        while len(dequeue_lat) < args.samples and (len(dequeue_lat) < 5 or time.perf_counter() < deadline):
            if queued < 5:
                await client.enqueue_rollouts([{"input": {"queued": i}} for i in range(args.queued)])
                queued += args.queued
            t0 = time.perf_counter()
            r = await client.dequeue_rollout(worker_id="scaling-latency")
            dequeue_lat.append(time.perf_counter() - t0)
            assert r is not None and r.latest_attempt is not None
            queued -= 1
            await client.complete_attempt(r.rollout_id, r.latest_attempt.attempt_id, "succeeded")
            finished_added += 1
        for r in await client.dequeue_rollouts(queued, worker_id="scaling-latency") if queued else []:
            assert r.latest_attempt is not None
            await client.complete_attempt(r.rollout_id, r.latest_attempt.attempt_id, "succeeded")
            finished_added += 1
        out["dequeue"] = {
            "samples": len(dequeue_lat),
            "queue_depth": f"5-{args.queued + 4}",
            **latency_ms(dequeue_lat),
        }

        # 5. the rollout cycle: K workers, each reporting a rollout with its spans and claiming the next
        # in one call (CompleteAttempt with dequeue_next), as grpc_peer.py's rollout_cycle
        factory = SpanFactory("b" * 32)
        spans = [span_pb2.Span.FromString(factory.span(i)) for i in range(args.cycle_spans)]
        rates: list[float] = []
        cycle_dequeue: list[float] = []
        for _ in range(args.cycle_reps):
            rate, lat = await cycle(client, args.cycle_rollouts, args.cycle_workers, spans)
            rates.append(rate)
            cycle_dequeue += lat
            finished_added += args.cycle_rollouts
        out["rollout_cycle"] = {
            "rollouts": args.cycle_rollouts,
            "workers": args.cycle_workers,
            "spans_per_rollout": args.cycle_spans,
            "reps": len(rates),
            "rollouts_per_s": sorted(rates)[len(rates) // 2],
            "rollouts_per_s_each": rates,
            **{f"dequeue_{k}": v for k, v in latency_ms(cycle_dequeue).items()},
        }
    out["finished_added"] = finished_added
    return out


async def cycle(
    client: StoreClient, rollouts: int, workers: int, spans: list[span_pb2.Span]
) -> tuple[float, list[float]]:
    """Rollouts per second through the cycle (first claim to last report) and the claim latencies."""
    await client.enqueue_rollouts([{"input": {"cycle": i}} for i in range(rollouts)])
    completed = [0]
    last = [0.0]
    claims: list[float] = []

    async def worker(k: int) -> None:
        t = time.perf_counter()
        got = await client.dequeue_rollout(worker_id=f"scaling-cycle-{k}")
        claims.append(time.perf_counter() - t)
        while got is not None and got.latest_attempt is not None:
            t = time.perf_counter()
            _, _, nxt = await client.complete_and_dequeue(
                got.rollout_id,
                got.latest_attempt.attempt_id,
                "succeeded",
                spans=spans,
                worker_id=f"scaling-cycle-{k}",
            )
            last[0] = time.perf_counter()
            completed[0] += 1
            got = nxt[0] if nxt else None
            if got is not None:
                claims.append(last[0] - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(workers)))
    assert completed[0] == rollouts, (completed[0], rollouts)
    return round(rollouts / (last[0] - t0), 1), claims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    sub = parser.add_subparsers(dest="workload", required=True)
    p = sub.add_parser("fill")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--spans", type=int, default=10)
    p.add_argument("--chunk", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--ids-out", required=True)
    p.add_argument("--max-seconds", type=float, default=600.0)
    p = sub.add_parser("measure")
    p.add_argument("--ids-file", required=True)
    p.add_argument("--samples", type=int, default=200, help="spans-of-a-rollout and dequeue samples")
    p.add_argument("--list-samples", type=int, default=50)
    p.add_argument("--page", type=int, default=50)
    p.add_argument("--queued", type=int, default=20)
    p.add_argument("--cycle-rollouts", type=int, default=256)
    p.add_argument("--cycle-workers", type=int, default=8)
    p.add_argument("--cycle-spans", type=int, default=5)
    p.add_argument("--cycle-reps", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=20.0, help="per timed loop (at least 5 samples)")
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = asyncio.run(fill(args) if args.workload == "fill" else measure(args))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
