"""The examples in `examples/`, run as their READMEs say: the store, a runner and the search, as processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_grpc import semconv
from lightning_grpc.client import SyncStoreClient
from lightning_grpc.examples import prompt_search_demo as demo
from lightning_grpc.types import RolloutStatus
from tests.conftest import ROOT, ServerProcess
from tests.examples.test_prompt_search import expected_score, favoured_candidate

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")}
#: The ``lightning-grpc`` command of this environment, as the README runs it.
SCRIPT = Path(sys.executable).with_name("lightning-grpc")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "lightning_grpc.cli.main"]
ROLLOUTS = len(demo.CANDIDATES) * len(demo.TASKS)


def serve(server_process: type[ServerProcess], tmp_path: Path) -> ServerProcess:
    return server_process("--port", "0", "--db", str(tmp_path / "store.db"), "--grace", "2").start()


@pytest.fixture
def store(server_process: type[ServerProcess], tmp_path: Path) -> Iterator[ServerProcess]:
    """A store process, and ``lightning-grpc runner examples.prompt_search.agent:agent`` serving it.

    Both must exit 0 on SIGTERM. ``PYTHONPATH=.`` as in the README: the ``lightning-grpc`` script
    does not import modules of the working directory without it.
    """
    served = serve(server_process, tmp_path)
    log = tmp_path / "runner.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                *COMMAND,
                "runner",
                "examples.prompt_search.agent:agent",
                "--store",
                served.address,
                "--concurrency",
                "8",
                "--poll-wait",
                "0.5",
            ],
            cwd=ROOT,
            env={**CLEAN_ENV, "PYTHONPATH": "."},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while "event=runner_started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield served
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert served.terminate() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def run_search(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "examples.prompt_search.search", "--store", address, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=CLEAN_ENV,
        timeout=120,
    )


def test_the_prompt_search_example_finds_the_favoured_prompt(store: ServerProcess) -> None:
    done = run_search(store.address, "--timeout", "60")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"{ROLLOUTS}/{ROLLOUTS} rollouts rewarded" in done.stdout
    winner = re.search(r"^winner\s+(\S+) \(mean reward \d\.\d+ over 5 tasks\)$", done.stdout, re.MULTILINE)
    assert winner is not None, done.stdout
    assert winner.group(1) == favoured_candidate()
    assert re.search(rf"^trace\s+  {semconv.SPAN_OPERATION} name=score output=", done.stdout, re.MULTILINE)


def test_every_rollout_of_the_example_holds_the_score_operation_and_its_reward(
    store: ServerProcess,
) -> None:
    assert run_search(store.address, "--timeout", "60").returncode == 0
    client = SyncStoreClient(store.address)
    try:
        rollouts = client.query_rollouts()
        assert len(rollouts) == ROLLOUTS
        assert {r.status for r in rollouts} == {RolloutStatus.SUCCEEDED}
        trials = set()
        for r in rollouts:
            candidate, task_id = r.metadata["candidate"], r.input["task_id"]
            trials.add((candidate, task_id))
            spans = client.query_spans(r.rollout_id, "latest")
            assert [s.name for s in spans] == [
                semconv.SPAN_OPERATION,
                semconv.SPAN_REWARD,
                semconv.SPAN_ROLLOUT,
            ]
            op, reward, root = spans
            assert op.parent_span_id == reward.parent_span_id == root.span_id
            expected = expected_score(candidate, task_id)
            assert op.attributes[semconv.OPERATION_NAME] == "score"
            assert op.attributes[semconv.OPERATION_OUTPUT] == expected
            assert semconv.read_primary_reward(reward.attributes) == expected
    finally:
        client.close()
    assert trials == {(name, t["task_id"]) for name in demo.CANDIDATES for t in demo.TASKS}


def test_without_runners_the_search_reports_every_rollout_unfinished(
    server_process: type[ServerProcess], tmp_path: Path
) -> None:
    store = serve(server_process, tmp_path)
    done = run_search(store.address, "--timeout", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"0/{ROLLOUTS} rollouts rewarded" in done.stdout
    assert (
        len(re.findall(r"^failed\s+ro-\S+ \S+/\S+ queuing: unfinished$", done.stdout, re.MULTILINE))
        == ROLLOUTS
    )
    assert re.search(r"^winner\s+none: no candidate got a reward$", done.stdout, re.MULTILINE)
    assert store.terminate() == 0
