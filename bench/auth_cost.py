"""What access control costs: the runner's whole cycle against a Store without a token, with the admin
token, and with runner credentials (whose every attempt-scoped call is checked against its worker).

Each mode gets a fresh ``lightning-grpc serve --memory`` process; the modes take turns, round after
round, so that they share the machine's state. One rollout cycle, as a runner plays it: DequeueRollouts
(its own worker id), AddSpans (one batch of ``--spans`` spans), HeartbeatAttempt, CompleteAttempt.
``--workers`` runners run at once, each with its own client.

    .venv/bin/python bench/auth_cost.py               # 3 rounds, 8 workers, 400 rollouts per mode and round
    .venv/bin/python bench/auth_cost.py --rounds 1 --rollouts 100

Prints rollouts/s per mode and round, the medians, and each mode's median ÷ the open server's; writes
``bench/results/auth_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_grpc.access import Credentials  # noqa: E402
from lightning_grpc.client import ClientConfig, StoreClient  # noqa: E402
from lightning_grpc.types import Span  # noqa: E402

TOKEN = "bench-admin-token"
MODES = ("open", "admin", "runner")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, token: str | None) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "lightning_grpc.cli.main", "serve", "--memory", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")}
    if token:
        args += ["--token", token]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def spans(n: int, worker: int, i: int) -> list[Span]:
    return [
        Span(
            trace_id=f"{worker:08x}{i:08x}".ljust(32, "0"),
            span_id=f"{k + 1:016x}",
            name="agent.step",
            attributes={"step": k, "text": "x" * 200},
        )
        for k in range(n)
    ]


async def runner_loop(config: ClientConfig, worker_id: str, quota: int, n_spans: int, index: int) -> int:
    done = 0
    async with StoreClient(config) as client:
        while done < quota:
            claimed = await client.dequeue_rollouts(worker_id=worker_id)
            if not claimed:
                break
            r = claimed[0]
            assert r.latest_attempt is not None
            aid = r.latest_attempt.attempt_id
            await client.add_spans(spans(n_spans, index, done), rollout_id=r.rollout_id, attempt_id=aid)
            await client.heartbeat_attempt(r.rollout_id, aid)
            await client.complete_attempt(r.rollout_id, aid, "succeeded")
            done += 1
    return done


async def one_round(mode: str, args: argparse.Namespace) -> float:
    port = free_port()
    token = None if mode == "open" else TOKEN
    proc = start_server(port, token)
    target = f"127.0.0.1:{port}"
    try:
        async with StoreClient(ClientConfig(target=target, token=token)) as admin:
            await admin.enqueue_rollouts([{"input": {"i": i}} for i in range(args.rollouts)])
        configs = []
        for w in range(args.workers):
            worker_id = f"bench-{w}"
            bearer = Credentials(TOKEN).runner(worker_id) if mode == "runner" else token
            configs.append((ClientConfig(target=target, token=bearer), worker_id))
        quota = -(-args.rollouts // args.workers)
        started = time.perf_counter()
        counts = await asyncio.gather(
            *[runner_loop(c, w, quota, args.spans, i) for i, (c, w) in enumerate(configs)]
        )
        elapsed = time.perf_counter() - started
        assert sum(counts) == args.rollouts, counts
        return args.rollouts / elapsed
    finally:
        proc.terminate()
        proc.wait(15)


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rollouts", type=int, default=400)
    p.add_argument("--spans", type=int, default=16)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "auth_cost.json")
    args = p.parse_args(argv)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for round_no in range(args.rounds):
        order = MODES if round_no % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            rate = await one_round(mode, args)
            rates[mode].append(rate)
            print(f"round {round_no + 1} {mode:7s} {rate:8.1f} rollouts/s", flush=True)
    medians = {m: statistics.median(v) for m, v in rates.items()}
    print(f"\nrunner cycle, {args.workers} workers, {args.spans} spans per rollout (median of {args.rounds})")
    print(f"{'mode':8s} {'rollouts/s':>11s} {'÷ open':>7s}")
    for m in MODES:
        print(f"{m:8s} {medians[m]:11.1f} {medians[m] / medians['open']:7.3f}")
    report: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rates": rates,
        "medians": medians,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
