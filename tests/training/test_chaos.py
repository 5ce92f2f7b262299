"""A training run killed anywhere: kill -9 of the store server, the engine, a runner and the trainer itself,
one after another, in a real `lightning-grpc train` run. The children come back by themselves, the trainer by
running its command again; then the Store and the run's records are checked: every task drawn as the
seeded plan says, no rollout in two batches, no batch trained twice, whole groups, a retried attempt's calls
apart from the crashed one's, and the final weights equal to those of the same run never interrupted.

Also here: Ctrl-C (SIGINT to the process group, as a terminal sends it) stops cleanly with a checkpoint and
exit 130, a step where every rollout failed is an error that says why, and a learner rank killed ends the run
at its last checkpoint, which the same command resumes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest
from safetensors.torch import load_file

from bench.chaos_probe import read_store  # the long probe reads a run's store back the same way
from lightning_grpc.batching.groups import BATCH_KEY
from lightning_grpc.client import StoreClient
from lightning_grpc.errors import UnavailableError
from lightning_grpc.examples.combination_lock import train_tasks, write_jsonl
from lightning_grpc.training import recovery
from lightning_grpc.training.plan import PLAN_EPOCH_KEY, PLAN_POSITION_KEY, PLAN_TASK_KEY
from tests.conftest import ROOT
from tests.engine_fixtures import CLI, QUIET_ENV

pytestmark = pytest.mark.timeout(900)

STEPS, GROUPS, GROUP_SIZE = 8, 6, 4

CONFIG = """
[experiment]
name = "chaos"
output_dir = "{out}"
seed = 0
steps = {steps}
mode = "sync"

[agent]
agent = "lightning_grpc.examples.combination_lock:agent"
train_tasks = "train.jsonl"
processes = 2
concurrency = 32
unresponsive_timeout = 3

[model]
path = "{model}"

[data]
group_size = {group_size}
batch_size = {groups}

[sampling]
max_tokens = 2

[optim]
lr = 5e-3

[ppo]
loss_agg_mode = "per-rollout-mean"

[validation]
every = 0

[checkpoint]
every = 3
keep = 2

[services]
restart_backoff = 0.2
"""


def write_run(folder: Path, model: Path, out: str, steps: int = STEPS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(train_tasks(), folder / "train.jsonl")
    path = folder / "config.toml"
    path.write_text(CONFIG.format(out=out, model=model, steps=steps, groups=GROUPS, group_size=GROUP_SIZE))
    return path


class Run:
    """``lightning-grpc train`` as a terminal starts it: its own session and process group."""

    def __init__(self, config: Path) -> None:
        self.log = config.parent / f"run-{time.monotonic_ns()}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*CLI, "train", str(config), "--no-progress"],
                cwd=ROOT,
                env=QUIET_ENV,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while f"step {step:4d} " not in self.text():
            assert self.proc.poll() is None, f"the run ended (code {self.proc.returncode}):\n{self.text()}"
            assert time.monotonic() < deadline, f"no step {step} after {timeout:.0f} s:\n{self.text()}"
            time.sleep(0.2)

    def child(self, word: str) -> psutil.Process:
        """The trainer's child whose command line holds ``word`` (serve, engine, runner)."""
        return self.children(word)[0]

    def children(self, word: str) -> list[psutil.Process]:
        """The trainer's children whose command line holds ``word`` (the runners: one per process)."""
        return [c for c in psutil.Process(self.proc.pid).children() if word in c.cmdline()]

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)


