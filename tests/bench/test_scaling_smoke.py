"""A tiny run of the scaling curve (bench/scaling.py), so it cannot rot (`make bench` runs it for real)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_the_scaling_curve_fills_measures_and_writes_its_reports(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "bench/scaling.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "scaling.json").read_text())
    assert set(report["systems"]) == {"lightning_grpc_memory", "lightning_grpc_sqlite"}
    for system, res in report["systems"].items():
        points = res["points"]
        assert [p["size"] for p in points] == [50, 150] and all(p["reached"] for p in points), system
        assert points[0]["finished"] == 50 and points[0]["fill"]["filled"] == 50
        for p in points:
            m = p["measure"]
            assert "error" not in m, m
            assert m["spans_of_rollout"]["spans"] == 10
            assert m["list_succeeded"]["matches"] >= p["finished"] and m["list_succeeded"]["page"] == 50
            assert m["list_queuing"]["matches"] == m["list_queuing"]["page"] == 20
            assert m["dequeue"]["samples"] == 10 and m["rollout_cycle"]["rollouts_per_s"] > 0
    assert {(r["measure"], r["system"]) for r in report["flatness"]} >= {
        ("list_succeeded", "lightning_grpc_memory"),
        ("rollout_cycle", "lightning_grpc_sqlite"),
    }
    assert "## Where it is not flat" in (tmp_path / "scaling.md").read_text()
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
