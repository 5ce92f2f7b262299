"""The multi-node recipe on one machine: examples/multi_node/two_nodes_on_loopback.py, run as the docs run it.

- ``test_two_ray_nodes_run_every_rollout_across_a_take_over``: the script, on the session's PostgreSQL
  (``--postgres``), starts a writer and a standby store server, a two-node Ray cluster and a runner fleet
  spread over both nodes; it kills the writer with SIGKILL midway. Every rollout succeeded with its reward
  span, both nodes ran rollouts (by the worker ids the store recorded), what had succeeded before the kill
  is unchanged after it, and nothing the run started is left running.
- ``test_what_is_missing_is_one_line_and_exit_2``: without Ray, or with no PostgreSQL to start, the script
  says so in one line and exits 2 before starting anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from examples.multi_node import two_nodes_on_loopback as script
from tests.conftest import ROOT
from tests.store import postgres_server

SCRIPT = ROOT / "examples" / "multi_node" / "two_nodes_on_loopback.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ray_nodes_run_every_rollout_across_a_take_over(postgres_url: str, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    report_path = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_GRPC_", "RAY_"))}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--postgres", postgres_url, "--json", str(report_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stderr.strip() == "", out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["rollouts"] == report["succeeded"] == report["rewarded"] == 60
    assert report["attempts"] >= 60
    assert report["succeeded_before_kill"] >= 20
    assert report["kept_across_take_over"] == report["succeeded_before_kill"]  # nothing lost by the take-over
    assert report["without_writer_s"] < 30
    nodes = report["nodes"]
    assert len(nodes) == 2 and len({n["node_id"] for n in nodes}) == 2
    assert [n["head"] for n in nodes] == [True, False]
    assert [len(n["runners"]) for n in nodes] == [2, 2]  # SPREAD: two actors on each node
    assert all(n["rollouts"] > 0 for n in nodes), nodes  # both nodes ran rollouts
    assert sum(n["rollouts"] for n in nodes) == 60  # every rollout by a runner of the fleet
    # Everything the run started is stopped: its Ray nodes (their processes name its temp dir), its servers.
    assert not Path(report["temp_dir"]).exists()
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if report["temp_dir"] in cmdline or postgres_url in cmdline:
            left.append(cmdline[:200])
    assert left == []


@pytest.mark.parametrize("what", ["ray", "postgres"])
def test_what_is_missing_is_one_line_and_exit_2(
    what: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if what == "ray":
        real = script.importlib.util.find_spec
        monkeypatch.setattr(
            script.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
        )
        expected = "error: Ray is not installed (pip install 'lightning-grpc[ray]')\n"
    else:
        pytest.importorskip("ray")
        pytest.importorskip("psycopg")
        monkeypatch.setattr(
            postgres_server, "why_unavailable", lambda: "PostgreSQL is not installed (no initdb)"
        )
        expected = (
            "error: cannot start a throwaway PostgreSQL: PostgreSQL is not installed (no initdb);"
            " or pass --postgres URL\n"
        )
    assert script.main([]) == 2
    captured = capsys.readouterr()
    assert captured.err == expected and captured.out == ""
