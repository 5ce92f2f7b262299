"""A tiny run of the benchmark code, so it cannot rot (the real benchmarks run with `make bench`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: The smoke run takes about 50 s on an idle two-core machine and 90 s beside two busy processes; its
#: drivers and servers each have their own time bound (bench/run.py), so the whole run is given room
#: for one of them to run out, and this test's own limit lies above the run's.
SMOKE_SECONDS = 420


@pytest.mark.timeout(SMOKE_SECONDS + 120)  # a minute for an overrun run to stop, and a margin
def test_the_benchmark_harness_runs_every_grpc_peer_and_writes_its_reports(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "bench/run.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the run, its servers and drivers: one group to stop
    )
    try:
        log, _ = bench.communicate(timeout=SMOKE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(bench.pid, signal.SIGINT)  # as Ctrl-C: the run stops its servers and its PostgreSQL cluster
        try:
            log, _ = bench.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(bench.pid, signal.SIGKILL)
            log, _ = bench.communicate()
        pytest.fail(f"the smoke run took over {SMOKE_SECONDS} s; its progress log:\n{log[-6000:]}")
    assert bench.returncode == 0, log[-6000:]
    assert "was killed" not in log, log[-6000:]  # a server that did not stop within 30 s of SIGTERM
    report = json.loads((tmp_path / "latest.json").read_text())
    run = report["runs"][0]
    for system in ("ceiling", "lightning_grpc_memory", "lightning_grpc_sqlite"):
        for shape in ("single", "unary64", "stream64"):
            res = run[system]["results"][f"span_ingest/w8/{shape}"]
            assert "error" not in res, res
            assert res["spans_done"] == 256 and res["spans_per_s"] > 0
    for system in ("ceiling", "lightning_grpc_memory", "lightning_grpc_sqlite"):
        for workload in ("rollout_cycle/k8", "rollout_cycle/k8/three_calls"):
            res = run[system]["results"][workload]
            assert res["completed"] == 40, (system, workload)
            # the rate's time ends at the last report, at or before the workers' return
            assert 0 < res["seconds"] <= res["workers_done_seconds"], (system, workload, res)
    for system in ("lightning_grpc_memory", "lightning_grpc_sqlite"):
        results = run[system]["results"]
        assert results["queries"]["spans_of_rollout"]["spans"] == 200
        assert results["completion_latency/wait"]["samples"] == 3
        batch = results["trainer_batch"]  # get_batch and the per-row span-query loop, on a fresh server
        assert "error" not in batch, batch
        assert all(r["rows"] == 8 and r["identical_arrays"] for r in batch["regimes"].values())
        assert batch["speedup"] > 0 and batch["wire_ratio"] > 0
    assert report["rss_after_fill"]["spans"] == 2000 and report["rss_after_fill"]["rss_after_mib"] > 0
    assert set(report["ratios"]) >= {
        "span_ingest_w8_vs_agl_memory",
        "span_ingest_w8_vs_ceiling_memory",
        "span_ingest_w8_vs_agl_sqlite",
        "rollout_cycle_k32_vs_agl_memory",
        "rollout_cycle_k32_vs_ceiling_memory",
        "trainer_batch_speedup",
        "trainer_batch_wire_ratio",
    }
    assert "completion_latency_p99_ms" in report and "rss_1m_spans_sqlite_mib" in report
    proxy = report["proxy_overhead"]  # through `serve --proxy-backend` to the embedded engine, and direct
    assert "error" not in proxy, proxy
    assert proxy["spans_recorded_agent0"] > 0 and proxy["throughput_ratio"] > 0
    for path in ("direct", "via_relay", "via_proxy"):  # the engine's batch on each path, from its /metrics
        engine = proxy[path][f"agents_{proxy['concurrency']}"]["engine"]
        assert engine["steps_per_call"] > 0 and engine["rows_per_decode_pass"] >= 1, engine
    # the bare relay (bench/relay_server.py) took its turn: every call answered, and its ratio reported
    assert proxy["via_relay"]["errors"] == 0 and proxy["relay_throughput_ratio"] > 0
    markdown = (tmp_path / "latest.md").read_text()
    assert "| goal | figure | target | met |" in markdown
    assert "rows a decode pass" in markdown
    assert "| via_relay | - |" in markdown and "Calls/s through it ÷ direct" in markdown
