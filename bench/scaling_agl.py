"""The scaling curve's driver for Agent Lightning 0.3.0's store, through its own client and OTLP route.

    bench/.venv-agl/bin/python bench/scaling_agl.py --url http://127.0.0.1:PORT fill --count 9000 --ids-out ids.txt
    bench/.venv-agl/bin/python bench/scaling_agl.py --url http://127.0.0.1:PORT measure --ids-file ids.txt

Runs in bench/.venv-agl (see agl_setup.py) against a server from agl_server.py; the same steps as
scaling_grpc.py with the reference's calls. `fill` prints a progress line per chunk, then one JSON
object; `measure` prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agl_setup import apply_offline_env

apply_offline_env()

import aiohttp  # noqa: E402
from agentlightning.store.client_server import LightningStoreClient  # noqa: E402
from agentlightning.types import EnqueueRolloutRequest  # noqa: E402
from agl_peer import (  # noqa: E402
    ATTEMPT_ID_ATTR,
    ROLLOUT_ID_ATTR,
    key_values,
    latency_ms,
    peer_info,
    post_otlp,
    scope_spans,
    varint,
    watch_client_log,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans  # noqa: E402

#: Rollouts per OTLP export while filling (each rollout's spans are one ResourceSpans of the request).
ROLLOUTS_PER_EXPORT = 50


async def bounded(calls: Iterable[Callable[[], Awaitable[Any]]], limit: int) -> None:
    """Run the calls with at most ``limit`` in flight."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


def progress(**fields: Any) -> None:
    print(json.dumps({"progress": True, **fields}), flush=True)


def resource_spans_field(rollout_id: str, attempt_id: str, scope_part: bytes) -> bytes:
    """One ResourceSpans naming the rollout and attempt, as a field of ExportTraceServiceRequest (field 1).
    ``scope_part`` is a serialized ResourceSpans holding only its scope_spans, prebuilt once."""
    resource = Resource(attributes=key_values({ROLLOUT_ID_ATTR: rollout_id, ATTEMPT_ID_ATTR: attempt_id}))
    body = ResourceSpans(resource=resource).SerializeToString() + scope_part
    return b"\x0a" + varint(len(body)) + body


def scope_part(trace_id: str, count: int) -> bytes:
    return ResourceSpans(scope_spans=[scope_spans(trace_id, range(count))]).SerializeToString()


# ------------------------------------------------------------------ fill


async def fill(args: argparse.Namespace, client: LightningStoreClient) -> dict[str, Any]:
    """``count`` finished rollouts of ``spans`` spans each: per chunk enqueue_many_rollouts and
    dequeue_many_rollouts, OTLP exports of 50 rollouts' spans each, then update_attempt(succeeded) per
    rollout (the reference has no batch for it), ``concurrency`` calls in flight."""
    spans_part = scope_part("a" * 32, args.spans)
    url = client.otlp_traces_endpoint()
    done = 0
    t0 = time.perf_counter()
    deadline = t0 + args.max_seconds
    async with aiohttp.ClientSession() as session:
        with open(args.ids_out, "a") as ids_out:
            while done < args.count and time.perf_counter() < deadline:
                n = min(args.chunk, args.count - done)
                await client.enqueue_many_rollouts(
                    [EnqueueRolloutRequest(input={"fill": done + i}) for i in range(n)]
                )
                claimed = list(await client.dequeue_many_rollouts(limit=n, worker_id="scaling-fill"))
                exports = []
                for start in range(0, len(claimed), ROLLOUTS_PER_EXPORT):
                    body = b"".join(
                        resource_spans_field(r.rollout_id, r.attempt.attempt_id, spans_part)
                        for r in claimed[start : start + ROLLOUTS_PER_EXPORT]
                    )
                    exports.append(lambda body=body: post_otlp(session, url, body))
                await bounded(exports, 4)
                await bounded(
                    [
                        lambda r=r: client.update_attempt(
                            r.rollout_id, r.attempt.attempt_id, status="succeeded"
                        )
                        for r in claimed
                    ],
                    args.concurrency,
                )
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