def journal(out: Path) -> list[dict[str, Any]]:
    path = out / "interruptions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_recovery(out: Path, process: str, count: int, timeout: float = 120) -> dict[str, Any]:
    """The ``count``-th interruption of a process whose name starts with ``process`` ("runners-": any runner)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [i for i in journal(out) if i["process"].startswith(process)]
        if len(found) >= count:
            return found[-1]
        assert time.monotonic() < deadline, f"no recovery of {process} in {timeout:.0f} s: {journal(out)}"
        time.sleep(0.2)


def wait_until_holding(run: Run, out: Path, timeout: float = 60) -> psutil.Process:
    """A runner that runs a rollout now (the store shows an attempt of its worker id running), so that its kill
    cuts one short: a kill between two steps' generations would find it idle and prove nothing. Any of the
    runners: the first to claim takes a whole step's rollouts (up to its concurrency), so one runner may sit
    idle for the rest of the run.

    A store that does not answer is asked again until ``timeout``: should the server have died once more, the
    supervisor restarts it on the same port, and the journal's check below says so with its cause."""
    runners = run.children("runner")
    cmdline = run.child("serve").cmdline()
    address = f"127.0.0.1:{cmdline[cmdline.index('--port') + 1]}"  # fixed since the server's restart
    unanswered: list[str] = []

    async def poll() -> psutil.Process | None:
        deadline = time.monotonic() + timeout
        async with StoreClient(address) as store:
            while time.monotonic() < deadline:
                try:
                    running = await store.query_rollouts(status_in=["running"])
                except UnavailableError as exc:
                    unanswered.append(f"{time.strftime('%H:%M:%S')} {exc}")
                    await asyncio.sleep(0.2)
                    continue
                workers = [r.latest_attempt.worker_id for r in running if r.latest_attempt]
                for runner in runners:
                    if any(f"-{runner.pid}-" in worker for worker in workers):
                        return runner
                await asyncio.sleep(0.02)
        return None

    holding = asyncio.run(poll())
    assert holding is not None, (
        f"no runner of {[r.pid for r in runners]} ran a rollout in {timeout:.0f} s; the store at {address} did "
        f"not answer {len(unanswered)} times {unanswered[:2]}; journal: {journal(out)}; "
        f"the run's log:\n{run.text()[-4000:]}"
    )
    return holding


def kill(process: psutil.Process) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(10)


def final_weights(out: Path) -> dict[str, Any]:
    return load_file(str(out / "final" / "model.safetensors"))


