"""The LLM proxy's overhead: the same chat call against the engine directly and through the proxy.

    python bench/proxy_peer.py --direct http://127.0.0.1:8000/v1 --proxy http://127.0.0.1:4748 \
        --store 127.0.0.1:4747 --model tiny --calls 200 --concurrent-calls 640 --concurrency 32

Prints one JSON object: for each path (``direct``, ``via_proxy``) p50/p99 ms per call at 1 agent
(calls interleaved, direct then proxy, so both see the same engine state) and calls/s with p50/p99
at ``--concurrency`` agents over ``--rounds`` rounds of ``--concurrent-calls`` calls, the paths taking
turns; plus ``added`` (via_proxy minus direct) and the throughput ratio: the median of the rounds' ratios
(a round of 640 calls lasts about a second here, too short for one round a path to be the figure).
Through the proxy each agent calls its own attempt's route (/rollout/{id}/attempt/{id}/v1), made
here with StoreClient.start_rollout, so every call is admitted by the Store and recorded as a span.
Every path posts the same body (max_tokens 8, temperature 0 by default) with one shared aiohttp
session, the lightest Python client, so the figures show the proxy rather than the client; warm-up
calls are not counted. Only 127.0.0.1.

With ``--relay`` (``bench/relay_server.py``, a bare aiohttp relay to the same engine that checks, rewrites,
parses and records nothing) a third path, ``via_relay``, takes its turn in the rounds at ``--concurrency``
agents between the other two, with its own ratio to direct (``relay_throughput_ratio``): the floor of one
more HTTP hop in Python on this host, against which the proxy's own work is read.

Each path's ``engine`` figures come from the engine's ``GET /metrics`` (read before and after each of its
rounds at ``--concurrency`` agents; absent when the engine serves none): its steps and prefill passes a
call, and the rows a decode pass held. Through the proxy each call spends longer outside the engine, so
its batch holds fewer rows and the engine does more passes for the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

MESSAGES = [{"role": "user", "content": "Count from one to ten."}]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summary(latencies_ms: list[float]) -> dict[str, Any]:
    return {
        "calls": len(latencies_ms),
        "p50_ms": pct(latencies_ms, 0.50),
        "p99_ms": pct(latencies_ms, 0.99),
        "mean_ms": round(statistics.fmean(latencies_ms), 3) if latencies_ms else None,
    }


class Path:
    """One way to reach the model: a base URL per agent (the same for every agent when direct)."""

    def __init__(self, name: str, urls: list[str], http: Any, model: str, max_tokens: int) -> None:
        self.name = name
        self.urls = [u.rstrip("/") + "/chat/completions" for u in urls]
        self.http = http
        self.body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.0}
        self.errors = 0
        self.last_error = ""

    async def call(self, agent: int) -> float | None:
        start = time.perf_counter()
        try:
            async with self.http.post(self.urls[agent], json=self.body) as resp:
                data = await resp.json()
                if resp.status != 200 or not data.get("choices"):
                    raise RuntimeError(f"HTTP {resp.status}: {json.dumps(data)[:200]}")
        except Exception as exc:  # counted and reported, never hidden
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            return None
        return (time.perf_counter() - start) * 1000


async def concurrent(path: Path, calls: int, agents: int, deadline: float) -> tuple[list[float], float]:
    """One round of ``calls`` calls by ``agents`` agents at once: their latencies (ms) and the seconds taken."""
    latencies: list[float] = []
    left = calls

    async def agent(i: int) -> None:
        nonlocal left
        while left > 0 and time.monotonic() < deadline:
            left -= 1
            ms = await path.call(i)
            if ms is not None:
                latencies.append(ms)

    await asyncio.gather(*(path.call(i) for i in range(agents)))  # warm-up: one call per agent
    start = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(agents)))
    return latencies, time.perf_counter() - start


#: The engine's counters read from its /metrics (Prometheus names, the model_name label dropped).
ENGINE_COUNTERS = {
    "steps": "lightning_engine_steps_total",
    "prefill_passes": "lightning_engine_prefill_passes_total",
    "decode_passes": "lightning_engine_decode_passes_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


async def engine_counters(http: Any, metrics_url: str) -> dict[str, float] | None:
    """The engine's counters now, or None when it serves no /metrics with them."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with http.get(metrics_url) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except Exception:  # an engine without the route, or gone: the figures are left out, not the run
        return None
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    if not all(name in samples for name in ENGINE_COUNTERS.values()):
        return None
    return {key: samples[name] for key, name in ENGINE_COUNTERS.items()}


