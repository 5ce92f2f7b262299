"""Run every benchmark side by side and write bench/results/latest.{json,md}.

    python bench/run.py            # full run (two runs of everything), ~15 min
    python bench/run.py --quick    # one run, fewer spans, ~3 min
    python bench/run.py --smoke    # seconds; no Agent Lightning; used by `make test`

Peers, each server in its own process on 127.0.0.1: Agent Lightning 0.3.0's store (its own HTTP
server and client, installed by bench/agl_setup.py into bench/.venv-agl), a no-op grpc.aio server
(the Python gRPC ceiling), and lightning-grpc with the memory, the SQLite and the PostgreSQL backend.
Ratios are always lightning-grpc's figure divided by the peer's figure from the same run.

PostgreSQL runs on a throwaway cluster the bench starts once per bench run (tests/store/postgres_server.py's
``initdb``/``pg_ctl``, with fsync, synchronous_commit and full_page_writes on, as durable as SQLite's default
synchronous=FULL) and destroys at the end; every ``serve --postgres`` gets a fresh database. Without
PostgreSQL or psycopg the bench prints one line saying why and leaves out only the PostgreSQL rows.

The training-batch workload (bench/trainer_batch.py) runs against a fresh `serve` of each backend:
`TrainerClient.get_batch` against a per-row loop over the public span query, and the batch's bytes on
the wire against the int32 token payload.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from lightning_grpc.processes import Background

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
AGL_PY = BENCH / ".venv-agl" / "bin" / "python"
RESULTS = BENCH / "results"


@dataclass
class Sizes:
    spans: int = 20_000
    #: Spans sent one per call (the slow path of every peer).
    single_spans: int = 4_000
    writers: tuple[int, ...] = (1, 8, 32)
    rollouts: int = 2_000
    cycle_workers: tuple[int, ...] = (8, 32)
    #: Completion-latency samples of each variant: the p99 (bench/agl_peer.py's ``percentile``) is the
    #: largest sample up to 100 of them, so at 50 a single slow sample was the whole figure.
    latency_samples: int = 200
    query_rollouts: int = 10_000
    fill_spans: int = 1_000_000
    runs: int = 2
    max_seconds: float = 60.0
    agl: bool = True
    #: Training batch: groups x group size rollouts of ~batch_tokens prompt + ~batch_tokens response ids.
    batch_groups: int = 32
    batch_group_size: int = 8
    batch_tokens: int = 512
    #: Timed repetitions of each side (at most; at least 3, then until max_seconds).
    batch_repeats: int = 7


PROFILES = {
    "full": Sizes(),
    "quick": Sizes(
        spans=5_000,
        single_spans=500,
        writers=(8,),
        rollouts=500,
        cycle_workers=(32,),
        latency_samples=20,
        query_rollouts=2_000,
        fill_spans=100_000,
        runs=1,
        max_seconds=20.0,
        batch_repeats=5,
    ),
    "smoke": Sizes(
        spans=256,
        writers=(8,),
        rollouts=40,
        cycle_workers=(8,),
        latency_samples=3,
        query_rollouts=100,
        fill_spans=2_000,
        runs=1,
        max_seconds=10.0,
        agl=False,
        batch_groups=4,
        batch_group_size=2,
        batch_tokens=32,
        batch_repeats=3,
    ),
}


# ------------------------------------------------------------------ processes


class RssSampler:
    """Peak resident memory of a process, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(0.2)

    def now(self) -> int:
        return int(self.process.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class Server:
    name: str
    process: Background
    address: str
    rss: RssSampler


#: How long a server may take to print its ready line.
SERVER_START_SECONDS = 120


@contextmanager
def server(name: str, argv: list[str], ready: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A server process, once it has printed ``ready`` followed by its port (RuntimeError, with its last
    lines, if it exits or stays silent for SERVER_START_SECONDS); stopped on leaving."""
    process = Background(name, argv, {**os.environ, **(env or {})}, cwd=ROOT, python=False)
    try:
        line = process.wait_for(ready, timeout=SERVER_START_SECONDS)[0]
    except RuntimeError as exc:
        process.proc.kill()
        raise RuntimeError(f"{name} did not start ({exc}):\n{process.tail()}") from None
    port = re.match(r"\d+", line.split(ready, 1)[1])
    assert port is not None, line
    srv = Server(name, process, f"127.0.0.1:{port.group()}", RssSampler(process.proc.pid))
    try:
        yield srv
    finally:
        srv.rss.stop()
        stop_server(srv)


def stop_server(srv: Server) -> None:
    """Background.stop (SIGTERM, SIGKILL after 30 s); a stop slower than 5 s is printed, as a run that
    lingers is news."""
    asked = time.monotonic()
    if srv.process.stop(30) == -signal.SIGKILL:
        print(f"note: {srv.name} did not stop within 30 s of SIGTERM and was killed", flush=True)
    elif (took := time.monotonic() - asked) > 5:
        print(f"note: {srv.name} took {took:.1f} s to stop after SIGTERM", flush=True)


def ours(name: str, db: Path | None, *extra: str, postgres: str | None = None) -> Any:
    where = ["--postgres", postgres] if postgres else ["--db", str(db)] if db else ["--memory"]
    argv = [PY, "-m", "lightning_grpc.cli.main", "serve", "--port", "0", *where, *extra]
    return server(name, argv, "event=server_started address=127.0.0.1:")


#: SQLite with synchronous=NORMAL (``lightning_grpc_sqlite`` runs the default, FULL).
SQLITE_NORMAL = "lightning_grpc_sqlite_normal"
#: ``serve --postgres`` against a fresh database on the bench's own PostgreSQL cluster.
POSTGRES = "lightning_grpc_postgres"
#: Every system whose rows the tables show, in their order.
SYSTEMS = (
    "agentlightning",
    "ceiling",
    "lightning_grpc_memory",
    "lightning_grpc_sqlite",
    SQLITE_NORMAL,
    POSTGRES,
)


# ------------------------------------------------------------------ PostgreSQL

#: The bench cluster's settings: durable, to compare with SQLite's default synchronous=FULL (the tests'
#: cluster runs with fsync and full_page_writes off). The rest are PostgreSQL's defaults.
POSTGRES_SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_connections": "200",
}


def _postgres_helper() -> Any:
    """tests/store/postgres_server.py, loaded from its file (bench/ is not a package beside tests/)."""
    import importlib.util

    path = ROOT / "tests" / "store" / "postgres_server.py"
    spec = importlib.util.spec_from_file_location("bench_postgres_server", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BenchPostgres:
    """A throwaway PostgreSQL cluster for one bench run, with :data:`POSTGRES_SETTINGS`; ``None`` from
    :meth:`start` (and :attr:`why`) when there can be none here."""

    def __init__(self) -> None:
        self.server: Any = None
        self.why = ""
        self.info: dict[str, Any] = {}
        self._count = 0

    def start(self) -> BenchPostgres | None:
        try:
            helper = _postgres_helper()
        except (ImportError, OSError) as exc:
            self.why = f"the PostgreSQL test helper cannot be loaded ({exc})"
            return None
        self.why = helper.why_unavailable()
        if self.why:
            return None
        try:
            self.server = helper.PostgresServer()  # initdb into a temporary directory
            srv = self.server
            options = f"-c listen_addresses=127.0.0.1 -p {srv.port} -c unix_socket_directories={srv.root} "
            options += " ".join(f"-c {k}={v}" for k, v in POSTGRES_SETTINGS.items())
            srv._run(
                "pg_ctl", "-D", str(srv.data), "-l", str(srv.log), "-o", options, "-w", "-t", "60", "start"
            )
            self.info = self._settings()
        except Exception as exc:  # any failure to start only leaves out the PostgreSQL rows
            last = (str(exc).strip().splitlines() or [repr(exc)])[-1]
            self.why = f"PostgreSQL did not start: {last[:200]}"
            self.destroy()
            return None
        return self

    def _settings(self) -> dict[str, Any]:
        import psycopg

        names = ("server_version", *POSTGRES_SETTINGS, "shared_buffers", "wal_level")
        with psycopg.connect(self.server.url()) as conn:
            info: dict[str, Any] = {n: conn.execute(f"SHOW {n}").fetchone()[0] for n in names}  # type: ignore[index]
        info["psycopg"] = psycopg.__version__
        return info

    def database(self, label: str) -> str:
        """A new, empty database of the cluster; its URL."""
        self._count += 1
        return str(self.server.create_database(f"bench_{self._count}_{re.sub(r'[^a-z0-9]', '_', label)}"))

    def destroy(self) -> None:
        if self.server is not None:
            self.server.destroy()
            self.server = None


def ceiling() -> Any:
    return server("ceiling", [PY, str(BENCH / "ceiling_server.py"), "--port", "0"], "READY ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agl() -> Any:
    # Agent Lightning's launcher probes the port it was given, so it needs a real one, not 0.
    return server(
        "agentlightning",
        [str(AGL_PY), str(BENCH / "agl_server.py"), "--port", str(free_port())],
        "READY ",
    )


def drive(
    python: Path | str, script: str, target_args: list[str], args: list[str], timeout: float
) -> dict[str, Any]:
    cmd = [str(python), str(BENCH / script), *target_args, *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"note: {script} {' '.join(args)} timed out after {timeout:.0f} s", flush=True)
        return {"error": f"timed out after {timeout:.0f} s", "cmd": " ".join(args)}
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout)[-2000:], "cmd": " ".join(args)}
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def grpc_drive(srv: Server, args: list[str], sizes: Sizes) -> dict[str, Any]:
    return drive(
        PY,
        "grpc_peer.py",
        ["--target", srv.address, "--max-seconds", str(sizes.max_seconds)],
        args,
        sizes.max_seconds * 3 + 120,
    )


def agl_drive(srv: Server, args: list[str], sizes: Sizes) -> dict[str, Any]:
    return drive(
        AGL_PY,
        "agl_peer.py",
        ["--url", f"http://{srv.address}", "--max-seconds", str(sizes.max_seconds)],
        args,
        sizes.max_seconds * 3 + 120,
    )


# ------------------------------------------------------------------ one run


def run_grpc_store(srv: Server, sizes: Sizes, setup: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    shapes = ["single", "unary64", "stream64"]
    for w in sizes.writers:
        for shape in shapes:
            spans = sizes.spans if shape != "single" else min(sizes.spans, sizes.single_spans)
            args = ["span-ingest", "--writers", str(w), "--spans", str(spans), "--shape", shape]
            out[f"span_ingest/w{w}/{shape}"] = grpc_drive(srv, args + (["--setup"] if setup else []), sizes)
    for k in sizes.cycle_workers:  # the ceiling's are its queue of ids (bench/ceiling_server.py)
        args = ["rollout-cycle", "--rollouts", str(sizes.rollouts), "--workers", str(k)]
        # the runner's way: one message a rollout on each worker's RunnerSession stream
        out[f"rollout_cycle/k{k}"] = grpc_drive(srv, [*args, "--api", "session"], sizes)
        out[f"rollout_cycle/k{k}/one_call"] = grpc_drive(srv, [*args, "--api", "combined"], sizes)
        out[f"rollout_cycle/k{k}/three_calls"] = grpc_drive(srv, [*args, "--api", "separate"], sizes)
    if not setup:
        return out
    for via in ("wait", "watch"):
        args = ["completion-latency", "--samples", str(sizes.latency_samples), "--via", via]
        out[f"completion_latency/{via}"] = grpc_drive(srv, args, sizes)
    out["queries"] = grpc_drive(
        srv, ["queries", "--spans", "200", "--rollouts", str(sizes.query_rollouts)], sizes
    )
    return out


def run_trainer_batch(srv: Server, sizes: Sizes) -> dict[str, Any]:
    args = ["--groups", str(sizes.batch_groups), "--group-size", str(sizes.batch_group_size)]
    args += ["--tokens", str(sizes.batch_tokens), "--repeats", str(sizes.batch_repeats)]
    result = drive(
        PY,
        "trainer_batch.py",
        ["--target", srv.address, "--max-seconds", str(sizes.max_seconds)],
        args,
        sizes.max_seconds * 6 + 120,
    )
    result["peak_rss_mib"] = round(srv.rss.peak / 2**20, 1)
    return result


def run_agl(srv: Server, sizes: Sizes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w in sizes.writers:
        for path in ("single", "otlp64"):
            spans = sizes.spans if path == "otlp64" else min(sizes.spans, sizes.single_spans)
            args = ["span-ingest", "--writers", str(w), "--spans", str(spans), "--path", path]
            out[f"span_ingest/w{w}/{path}"] = agl_drive(srv, args, sizes)
    for k in sizes.cycle_workers:
        out[f"rollout_cycle/k{k}"] = agl_drive(
            srv, ["rollout-cycle", "--rollouts", str(sizes.rollouts), "--workers", str(k)], sizes
        )
    out["completion_latency/poll"] = agl_drive(
        srv, ["completion-latency", "--samples", str(sizes.latency_samples)], sizes
    )
    out["queries"] = agl_drive(
        srv, ["queries", "--spans", "200", "--rollouts", str(sizes.query_rollouts)], sizes
    )
    return out


def one_run(
    sizes: Sizes, workdir: Path, index: int, log: Any, pg: BenchPostgres | None = None
) -> dict[str, Any]:
    run: dict[str, Any] = {}
    log(f"run {index}: ceiling")
    with ceiling() as srv:
        run["ceiling"] = {"results": run_grpc_store(srv, sizes, setup=False), "peak_rss_mib": None}
        run["ceiling"]["peak_rss_mib"] = round(srv.rss.peak / 2**20, 1)
    for name, db in (("lightning_grpc_memory", None), ("lightning_grpc_sqlite", workdir / f"run{index}.db")):
        log(f"run {index}: {name}")
        with ours(name, db) as srv:
            results = run_grpc_store(srv, sizes, setup=True)
            run[name] = {"results": results, "peak_rss_mib": round(srv.rss.peak / 2**20, 1)}
        log(f"run {index}: {name}, training batch (fresh server)")
        with ours(name, db and db.with_suffix(".trainer.db")) as srv:
            run[name]["results"]["trainer_batch"] = run_trainer_batch(srv, sizes)
    # the same store workloads on SQLite with synchronous=NORMAL, against the default (FULL) above
    log(f"run {index}: {SQLITE_NORMAL}")
    with ours(SQLITE_NORMAL, workdir / f"run{index}.normal.db", "--sqlite-sync", "normal") as srv:
        results = run_grpc_store(srv, sizes, setup=True)
        run[SQLITE_NORMAL] = {"results": results, "peak_rss_mib": round(srv.rss.peak / 2**20, 1)}
    # the same store workloads on PostgreSQL (durable settings), a fresh database of the bench's cluster
    if pg is not None:
        log(f"run {index}: {POSTGRES}")
        try:
            with ours(POSTGRES, None, postgres=pg.database(f"run{index}")) as srv:
                results = run_grpc_store(srv, sizes, setup=True)
                run[POSTGRES] = {"results": results, "peak_rss_mib": round(srv.rss.peak / 2**20, 1)}
        except RuntimeError as exc:  # a server that did not start: only the PostgreSQL rows go
            last = (str(exc).strip().splitlines() or [repr(exc)])[-1]
            log(f"run {index}: {POSTGRES} left out: {last[:200]}")
            run[POSTGRES] = {"results": {}, "peak_rss_mib": None, "error": str(exc)[-2000:]}
    if sizes.agl and AGL_PY.exists():
        log(f"run {index}: agentlightning")
        with agl() as srv:
            results = run_agl(srv, sizes)
            run["agentlightning"] = {"results": results, "peak_rss_mib": round(srv.rss.peak / 2**20, 1)}
    return run


def rss_after_fill(sizes: Sizes, workdir: Path, log: Any) -> dict[str, Any]:
    log(f"rss: storing {sizes.fill_spans:,} spans with SQLite")
    with ours("lightning_grpc_sqlite", workdir / "fill.db") as srv:
        result = grpc_drive(srv, ["fill", "--spans", str(sizes.fill_spans)], Sizes(max_seconds=600))
        time.sleep(1.0)
        result["rss_after_mib"] = round(srv.rss.now() / 2**20, 1)
        result["peak_rss_mib"] = round(srv.rss.peak / 2**20, 1)
    result["db_mib"] = round((workdir / "fill.db").stat().st_size / 2**20, 1)
    return result


# ------------------------------------------------------------------ the training loop against direct generation

#: Steps of the demo's loop and of direct generation per profile (None: not run; it trains for real).
TRAINER_LOOP_STEPS: dict[str, int | None] = {"full": 15, "quick": 6, "smoke": None}


def trainer_loop(profile: str, log: Any) -> dict[str, Any] | None:
    """bench/trainer_loop.py in its own process: the demo's loop vs direct generation, same run."""
    steps = TRAINER_LOOP_STEPS[profile]
    if steps is None:
        return None
    log(
        f"trainer loop: {steps} steps of the demo's loop (its mode, then the other), then of direct generation"
    )
    done = subprocess.run(
        [PY, str(BENCH / "trainer_loop.py"), "--steps", str(steps)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def trainer_loop_markdown(res: dict[str, Any] | None) -> list[str]:
    if not res:
        return []
    if "error" in res:
        return ["", "## Training loop", "", f"failed: {res['error'][-300:]}"]
    ours, direct = res["ours"], res["direct"]
    other = next((k for k in res if k.startswith("ours_")), None)

    def line(name: str, r: dict[str, Any], data: bool) -> str:
        return (
            f"| {name} | {r['rollouts_per_second']:.1f} | {r['step_seconds_median']:.2f} "
            f"| {r['generation_seconds_median']:.2f} | {r['update_seconds_median']:.2f} "
            f"| {r['data_path_seconds_median']:.3f} |"
            if data
            else f"| {name} | {r['rollouts_per_second']:.1f} | {r['step_seconds_median']:.2f} "
            f"| {r['generation_seconds_median']:.2f} | {r['update_seconds_median']:.2f} | - |"
        )

    lines = [
        "",
        "## Training loop (the demo's, through the whole system) against direct generation",
        "",
        f"{res['steps']} steps of {ours.get('rollouts_per_step', '?')} rollouts each (one generation round a step), "
        "same model, sampling and learner; medians over steps 2 on. "
        "Generation s is the wait for the batch (in async mode the groups were generated during the update).",
        "",
        "| loop | rollouts/s | step s | generation s | update s | data path s |",
        "|---|---|---|---|---|---|",
        line(f"lightning-grpc, demo's mode ({ours.get('mode', 'sync')})", ours, True),
    ]
    if other:
        lines.append(line(f"lightning-grpc, {res[other].get('mode')} mode", res[other], True))
    lines += [
        line("direct generation in one process", direct, False),
        "",
        f"Ratio {res['rollouts_per_second_ratio']:.2f}"
        + (
            f" ({res[other]['mode']} mode: {res['rollouts_per_second_ratio_' + res[other]['mode']]:.2f})"
            if other
            else ""
        )
        + f"; data path {100 * res['data_path_share']:.2f}% of a step (sync mode). "
        f"CPU seconds per step by process: {ours['cpu_seconds_per_step']}.",
    ]
    return lines


# ------------------------------------------------------------------ LLM proxy overhead

#: The proxy's workload by profile: ``calls`` a path at 1 agent, ``rounds`` of ``concurrent_calls`` a path at
#: ``concurrency`` agents, and the time bound of each phase; the engine behind the proxy is always the embedded
#: engine serving a tiny model built for the run. The 1-agent p99 is the sample at int(0.99 n) of the sorted
#: list: the 10th largest of 1,000 calls (at 200 it was the 2nd largest, and the added p99, a difference of two
#: such tails, read 1.88 ms and then 5.03 ms in two full runs with no change to the proxy).
PROXY_SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "engine": "tiny",
        "calls": 1_000,
        "concurrent_calls": 640,
        "rounds": 5,
        "concurrency": 32,
        "max_seconds": 60,
    },
    "quick": {
        "engine": "tiny",
        "calls": 300,
        "concurrent_calls": 320,
        "rounds": 3,
        "concurrency": 32,
        "max_seconds": 30,
    },
    "smoke": {
        "engine": "tiny",
        "calls": 10,
        "concurrent_calls": 32,
        "rounds": 1,
        "concurrency": 32,
        "max_seconds": 10,
    },
}


@contextmanager
def model_engine(kind: str, workdir: Path) -> Iterator[str]:
    """The engine the proxy forwards to; yields its base URL (ending in /v1)."""
    from lightning_grpc.engine import EngineProcess

    model = workdir / "tiny-model"
    subprocess.run(
        [PY, "-m", "lightning_grpc.cli.main", "init-model", str(model)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    with EngineProcess(model, served_model_name="tiny") as engine:
        yield engine.base_url


def proxy_overhead(profile: str, workdir: Path, log: Any) -> dict[str, Any]:
    """Added latency and throughput of an LLM call through `serve --proxy-backend` vs the engine directly."""
    cfg = PROXY_SIZES[profile]
    log(f"proxy overhead: {cfg['engine']} engine, store and proxy in one process")
    try:
        return _proxy_overhead(cfg, workdir)
    except (RuntimeError, subprocess.SubprocessError) as exc:  # an engine or server that did not start
        return {"error": str(exc)[-2000:], "engine": cfg["engine"]}


def _proxy_overhead(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    with model_engine(cfg["engine"], workdir) as base_url:
        argv = [PY, "-m", "lightning_grpc.cli.main", "serve", "--memory", "--port", "0"]
        argv += ["--proxy-backend", base_url, "--proxy-model-name", "tiny", "--proxy-port", "0"]
        ready = "event=proxy_started http_address=http://127.0.0.1:"
        with server("lightning_grpc_proxy", argv, ready) as srv:
            m = re.search(r"event=server_started address=(127\.0\.0\.1:\d+)", "\n".join(srv.process.lines))
            if m is None:
                return {"error": "no store address in the serve log", "engine": cfg["engine"]}
            relay_argv = [PY, str(BENCH / "relay_server.py"), "--backend", base_url, "--port", "0"]
            with server("relay", relay_argv, "READY ") as relay:
                target = ["--direct", base_url, "--proxy", f"http://{srv.address}", "--store", m.group(1)]
                target += ["--relay", f"http://{relay.address}"]
                args = ["--model", "tiny", "--calls", str(cfg["calls"]), "--concurrent-calls"]
                args += [str(cfg["concurrent_calls"]), "--concurrency", str(cfg["concurrency"])]
                args += ["--rounds", str(cfg["rounds"])]
                args += ["--max-seconds", str(cfg["max_seconds"])]
                result = drive(PY, "proxy_peer.py", target, args, cfg["max_seconds"] * 5 + 120)
            result["engine"] = cfg["engine"]
            result["peak_rss_mib"] = round(srv.rss.peak / 2**20, 1)
    return result


def proxy_markdown(res: dict[str, Any] | None) -> list[str]:
    if not res:
        return []
    if "error" in res:
        return [f"LLM proxy overhead: error: {str(res['error']).splitlines()[-1][:200]}", ""]
    k = f"agents_{res['concurrency']}"
    lines = [
        f"LLM proxy overhead ({res['engine']} engine, max_tokens {res['max_tokens']}, temperature 0; "
        f"store and proxy in one `serve --memory` process; {res['warmup_calls']} warm-up calls uncounted):",
        "",
        f"| path | 1 agent p50/p99 ms | {res['concurrency']} agents calls/s | {res['concurrency']} agents p50/p99 ms |",
        "|---|---|---|---|",
    ]
    for path in ("direct", "via_relay", "via_proxy"):
        if path not in res:
            continue
        one, many = res[path].get("agents_1"), res[path][k]
        single = f"{one['p50_ms']}/{one['p99_ms']}" if one else "-"
        lines.append(
            f"| {path} | {single} | {_fmt(many['calls_per_s'], 1)} | {many['p50_ms']}/{many['p99_ms']} |"
        )
    added = res["added_ms"]
    lines.append(
        f"| added (proxy − direct; calls/s: proxy ÷ direct) | {added['agents_1']['p50']}/{added['agents_1']['p99']} "
        f"| {_fmt(res['throughput_ratio'], 2)} | {added[k]['p50']}/{added[k]['p99']} |"
    )
    rounds = res.get("throughput_ratio_rounds")
    if rounds:
        lines += [
            "",
            f"At {res['concurrency']} agents the paths took turns, {len(rounds)} rounds each; calls/s through the "
            f"proxy ÷ direct by round: {', '.join(_fmt(r, 2) for r in rounds)} (the figure is their median).",
        ]
    return [*lines, *_relay_lines(res), *_engine_batch_lines(res, k), ""]


def _relay_lines(res: dict[str, Any]) -> list[str]:
    """The bare relay's ratio (bench/relay_server.py), the floor the proxy's ratio is read against."""
    ratio, rounds = res.get("relay_throughput_ratio"), res.get("relay_throughput_ratio_rounds")
    if ratio is None or not rounds:
        return []
    proxy = res.get("throughput_ratio")
    share = f"; the proxy keeps {_fmt(proxy / ratio, 2)} of the relay's calls/s" if proxy and ratio else ""
    return [
        "",
        "via_relay is `bench/relay_server.py`: the same call relayed to the same engine by a bare aiohttp "
        "server, nothing checked, rewritten, parsed or recorded, taking its turn in each round between the "
        f"other two. Calls/s through it ÷ direct: {_fmt(ratio, 2)} (by round: "
        f"{', '.join(_fmt(r, 2) for r in rounds)}){share}.",
    ]


def _engine_batch_lines(res: dict[str, Any], k: str) -> list[str]:
    """How full the engine's batch was on each path (from its /metrics), when it reported it."""
    direct, proxied = res["direct"][k].get("engine"), res["via_proxy"][k].get("engine")
    if not (direct and proxied):
        return []
    return [
        "",
        f"The engine at {res['concurrency']} agents (its /metrics): rows a decode pass "
        f"{_fmt(direct['rows_per_decode_pass'], 1)} direct, {_fmt(proxied['rows_per_decode_pass'], 1)} through "
        f"the proxy; steps a call {_fmt(direct['steps_per_call'], 3)} and {_fmt(proxied['steps_per_call'], 3)}, "
        f"prefill passes a call {_fmt(direct['prefill_passes_per_call'], 3)} and "
        f"{_fmt(proxied['prefill_passes_per_call'], 3)}. A call spends longer outside the engine through the "
        "proxy, so fewer calls share each pass and the engine does more passes for the same tokens.",
    ]


# ------------------------------------------------------------------ ratios and reports


def figure(run: dict[str, Any], system: str, key: str, metric: str) -> float | None:
    value = run.get(system, {}).get("results", {}).get(key, {}).get(metric)
    return float(value) if isinstance(value, int | float) else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def run_ratios(run: dict[str, Any]) -> dict[str, float | None]:
    w8 = lambda system, shape: figure(run, system, f"span_ingest/w8/{shape}", "spans_per_s")  # noqa: E731
    best_ours_mem = max(
        filter(None, [w8("lightning_grpc_memory", s) for s in ("unary64", "stream64")]), default=None
    )
    best_ours_sql = max(
        filter(None, [w8("lightning_grpc_sqlite", s) for s in ("unary64", "stream64")]), default=None
    )
    agl_best = w8("agentlightning", "otlp64")
    best_ours_pg = max(filter(None, [w8(POSTGRES, s) for s in ("unary64", "stream64")]), default=None)

    def cycle(system: str) -> float | None:
        return figure(run, system, "rollout_cycle/k32", "rollouts_per_s")

    ours_systems = ("lightning_grpc_memory", "lightning_grpc_sqlite")
    vs_ceiling = [ratio(w8("lightning_grpc_memory", s), w8("ceiling", s)) for s in ("unary64", "stream64")]
    w32_stream = ratio(
        figure(run, "lightning_grpc_memory", "span_ingest/w32/stream64", "spans_per_s"),
        figure(run, "ceiling", "span_ingest/w32/stream64", "spans_per_s"),
    )
    return {
        "span_ingest_w8_vs_agl_memory": ratio(best_ours_mem, agl_best),
        "span_ingest_w8_vs_ceiling_memory": min((v for v in vs_ceiling if v is not None), default=None),
        "span_ingest_w8_vs_ceiling_memory_unary64": vs_ceiling[0],
        "span_ingest_w8_vs_ceiling_memory_stream64": vs_ceiling[1],
        "span_ingest_w32_vs_ceiling_memory_stream64": w32_stream,
        "span_ingest_w8_vs_agl_sqlite": ratio(best_ours_sql, agl_best),
        # what synchronous=FULL (the default) keeps of NORMAL's throughput, on SQLite
        "sqlite_full_vs_normal_span_ingest": ratio(
            w8("lightning_grpc_sqlite", "stream64"), w8(SQLITE_NORMAL, "stream64")
        ),
        "sqlite_full_vs_normal_rollout_cycle": ratio(
            figure(run, "lightning_grpc_sqlite", "rollout_cycle/k32", "rollouts_per_s"),
            figure(run, SQLITE_NORMAL, "rollout_cycle/k32", "rollouts_per_s"),
        ),
        "rollout_cycle_k32_vs_agl_memory": ratio(cycle("lightning_grpc_memory"), cycle("agentlightning")),
        "rollout_cycle_k32_vs_agl_sqlite": ratio(cycle("lightning_grpc_sqlite"), cycle("agentlightning")),
        # PostgreSQL (fsync and synchronous_commit on) against the peer, and against SQLite's default (FULL)
        "span_ingest_w8_vs_agl_postgres": ratio(best_ours_pg, agl_best),
        "rollout_cycle_k32_vs_agl_postgres": ratio(cycle(POSTGRES), cycle("agentlightning")),
        "postgres_vs_sqlite_span_ingest": ratio(
            w8(POSTGRES, "stream64"), w8("lightning_grpc_sqlite", "stream64")
        ),
        "postgres_vs_sqlite_rollout_cycle": ratio(cycle(POSTGRES), cycle("lightning_grpc_sqlite")),
        # the rollout cycle against a server that only queues ids (bench/ceiling_server.py)
        "rollout_cycle_k32_vs_ceiling_memory": ratio(cycle("lightning_grpc_memory"), cycle("ceiling")),
        "rollout_cycle_k32_vs_ceiling_sqlite": ratio(cycle("lightning_grpc_sqlite"), cycle("ceiling")),
        "rollout_cycle_k32_ceiling_vs_agl": ratio(cycle("ceiling"), cycle("agentlightning")),
        # the worse backend: the lower speedup, the higher wire ratio
        "trainer_batch_speedup": worst([figure(run, s, "trainer_batch", "speedup") for s in ours_systems]),
        "trainer_batch_wire_ratio": worst(
            [figure(run, s, "trainer_batch", "wire_ratio") for s in ours_systems], higher_is_better=False
        ),
    }


#: Ratios where lower is better (the worst over runs is the highest).
LOWER_IS_BETTER = ("trainer_batch_wire_ratio", "trainer_data_path_share")


def worst(values: list[float | None], higher_is_better: bool = True) -> float | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return min(present) if higher_is_better else max(present)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "os": platform.platform(),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {name: version(name) for name in ("grpcio", "protobuf", "sqlite-utils", "lightning-grpc")}
    import sqlite3

    out["sqlite"] = sqlite3.sqlite_version
    try:
        out["psycopg"] = version("psycopg")
    except Exception:  # not installed: no PostgreSQL rows either
        pass
    return out


def write_reports(report: dict[str, Any], out_dir: Path, readme: Path | None, name: str = "latest") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (out_dir / f"{name}.md").write_text(md)
    if readme is not None and readme.exists():
        text = readme.read_text()
        start, end = "<!-- bench:start -->", "<!-- bench:end -->"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            _, tail = rest.split(end, 1)
            readme.write_text(head + start + "\n" + md + end + tail)


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and digits:
        return f"{v:,.{digits}f}"
    if isinstance(v, int | float):
        return f"{v:,.0f}"
    return str(v)


def _meets(value: float, target: str) -> bool:
    """Whether ``value`` meets a goal's target written as "≥ x" or "≤ x"."""
    bound = float(target[1:].strip())
    return value >= bound if target.startswith("≥") else value <= bound


def markdown(report: dict[str, Any]) -> str:
    runs = report["runs"]
    lines = [
        f"Measured {report['date']} on {report['machine']['cpu']} ({report['machine']['cores']} cores, "
        f"{report['machine']['memory_gib']} GiB), profile `{report['profile']}`, {len(runs)} run(s); "
        "each cell lists every run.",
        "",
    ]
    reference = report.get("full_reference")
    if report["profile"] != "quick":
        lines += ["| goal | figure | target | met |", "|---|---|---|---|"]
        for goal in report["goals"]:
            met = "yes" if goal["met"] else "no"
            lines.append(f"| {goal['name']} | {_fmt(goal['value'], 2)} | {goal['target']} | {met} |")
    else:
        since = f"the last full run, {reference['date']}" if reference else "no full run in this folder"
        lines += [
            f"The goals are set on the `{GOALS_PROFILE}` profile. At this profile's smaller sizes Agent Lightning "
            "is 2-3x faster than at full scale, so ratios against it read lower here; the full profile's figure "
            f"({since}) is beside this run's, and *met* judges that one.",
            "",
            f"| goal | this run (`{report['profile']}`) | full profile | target | met (full profile) |",
            "|---|---|---|---|---|",
        ]
        for goal in report["goals"]:
            full = (reference or {}).get("values", {}).get(goal["name"]) if reference else None
            met = "—" if full is None else "yes" if _meets(full, goal["target"]) else "no"
            lines.append(
                f"| {goal['name']} | {_fmt(goal['value'], 2)} | {_fmt(full, 2)} | {goal['target']} | {met} |"
            )
    lines += ["", "| workload | system | figure | runs |", "|---|---|---|---|"]
    systems = list(SYSTEMS)
    keys: list[str] = []
    for run in runs:
        for system in systems:
            for key in run.get(system, {}).get("results", {}):
                if key not in keys:
                    keys.append(key)
    for key in keys:
        for system in systems:
            cells = []
            metric = ""
            for run in runs:
                res = run.get(system, {}).get("results", {}).get(key)
                if res is None:
                    continue
                metric, value = headline(key, res)
                cells.append(value)
            if cells:
                lines.append(f"| {key} | {system} | {metric} | {' / '.join(cells)} |")
    lines += ["", "| system | peak server RSS (MiB), per run |", "|---|---|"]
    for system in systems:
        peaks = [_fmt(run.get(system, {}).get("peak_rss_mib"), 1) for run in runs if system in run]
        if peaks:
            lines.append(f"| {system} | {' / '.join(peaks)} |")
    fill = report.get("rss_after_fill", {})
    lines += [
        "",
        f"SQLite after storing {_fmt(fill.get('spans'))} spans: server RSS {_fmt(fill.get('rss_after_mib'), 1)} MiB "
        f"(peak {_fmt(fill.get('peak_rss_mib'), 1)} MiB), database {_fmt(fill.get('db_mib'), 1)} MiB, "
        f"ingest {_fmt(fill.get('spans_per_s'))} spans/s.",
        "",
        *cycle_ceiling_markdown(report),
        *postgres_markdown(report),
    ]
    lines += trainer_batch_markdown(runs)
    lines += trainer_loop_markdown(report.get("trainer_loop"))
    lines += proxy_markdown(report.get("proxy_overhead"))
    return "\n".join(lines) + "\n"


def cycle_ceiling_markdown(report: dict[str, Any]) -> list[str]:
    """The rollout cycle against the gRPC ceiling: what one stream message a rollout allows at all."""
    r = report["ratios"]
    if r.get("rollout_cycle_k32_ceiling_vs_agl") is None:
        return []
    return [
        "Rollout cycle K=32 against the gRPC ceiling (`bench/ceiling_server.py`: the same calls answered from a "
        "queue of ids, nothing checked or stored), worst over runs: memory "
        f"{_fmt(r.get('rollout_cycle_k32_vs_ceiling_memory'), 2)}, SQLite "
        f"{_fmt(r.get('rollout_cycle_k32_vs_ceiling_sqlite'), 2)} of the ceiling; the ceiling itself is "
        f"{_fmt(r.get('rollout_cycle_k32_ceiling_vs_agl'), 2)}x Agent Lightning.",
        "",
    ]


def postgres_markdown(report: dict[str, Any]) -> list[str]:
    """The PostgreSQL cluster's settings and its ratios, or why there are no PostgreSQL rows."""
    pg = report.get("postgres") or {}
    if "skipped" in pg:
        return [f"PostgreSQL rows skipped: {pg['skipped']}", ""]
    if not pg:
        return []
    r = report["ratios"]
    return [
        f"PostgreSQL ({POSTGRES}): {pg.get('server_version', '?').split()[0]}, a throwaway cluster started for "
        "this bench run on the same disk as SQLite's files, a fresh database per server; "
        f"fsync={pg.get('fsync')}, synchronous_commit={pg.get('synchronous_commit')}, "
        f"full_page_writes={pg.get('full_page_writes')} (SQLite: lightning_grpc_sqlite synchronous=FULL, "
        f"{SQLITE_NORMAL} NORMAL). Its peak RSS above is the lightning-grpc server's, not PostgreSQL's. "
        f"Worst over runs: span ingest W=8 ÷ Agent Lightning (OTLP batches) {_fmt(r.get('span_ingest_w8_vs_agl_postgres'), 2)}, "
        f"rollout cycle K=32 ÷ Agent Lightning {_fmt(r.get('rollout_cycle_k32_vs_agl_postgres'), 2)}; "
        f"÷ SQLite (FULL): span ingest W=8 stream64 {_fmt(r.get('postgres_vs_sqlite_span_ingest'), 2)}, "
        f"rollout cycle K=32 {_fmt(r.get('postgres_vs_sqlite_rollout_cycle'), 2)}.",
        "",
    ]


def trainer_batch_markdown(runs: list[dict[str, Any]]) -> list[str]:
    """Both figures of the training-batch workload, every run and backend, both vocabularies."""
    cells: list[tuple[int, str, dict[str, Any]]] = []
    for i, run in enumerate(runs, 1):
        for system in ("lightning_grpc_memory", "lightning_grpc_sqlite"):
            res = run.get(system, {}).get("results", {}).get("trainer_batch")
            if res is not None:
                cells.append((i, system, res))
    if not cells:
        return []
    ok = [c for c in cells if "error" not in c[2]]
    lines = []
    if ok:
        res = ok[0][2]
        head = res["regimes"]["tiny_2048"]
        rows = head["rows"]
        lines += [
            f"Training batch: {res['groups']} groups × {res['group_size']} rollouts = {rows} rows of "
            f"~{res['tokens']} prompt + ~{res['tokens']} response ids (±10 %), one LLM-call span and one reward "
            f"span each, padded to {head['padded_shape'][0]} × {head['padded_shape'][1]}. *ours*: "
            "`TrainerClient.get_batch(min_groups, request_id=R)` to verl's padded numpy arrays in the client, "
            "repeated with the same `R` (a retry rebuilds the same batch from the stored spans, so repetitions "
            'are comparable); *peer*: `StoreClient.query_spans(rollout_id, "latest")` for each rollout, then a '
            "per-row, per-element Python loop building the same arrays (checked identical to ours). Vocabularies: "
            "`tiny` = the embedded engine's tiny model, 2,048 ids (uint16 on the wire; the headline); `qwen` = "
            "151,646 ids, as Qwen2.5 (int32 on the wire). Wire = bytes of the received messages; payload = 4 "
            "bytes × prompt and response tokens.",
            "",
        ]
    lines += [
        "| run | backend | vocab | ours median/best ms | peer median/best ms (query + loop) | speedup median (best) "
        "| wire bytes | int32 payload | wire ÷ payload | without log-probs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, system, res in cells:
        if "error" in res:
            lines.append(f"| {i} | {system} | error: {str(res['error']).splitlines()[-1][:120]} |")
            continue
        for vocab, reg in res["regimes"].items():
            o, p, w, n = reg["ours"], reg["peer"], reg["with_log_probs"], reg["without_log_probs"]
            lines.append(
                f"| {i} | {system.removeprefix('lightning_grpc_')} | {vocab.split('_')[0]} "
                f"| {o['median_ms']}/{o['best_ms']} "
                f"| {p['median_ms']}/{p['best_ms']} ({p['query_median_ms']} + {p['build_median_ms']}) "
                f"| {_fmt(reg['speedup_median'], 2)} ({_fmt(reg['speedup_best'], 2)}) | {_fmt(w['wire_bytes'])} "
                f"| {_fmt(w['int32_token_payload_bytes'])} | {_fmt(w['wire_ratio'], 3)} | {_fmt(n['wire_ratio'], 3)} |"
            )
    return [*lines, ""]


def headline(key: str, res: dict[str, Any]) -> tuple[str, str]:
    if "error" in res:
        return "error", "error: " + str(res["error"]).splitlines()[-1][:80]
    if key.startswith("span_ingest"):
        return (
            "spans/s (p50/p99 ms per call)",
            f"{_fmt(res.get('spans_per_s'))} ({res.get('p50_ms')}/{res.get('p99_ms')})",
        )
    if key.startswith("rollout_cycle"):
        return "rollouts/s (dequeue p50/p99 ms)", (
            f"{_fmt(res.get('rollouts_per_s'), 1)} ({res.get('dequeue_p50_ms')}/{res.get('dequeue_p99_ms')})"
        )
    if key.startswith("completion_latency"):
        return "p50/p99 ms", f"{res.get('p50_ms')}/{res.get('p99_ms')}"
    if key == "trainer_batch":
        return "get_batch / per-row loop, median ms (speedup); wire ÷ int32 payload", (
            f"{res.get('ours_median_ms')}/{res.get('peer_median_ms')} ({_fmt(res.get('speedup'), 1)}×); "
            f"{_fmt(res.get('wire_ratio'), 3)}"
        )
    if key == "queries":
        s, r = res.get("spans_of_rollout", {}), res.get("list_rollouts_first_page", {})
        return "spans of a rollout; first page of rollouts (p50/p99 ms)", (
            f"{s.get('p50_ms')}/{s.get('p99_ms')}; {r.get('p50_ms')}/{r.get('p99_ms')}"
        )
    return "", json.dumps(res)[:80]


#: The profile the goals are set on: at the quick profile's small sizes Agent Lightning is 2-3x faster than at
#: full scale, so the quick profile's ratios against it read lower (a quick report shows both).
GOALS_PROFILE = "full"


def goals(
    ratios: dict[str, float | None],
    latency: float | None,
    rss: float | None,
    proxy: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Each goal: its name, this run's figure, the target, and whether the figure meets it."""

    def at_least(name: str, value: float | None, target: float, digits: int = 0) -> dict[str, Any]:
        return {
            "name": name,
            "value": value,
            "target": f"≥ {target:.{digits}f}",
            "met": value is not None and value >= target,
        }

    def at_most(name: str, value: float | None, target: float, digits: int = 0) -> dict[str, Any]:
        return {
            "name": name,
            "value": value,
            "target": f"≤ {target:.{digits}f}",
            "met": value is not None and value <= target,
        }

    r = ratios
    proxy_ratio = proxy_p99 = None
    if proxy and "error" not in proxy:
        proxy_ratio = proxy.get("throughput_ratio")
        proxy_p99 = proxy.get("added_ms", {}).get("agents_1", {}).get("p99")
    sync_worst = worst(
        [r.get("sqlite_full_vs_normal_span_ingest"), r.get("sqlite_full_vs_normal_rollout_cycle")]
    )
    return [
        at_least(
            "span ingest W=8, memory ÷ Agent Lightning (OTLP batches)", r["span_ingest_w8_vs_agl_memory"], 10
        ),
        at_least(
            "span ingest W=8, SQLite ÷ Agent Lightning (OTLP batches)", r["span_ingest_w8_vs_agl_sqlite"], 10
        ),
        at_least(
            "span ingest stream64 W=8, memory ÷ gRPC ceiling",
            r.get("span_ingest_w8_vs_ceiling_memory_stream64"),
            0.6,
            1,
        ),
        at_least(
            "span ingest stream64 W=32, memory ÷ gRPC ceiling",
            r.get("span_ingest_w32_vs_ceiling_memory_stream64"),
            0.6,
            1,
        ),
        at_least("rollout cycle K=32, memory ÷ Agent Lightning", r["rollout_cycle_k32_vs_agl_memory"], 20),
        at_least(
            "rollout cycle K=32, SQLite ÷ Agent Lightning", r.get("rollout_cycle_k32_vs_agl_sqlite"), 10
        ),
        at_least(
            "SQLite synchronous=FULL (the default) ÷ NORMAL, span ingest W=8 stream64 and rollout cycle K=32 "
            "(the worse)",
            sync_worst,
            0.75,
            2,
        ),
        at_most("completion latency p99 (ms)", latency, 50),
        at_most("server RSS after 1,000,000 SQLite spans (MiB)", rss, 200),
        at_least(
            "trainer_batch_speedup: get_batch ÷ per-row span-query loop (median, worse backend)",
            r["trainer_batch_speedup"],
            20,
        ),
        at_least(
            "trainer loop rollouts/s ÷ direct generation (same model and sampling)",
            r.get("trainer_loop_vs_direct"),
            0.75,
            2,
        ),
        at_most(
            "trainer data path (batch request to arrays, sync mode) as a share of a training step",
            r.get("trainer_data_path_share"),
            0.05,
            2,
        ),
        at_most(
            "trainer_batch_wire_ratio: wire bytes ÷ int32 token payload (2,048-id vocabulary, log-probs)",
            r["trainer_batch_wire_ratio"],
            1.2,
            1,
        ),
        at_least(
            "LLM proxy at 32 agents: calls/s through the proxy ÷ direct to the engine", proxy_ratio, 0.8, 1
        ),
        at_most("LLM proxy at 1 agent: p99 added by the proxy (ms)", proxy_p99, 3),
    ]


def full_reference(results: Path) -> dict[str, Any] | None:
    """The goals' figures of the last full-profile report in ``results`` (for a quick report to show beside its own)."""
    try:
        last = json.loads((results / "latest.json").read_text())
    except (OSError, ValueError):
        return None
    if last.get("profile") != GOALS_PROFILE:
        return None
    return {"date": last.get("date", "?"), "values": {g["name"]: g["value"] for g in last.get("goals", [])}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--no-readme", action="store_true", help="do not refresh the table in bench/README.md"
    )
    args = parser.parse_args(argv)
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = PROFILES[profile]
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", flush=True)

    if sizes.agl:
        log("setting up Agent Lightning 0.3.0 in bench/.venv-agl")
        subprocess.run([PY, str(BENCH / "agl_setup.py")], check=True, cwd=ROOT)
    workdir = Path(tempfile.mkdtemp(prefix="lightning-bench-"))
    cluster = BenchPostgres()
    pg = cluster.start()
    if pg is None:
        log(f"PostgreSQL rows skipped: {cluster.why}")
    else:
        settings = ", ".join(
            f"{k}={cluster.info.get(k)}" for k in ("fsync", "synchronous_commit", "full_page_writes")
        )
        log(
            f"PostgreSQL {cluster.info.get('server_version', '?').split()[0]} started for this run ({settings})"
        )
    try:
        runs = [one_run(sizes, workdir, i + 1, log, pg) for i in range(sizes.runs)]
        fill = rss_after_fill(sizes, workdir, log)
        proxy = proxy_overhead(profile, workdir, log)
        loop = trainer_loop(profile, log)
    finally:
        cluster.destroy()
        shutil.rmtree(workdir, ignore_errors=True)
    per_run = [run_ratios(run) for run in runs]
    ratios = {
        key: worst([r[key] for r in per_run], higher_is_better=key not in LOWER_IS_BETTER)
        for key in per_run[0]
    }
    latency = worst(
        [
            figure(run, system, f"completion_latency/{via}", "p99_ms")
            for run in runs
            for system in ("lightning_grpc_memory", "lightning_grpc_sqlite")
            for via in ("wait", "watch")
        ],
        higher_is_better=False,
    )
    rss = fill.get("rss_after_mib") if fill.get("spans", 0) >= 1_000_000 else None
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "profile": profile,
        "machine": machine(),
        "versions": versions(),
        "ratios": ratios,
        "ratios_by_run": per_run,
        "completion_latency_p99_ms": latency,
        "rss_1m_spans_sqlite_mib": rss,
        "rss_after_fill": fill,
        "postgres": cluster.info if pg is not None else {"skipped": cluster.why},
        "proxy_overhead": proxy,
        "trainer_loop": loop,
        "runs": runs,
        "notes": "Top-level ratios are the worst over runs (and, against the ceiling, over the unary and stream "
        "shapes); completion latency is the worst p99 of both backends and both ways of waiting.",
    }
    if loop and "error" not in loop:
        ratios["trainer_loop_vs_direct"] = loop["rollouts_per_second_ratio"]
        ratios["trainer_data_path_share"] = loop["data_path_share"]
    report["goals"] = goals(ratios, latency, rss, proxy)
    if profile == "quick":
        report["full_reference"] = full_reference(args.out)
    # a quick run writes quick.{json,md}: the full profile's latest.{json,md}, which the goals refer to, stay
    name = "quick" if profile == "quick" else "latest"
    readme = None if (args.no_readme or profile != GOALS_PROFILE) else ROOT / "bench" / "README.md"
    write_reports(report, args.out, readme, name)
    log(f"wrote {args.out / (name + '.json')} and {name}.md")
    print((args.out / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