def test_a_run_killed_anywhere_ends_as_the_run_never_interrupted(tmp_path: Path, tiny_model: Path) -> None:
    config = write_run(tmp_path / "chaos", tiny_model, "out")
    out = config.parent / "out"
    run = Run(config)
    run.wait_for_step(1)
    kill(run.child("serve"))
    wait_for_recovery(out, "server", 1)
    run.wait_for_step(3)
    kill(run.child("engine"))
    wait_for_recovery(out, "engine", 1)
    run.wait_for_step(4)
    kill(wait_until_holding(run, out))
    runner_entry = wait_for_recovery(out, "runners-", 1)
    run.wait_for_step(7)
    children = psutil.Process(run.proc.pid).children()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait()
    _, alive = psutil.wait_procs(children, timeout=15)  # its children stop with it
    assert not alive, [c.cmdline() for c in alive]

    again = Run(config)  # the same command: it resumes by itself
    assert again.wait() == 0, again.text()
    text = again.text()
    assert "resuming from" in text and "step-000006" in text
    assert "stopped after 2 steps of this invocation (resumed after step 6)" in text
    kinds = [i["process"] for i in journal(out)]
    assert kinds == ["server", "engine", runner_entry["process"], "trainer"], (
        journal(out),
        run.text()[-4000:],
    )
    trainer_entry = journal(out)[-1]
    assert "steps 7-7 redone from their stored batches" in trainer_entry["recovery"]
    assert all(i["recovery_seconds"] > 0 for i in journal(out))

    reference = write_run(tmp_path / "reference", tiny_model, "out")
    done = subprocess.run(
        [*CLI, "train", str(reference), "--no-progress"],
        cwd=ROOT,
        env=QUIET_ENV,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    # the weights: bit-exact with the run that was never interrupted
    chaos, calm = final_weights(out), final_weights(reference.parent / "out")
    assert chaos.keys() == calm.keys()
    assert all(chaos[name].equal(calm[name]) for name in chaos)

    # the metrics: each step once
    metrics = (out / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in metrics[1:]] == [str(s) for s in range(1, STEPS + 1)]

    groups, retried = asyncio.run(read_store(out / "store.db"))
    calm_groups, _ = asyncio.run(read_store(reference.parent / "out" / "store.db"))
    # every step's groups, taken whole by that step's batch, by no other
    assert sorted(groups) == sorted(f"chaos-s{s}-g{i}" for s in range(1, STEPS + 1) for i in range(GROUPS))
    for group_id, members in groups.items():
        step = group_id.split("-s", 1)[1].split("-", 1)[0]
        assert len(members) == GROUP_SIZE
        assert {r.metadata.get(BATCH_KEY) for r in members} == {f"chaos-b{step}"}, group_id
    # the tasks: drawn as the seeded plan says, each once an epoch, the same as the uninterrupted run's
    plan = sorted(
        (m[0].metadata[PLAN_POSITION_KEY], m[0].metadata[PLAN_TASK_KEY], g) for g, m in groups.items()
    )
    assert [p for p, _, _ in plan] == list(range(STEPS * GROUPS))
    epochs: dict[int, list[int]] = defaultdict(list)
    for _, task, group_id in plan:
        epochs[groups[group_id][0].metadata[PLAN_EPOCH_KEY]].append(task)
    tasks = len(train_tasks())
    assert all(len(set(drawn)) == len(drawn) for drawn in epochs.values())
    assert all(sorted(drawn) == list(range(tasks)) for e, drawn in epochs.items() if e < max(epochs))
    assert {g: (m[0].input, m[0].metadata[PLAN_POSITION_KEY]) for g, m in groups.items()} == {
        g: (m[0].input, m[0].metadata[PLAN_POSITION_KEY]) for g, m in calm_groups.items()
    }
    # attempts cut short by the kills were tried again; what trains is the last attempt's calls alone
    assert retried, "no attempt was retried: the kills hit no rollout in flight"
    for attempts, report, earlier in retried.values():
        assert report.attempt_id == attempts[-1].attempt_id
        assert report.triplets and not {t.span_id for t in report.triplets} & set(earlier)


def test_ctrl_c_stops_with_a_checkpoint_and_the_same_command_resumes(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = write_run(tmp_path, tiny_model, "out", steps=40)
    run = Run(config)
    run.wait_for_step(2)
    os.killpg(run.proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
    assert run.wait(120) == 130, run.text()
    text = run.text()
    stopped = int(text.split("interrupted after step ", 1)[1].split(":", 1)[0])
    assert stopped >= 2 and f"checkpoint {tmp_path / 'out' / 'checkpoints' / f'step-{stopped:06d}'}" in text
    assert "to resume, run the same command again: lightning-grpc train" in text
    assert "Traceback" not in text and "UNAVAILABLE" not in text
    state = json.loads((tmp_path / "out" / "run_state.json").read_text())
    assert state["status"] == "interrupted" and state["step"] == stopped
    config.write_text(config.read_text().replace("steps = 40", f"steps = {stopped + 1}"))
    again = Run(config)
    assert again.wait() == 0, again.text()
    assert f"resumed after step {stopped}" in again.text()
    assert "stopped by a signal" in journal(tmp_path / "out")[-1]["cause"]


STEP_TWO_FAILS = '''
from lightning_grpc.examples.combination_lock import agent as lock


async def agent(task, llm, rollout):
    """The lock's agent, except that every rollout of step 2's first draw fails (as under an outage)."""
    if "-s2-g" in rollout.rollout_id:
        raise RuntimeError("the tool server refused the connection")
    return await lock(task, llm, rollout)
'''


def test_a_step_where_every_rollout_failed_is_an_error_and_the_same_command_draws_it_anew(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = write_run(tmp_path, tiny_model, "out", steps=3)
    (tmp_path / "step_two_fails.py").write_text(STEP_TWO_FAILS)
    text = config.read_text().replace(
        'agent = "lightning_grpc.examples.combination_lock:agent"', 'agent = "step_two_fails:agent"'
    )
    config.write_text(text.replace("every = 3", "every = 1").replace("processes = 2", "processes = 1"))
    command = [*CLI, "train", str(config), "--no-progress"]
    first = subprocess.run(command, cwd=tmp_path, env=QUIET_ENV, capture_output=True, text=True, timeout=300)
    # the error says what the rollouts' attempts said, without a traceback
    assert first.returncode == 1 and "error: step 2: every rollout failed" in first.stderr, first.stderr
    assert "the tool server refused the connection" in first.stderr and "Traceback" not in first.stderr
    state = json.loads((tmp_path / "out" / "run_state.json").read_text())
    assert (state["status"], state["step"], state["failed_step"]) == ("failed", 1, 2)
    again = subprocess.run(command, cwd=tmp_path, env=QUIET_ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    entry = journal(tmp_path / "out")[-1]
    assert entry["process"] == "trainer" and entry["cause"].startswith("stopped on an error: step 2: every")
    assert "step 2, where every rollout had failed, drawn anew" in entry["recovery"]
    metrics = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in metrics[1:]] == ["1", "2", "3"]


def test_a_learner_rank_killed_ends_the_run_at_its_checkpoint_and_the_same_command_resumes(
    tmp_path: Path, tiny_model: Path
) -> None:
    """kill -9 of one of two learner ranks (Ray actors, FSDP over gloo) once step 2 is done: the run does not
    wait for it (its peer is left in a collective) but ends within seconds, exit 1, with one paragraph that
    names the rank and the last whole checkpoint, no traceback; the same command resumes from that checkpoint
    and finishes."""
    pytest.importorskip("ray")
    steps = 4
    config = write_run(tmp_path, tiny_model, "out", steps=steps)
    text = config.read_text().replace("processes = 2", "processes = 1").replace("every = 3", "every = 1")
    config.write_text(text + "\n[learner]\nranks = 2\n")
    out = tmp_path / "out"
    run = Run(config)
    run.wait_for_step(2)
    rank = next(  # a rank's process: Ray names it after the actor's class (and the method it runs)
        p
        for p in psutil.Process(run.proc.pid).children(recursive=True)
        if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::RankActor")
    )
    killed = time.monotonic()
    kill(rank)
    assert run.wait(120) == 1, run.text()
    assert time.monotonic() - killed < 60, run.text()
    text = run.text()
    latest = recovery.latest_checkpoint(out)
    assert latest is not None and recovery.checkpoint_step(latest) >= 1
    error = re.search(r"^error: (.*)$", text, re.MULTILINE)
    assert error is not None, text
    assert re.fullmatch(
        rf"learner rank [01] of 2 \(pid {rank.pid} on [^)]+\) died \(.*\); the run stops at its last whole "
        rf"checkpoint, {re.escape(str(latest))} \(a rank is not restarted alone: .*\)",
        error.group(1),
    ), error.group(1)
    assert "to resume: lightning-grpc train" in text and "Traceback" not in text, text
    assert json.loads((out / "run_state.json").read_text())["status"] == "failed"

    again = Run(config)  # the same command: it resumes from that checkpoint by itself
    assert again.wait() == 0, again.text()
    assert f"resuming from {latest}" in again.text()
    metrics = (out / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in metrics[1:]] == [str(s) for s in range(1, steps + 1)]
    trainer = journal(out)[-1]
    assert trainer["process"] == "trainer", trainer
    assert re.fullmatch(
        r"stopped on an error: learner rank [01] of 2 \(pid .*\) died \(.*\)", trainer["cause"]
    )