def engine_figures(grew: dict[str, float], calls: int) -> dict[str, float]:
    """Per call: the engine's steps and prefill passes; per decode pass, the rows it decoded (each call's
    first token comes from its prefill, the rest from decode passes)."""
    decoded_rows = grew["generation_tokens"] - calls
    return {
        "steps_per_call": round(grew["steps"] / calls, 3),
        "prefill_passes_per_call": round(grew["prefill_passes"] / calls, 3),
        "rows_per_decode_pass": round(decoded_rows / grew["decode_passes"], 2)
        if grew["decode_passes"]
        else 0.0,
    }


async def concurrent_rounds(
    paths: tuple[Path, ...], calls: int, agents: int, rounds: int, max_seconds: float, metrics_url: str
) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    """``rounds`` rounds of each path in turn (direct, proxy, direct, ...), so that a slower spell of the
    host falls on every path: each path's figures over all its rounds, and for each path after the first
    the ratio of its calls/s to the first path's in each round."""
    latencies: dict[str, list[float]] = {p.name: [] for p in paths}
    seconds = dict.fromkeys(latencies, 0.0)
    grew: dict[str, dict[str, float] | None] = {
        name: dict.fromkeys(ENGINE_COUNTERS, 0.0) for name in latencies
    }
    ratios: dict[str, list[float]] = {p.name: [] for p in paths[1:]}
    for _ in range(rounds):
        rate = {}
        for path in paths:
            before = await engine_counters(path.http, metrics_url)
            got, elapsed = await concurrent(path, calls, agents, time.monotonic() + max_seconds)
            after = await engine_counters(path.http, metrics_url)
            latencies[path.name] += got
            seconds[path.name] += elapsed
            rate[path.name] = len(got) / elapsed
            total = grew[path.name]
            if before is None or after is None or total is None:
                grew[path.name] = None
            else:  # the warm-up calls (one an agent) are in the engine's counts, so in the calls below too
                for key in total:
                    total[key] += after[key] - before[key]
        first = rate[paths[0].name]
        for path in paths[1:]:
            ratios[path.name].append(rate[path.name] / first if first else 0.0)
    out: dict[str, dict[str, Any]] = {}
    for name, values in latencies.items():
        out[name] = {
            **summary(values),
            "calls_per_s": round(len(values) / seconds[name], 1),
            "seconds": round(seconds[name], 2),
        }
        total = grew[name]
        if total is not None and values:
            out[name]["engine"] = engine_figures(total, len(values) + agents * rounds)
    return out, ratios


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    from lightning_grpc.client import StoreClient

    agents = args.concurrency
    connector = aiohttp.TCPConnector(limit=agents * 2 + 8)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with (
        StoreClient(args.store) as store,
        aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
    ):
        rollouts = [await store.start_rollout({"bench": "proxy", "agent": i}) for i in range(agents)]
        proxy_base = args.proxy.rstrip("/").removesuffix("/v1")
        routes = [
            f"{proxy_base}/rollout/{r.rollout_id}/attempt/{r.latest_attempt.attempt_id}/v1" for r in rollouts
        ]  # type: ignore[union-attr]
        direct = Path("direct", [args.direct] * agents, http, args.model, args.max_tokens)
        proxied = Path("via_proxy", routes, http, args.model, args.max_tokens)
        relay = None
        if args.relay:  # the same routes on the relay, which takes and ignores the attempt prefix
            relay_base = args.relay.rstrip("/").removesuffix("/v1")
            relayed = [route.replace(proxy_base, relay_base, 1) for route in routes]
            relay = Path("via_relay", relayed, http, args.model, args.max_tokens)
        paths = (direct, proxied) if relay is None else (direct, relay, proxied)
        started = time.monotonic()
        deadline = started + args.max_seconds

        for _ in range(args.warmup):
            await direct.call(0)
            await proxied.call(0)
        single: dict[str, list[float]] = {"direct": [], "via_proxy": []}
        for _ in range(args.calls):
            if time.monotonic() > deadline:
                break
            for path in (direct, proxied):
                ms = await path.call(0)
                if ms is not None:
                    single[path.name].append(ms)

        metrics_url = args.direct.rstrip("/").removesuffix("/v1") + "/metrics"
        many, ratios = await concurrent_rounds(
            paths, args.concurrent_calls, agents, args.rounds, args.max_seconds, metrics_url
        )

        await asyncio.sleep(0.5)  # the proxy writes spans in the background
        spans = len(await store.query_spans(rollouts[0].rollout_id))

    out: dict[str, Any] = {"max_tokens": args.max_tokens, "warmup_calls": args.warmup, "concurrency": agents}
    for path in (direct, proxied):
        out[path.name] = {
            "agents_1": summary(single[path.name]),
            f"agents_{agents}": many[path.name],
            "errors": path.errors,
            **({"last_error": path.last_error} if path.errors else {}),
        }

    def diff(key: str, metric: str) -> float | None:
        a, b = out["via_proxy"][key].get(metric), out["direct"][key].get(metric)
        return round(a - b, 3) if a is not None and b is not None else None

    k = f"agents_{agents}"
    out["added_ms"] = {
        "agents_1": {"p50": diff("agents_1", "p50_ms"), "p99": diff("agents_1", "p99_ms")},
        k: {"p50": diff(k, "p50_ms"), "p99": diff(k, "p99_ms")},
    }
    for name, prefix in (("via_proxy", ""), ("via_relay", "relay_")):
        if name in ratios:
            by_round = ratios[name]
            out[f"{prefix}throughput_ratio"] = round(statistics.median(by_round), 3) if by_round else None
            out[f"{prefix}throughput_ratio_rounds"] = [round(r, 3) for r in by_round]
    if relay is not None:
        out["via_relay"] = {f"agents_{agents}": many["via_relay"], "errors": relay.errors}
        if relay.errors:
            out["via_relay"]["last_error"] = relay.last_error
    out["spans_recorded_agent0"] = spans
    out["seconds"] = round(time.monotonic() - started, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--direct", help="the engine's base URL (…/v1)")
    p.add_argument("--proxy", help="the proxy's HTTP address (http://127.0.0.1:PORT)")
    p.add_argument("--store", help="the Store's address (127.0.0.1:PORT)")
    p.add_argument(
        "--relay",
        help="a bare relay to the same engine (bench/relay_server.py, http://127.0.0.1:PORT): a third path",
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--calls", type=int, default=200, help="calls per path at 1 agent")
    p.add_argument("--concurrent-calls", type=int, default=640, help="calls per path at --concurrency agents")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--rounds", type=int, default=5, help="rounds of --concurrent-calls per path, the paths taking turns"
    )
    p.add_argument("--warmup", type=int, default=10, help="uncounted calls per path first")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-seconds", type=float, default=60.0, help="time bound of each measured phase")
    args = p.parse_args(argv)
    if not (args.direct and args.proxy and args.store):
        p.error("--direct, --proxy and --store are required")
    for url in (args.direct, args.proxy, args.store, *([args.relay] if args.relay else [])):
        if "127.0.0.1" not in url:
            p.error(f"only 127.0.0.1: {url}")
    print(json.dumps(asyncio.run(measure(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
