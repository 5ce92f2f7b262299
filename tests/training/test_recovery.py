"""The pieces a run's recovery stands on: the seeded task plan, checkpoints replaced atomically (a kill -9
during the write leaves the previous one the latest), the interruption journal and the fresh-start rule."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from lightning_grpc.training import recovery
from lightning_grpc.training.plan import PLAN_EPOCH_KEY, PLAN_POSITION_KEY, PLAN_TASK_KEY, TaskPlan
from lightning_grpc.training.recovery import Interruption, Journal


def test_the_plan_draws_every_task_once_an_epoch_in_a_seeded_order() -> None:
    plan = TaskPlan(tasks=7, seed=3)
    drawn = [plan.at(p) for p in plan.draw(5) + plan.draw(16)]
    assert plan.drawn == 21
    epochs = [drawn[i : i + 7] for i in range(0, 21, 7)]
    assert all(sorted(epoch) == list(range(7)) for epoch in epochs)
    assert epochs[0] != epochs[1]  # each epoch shuffled anew
    again = TaskPlan(tasks=7, seed=3, drawn=12)  # a resumed run: the same draws from where it was
    assert [again.at(p) for p in again.draw(9)] == drawn[12:]
    assert [TaskPlan(7, 4).at(p) for p in range(7)] != epochs[0]
    assert plan.metadata(9) == {PLAN_POSITION_KEY: 9, PLAN_EPOCH_KEY: 1, PLAN_TASK_KEY: drawn[9]}
    with pytest.raises(ValueError):
        TaskPlan(tasks=0, seed=0)


SLOW_WRITER = """
import sys, time
from pathlib import Path
from lightning_grpc.training import recovery

def write(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"new" * 1000)
    print("writing", flush=True)
    time.sleep(60)  # killed here, before trainer_state.pt
    (path / "trainer_state.pt").write_bytes(b"state")

recovery.write_atomically(Path(sys.argv[1]), write)
"""


def whole_checkpoint(path: Path, content: bytes) -> None:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(content)
    (path / "trainer_state.pt").write_bytes(b"state")


@pytest.mark.parametrize("replacing", [False, True], ids=["new-step", "same-step-replaced"])
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_the_latest(
    tmp_path: Path, replacing: bool
) -> None:
    folder = tmp_path / recovery.CHECKPOINTS
    whole_checkpoint(folder / "step-000002", b"old")
    target = folder / ("step-000002" if replacing else "step-000004")
    writer = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(target)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    latest = recovery.latest_checkpoint(tmp_path)
    assert latest == folder / "step-000002"
    assert (latest / "model.safetensors").read_bytes() == b"old"  # untouched by the write that died
    recovery.prune(tmp_path, keep=2)  # the next run removes the partial write
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002"]


def test_a_whole_write_replaces_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    folder = tmp_path / recovery.CHECKPOINTS
    for step in (1, 2, 3):
        recovery.write_atomically(
            folder / f"step-{step:06d}", lambda p, s=step: whole_checkpoint(p, bytes([s]))
        )
    recovery.write_atomically(folder / "step-000003", lambda p: whole_checkpoint(p, b"again"))
    assert (folder / "step-000003" / "model.safetensors").read_bytes() == b"again"
    recovery.prune(tmp_path, keep=2)
    assert [p.name for p in recovery.step_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    assert recovery.checkpoint_step(folder / "step-000003") == 3
    (folder / "step-000009").mkdir()  # no learner state in it: not a checkpoint
    assert recovery.latest_checkpoint(tmp_path) == folder / "step-000003"


def test_the_journal_keeps_each_interruption_and_hands_it_to_one_report(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    first = Interruption(time.time(), "engine", "killed by signal 9 (SIGKILL)", "restarted", 4.1, 3)
    journal.record(first)
    journal.record(Interruption(time.time(), "runners-0", "exited with code 1", "restarted", 1.0, 5))
    assert [i.process for i in journal.take_unreported()] == ["engine", "runners-0"]
    assert journal.take_unreported() == []
    with open(tmp_path / recovery.JOURNAL, "a") as f:
        f.write('{"time": 1, "proc')  # a line cut by a kill during its write
    again = Journal(tmp_path).read()
    assert [i.process for i in again] == ["engine", "runners-0"] and again[0] == first
    lines = (tmp_path / recovery.JOURNAL).read_text().splitlines()
    assert json.loads(lines[0])["cause"] == "killed by signal 9 (SIGKILL)"
    assert recovery.describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert recovery.describe_exit(2) == "exited with code 2"
    assert Counter(i.process for i in again)["engine"] == 1