async def measure(args: argparse.Namespace, client: LightningStoreClient) -> dict[str, Any]:
    ids = Path(args.ids_file).read_text().split()
    rng = random.Random(args.seed)
    picks = [rng.choice(ids) for _ in range(args.samples + 1)]
    finished_added = 0
    out: dict[str, Any] = {"workload": "scaling_measure"}

    async def enqueue(count: int, label: str) -> None:
        await client.enqueue_many_rollouts([EnqueueRolloutRequest(input={label: i}) for i in range(count)])

    # 1. one old rollout's spans, a random one each time
    it = iter(picks)
    got: list[int] = []

    async def spans_of_rollout() -> None:
        got.append(len((await client.query_spans(next(it))).items))

    lat = await timed(spans_of_rollout, args.samples, args.max_seconds)
    out["spans_of_rollout"] = {"samples": len(lat), "spans": min(got), **latency_ms(lat)}

    # 2. the first page of a filter that matches every finished rollout
    pages: list[tuple[int, int]] = []

    async def first_page(status: str) -> None:
        page = await client.query_rollouts(status_in=[status], limit=args.page)
        pages.append((len(page.items), page.total))

    lat = await timed(lambda: first_page("succeeded"), args.list_samples, args.max_seconds)
    out["list_succeeded"] = {
        "samples": len(lat),
        "page": pages[-1][0],
        "matches": pages[-1][1],
        **latency_ms(lat),
    }

    # 3. the first page of a filter that matches a few: the queued rollouts
    await enqueue(args.queued, "queued")
    queued = args.queued
    pages.clear()
    lat = await timed(lambda: first_page("queuing"), args.list_samples, args.max_seconds)
    out["list_queuing"] = {
        "samples": len(lat),
        "page": pages[-1][0],
        "matches": pages[-1][1],
        **latency_ms(lat),
    }

    # 4. one dequeue's latency, the queue holding a few rollouts (refilled below 5); each claimed rollout
    # is then finished, untimed
    dequeue_lat: list[float] = []
    deadline = time.perf_counter() + args.max_seconds
    while len(dequeue_lat) < args.samples and (len(dequeue_lat) < 5 or time.perf_counter() < deadline):
        if queued < 5:
            await enqueue(args.queued, "queued")
            queued += args.queued
        t0 = time.perf_counter()
        r = await client.dequeue_rollout(worker_id="scaling-latency")
        dequeue_lat.append(time.perf_counter() - t0)
        assert r is not None
        queued -= 1
        await client.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded")
        finished_added += 1
    for r in await client.dequeue_many_rollouts(limit=queued, worker_id="scaling-latency") if queued else []:
        await client.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded")
        finished_added += 1
    out["dequeue"] = {
        "samples": len(dequeue_lat),
        "queue_depth": f"5-{args.queued + 4}",
        **latency_ms(dequeue_lat),
    }

    # 5. the rollout cycle: K workers, each claiming a rollout, exporting its spans in one OTLP request
    # and reporting success (agl_peer.py's rollout_cycle, its default span path)
    spans_part = scope_part("b" * 32, args.cycle_spans)
    rates: list[float] = []
    cycle_dequeue: list[float] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(args.cycle_reps):
            await enqueue(args.cycle_rollouts, "cycle")
            rate, lat = await cycle(client, session, args.cycle_rollouts, args.cycle_workers, spans_part)
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
    client: LightningStoreClient, session: aiohttp.ClientSession, rollouts: int, workers: int, part: bytes
) -> tuple[float, list[float]]:
    """Rollouts per second through the cycle (first claim to last report) and the claim latencies."""
    url = client.otlp_traces_endpoint()
    completed = [0]
    last = [0.0]
    claims: list[float] = []

    async def worker(k: int) -> None:
        while True:
            t = time.perf_counter()
            got = await client.dequeue_rollout(worker_id=f"scaling-cycle-{k}")
            if got is None:
                return
            claims.append(time.perf_counter() - t)
            body = resource_spans_field(got.rollout_id, got.attempt.attempt_id, part)
            await post_otlp(session, url, body)
            await client.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")
            last[0] = time.perf_counter()
            completed[0] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(workers)))
    assert completed[0] == rollouts, (completed[0], rollouts)
    return round(rollouts / (last[0] - t0), 1), claims


# ------------------------------------------------------------------ main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    counter = watch_client_log()
    client = LightningStoreClient(args.url)
    try:
        result = await (fill(args, client) if args.workload == "fill" else measure(args, client))
    finally:
        await client.close()
    return {**peer_info(), **result, **counter.report()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
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
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--list-samples", type=int, default=50)
    p.add_argument("--page", type=int, default=50)
    p.add_argument("--queued", type=int, default=20)
    p.add_argument("--cycle-rollouts", type=int, default=256)
    p.add_argument("--cycle-workers", type=int, default=8)
    p.add_argument("--cycle-spans", type=int, default=5)
    p.add_argument("--cycle-reps", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
