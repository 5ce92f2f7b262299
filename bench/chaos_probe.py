"""A longer chaos probe of a real training run, run by hand: kill -9 of the store server, the engine, a runner or
the trainer itself at seeded random moments, each recovery waited for and timed; then the run's Store read back
and its accounting checked (no task skipped or repeated, no rollout counted twice, no retried attempt trained with
an earlier attempt's calls), and the run compared with the same config never interrupted.

    .venv/bin/python bench/chaos_probe.py                                # sync, 30 steps, 12 kills
    .venv/bin/python bench/chaos_probe.py --mode async --steps 20 --kills 6

It appends a markdown report to ``--out`` (bench/results/chaos_probe.md) and prints it. It is the long form of
tests/training/test_chaos.py (which kills each process once, at fixed steps) and is never part of ``make test``.

Two choices worth knowing when reading its figures:

- The trainer is killed only once a step checkpoint exists: without one, running the command again starts the
  run afresh (by design), which clears the store and the interruption journal this probe reads.
- The trainer is killed at most every third kill, and no process is killed once the last step was printed (the
  run is stopping; a dead child then ends nothing that could be recovered).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "lightning_grpc.cli.main"]
#: Keep the run's processes polite on a shared machine (as the tests do).
QUIET_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")},
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
GROUPS, GROUP_SIZE = 6, 4
ASYNC_GROUPS, MAX_STALENESS = 12, 1
STEP_LINE = re.compile(r"^step\s+(\d+)\b", re.MULTILINE)
KINDS = ("server", "engine", "runner", "trainer")
#: The word in a child's command line (an element of its argv) that says what it is.
WORDS = {"server": "serve", "engine": "engine", "runner": "runner"}

CONFIG = """
[experiment]
name = "chaos"
output_dir = "out"
seed = {seed}
steps = {steps}
mode = "{mode}"
{async_lines}
[agent]
agent = "lightning_grpc.examples.combination_lock:agent"
train_tasks = "train.jsonl"
val_tasks = "val.jsonl"
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
every = 5
{target_line}
[checkpoint]
every = 3
keep = 2

[services]
restart_backoff = 0.2
restarts = {restarts}
"""


def say(text: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {text}", flush=True)


# ------------------------------------------------------------ the run and its files
def write_run(folder: Path, model: Path, args: argparse.Namespace) -> Path:
    from lightning_grpc.examples.combination_lock import train_tasks, val_tasks, write_jsonl

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    write_jsonl(train_tasks(), folder / "train.jsonl")
    write_jsonl(val_tasks(), folder / "val.jsonl")
    async_lines = (
        f"async_groups = {ASYNC_GROUPS}\nmax_staleness = {MAX_STALENESS}\n" if args.mode == "async" else ""
    )
    text = CONFIG.format(
        seed=args.seed,
        steps=args.steps,
        mode=args.mode,
        async_lines=async_lines,
        model=model,
        group_size=GROUP_SIZE,
        groups=GROUPS,
        restarts=args.kills + 2,  # every kill could hit the same child
        target_line=f"target = {args.target}\n" if args.target is not None else "",
    )
    path = folder / "config.toml"
    path.write_text(text)
    return path


class Invocation:
    """One ``lightning-grpc train CONFIG --no-progress``, as a terminal starts it: its own session and group."""

    def __init__(self, config: Path, index: int) -> None:
        self.log = config.parent / f"run-{index}.log"
        self.started = time.monotonic()
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
        return self.log.read_text(errors="replace")

    def steps(self) -> list[int]:
        return [int(s) for s in STEP_LINE.findall(self.text())]

    def last_step(self) -> int | None:
        found = self.steps()
        return found[-1] if found else None

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []

    def child(self, kind: str, rng: random.Random) -> psutil.Process | None:
        """One of the trainer's children of that kind (a random one among the runners)."""
        found = []
        for c in self.children():
            try:
                if WORDS[kind] in c.cmdline():
                    found.append(c)
            except psutil.Error:
                continue
        return rng.choice(sorted(found, key=lambda p: p.pid)) if found else None


def journal(out: Path) -> list[dict[str, Any]]:
    path = out / "interruptions.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            rows.append({"process": "?", "unreadable": line})
    return rows


def journal_kind(entry: dict[str, Any]) -> str:
    name = str(entry.get("process", "?"))
    return "runner" if name.startswith("runners") else name


def has_checkpoint(out: Path) -> bool:
    folder = out / "checkpoints"
    return folder.is_dir() and any(
        p.is_dir() and not p.name.endswith(".partial") and (p / "trainer_state.pt").exists()
        for p in folder.glob("step-*")
    )


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


# ------------------------------------------------------------ the chaos
@dataclass
class Kill:
    index: int
    kind: str
    at_s: float  # seconds since the run's first start
    step: int | None  # the last step line printed before the kill
    pid: int
    recovered: bool = False
    seconds: float | None = None  # to recover (children: the journal's recovery_seconds)
    detail: str = ""  # the journal's recovery text (or what went wrong)
    measured_s: float | None = None  # children: from the kill until the journal line appeared


@dataclass
class ChaosResult:
    kills: list[Kill] = field(default_factory=list)
    invocations: list[Invocation] = field(default_factory=list)
    wall_s: float = 0.0
    exit_code: int | None = None
    #: What ended an invocation or a wait (a child not restarted, the run giving up, a hang).
    failures: list[str] = field(default_factory=list)
    #: What went wrong without ending the run (children outliving a killed trainer).
    findings: list[str] = field(default_factory=list)
    #: After a failure, the same command run again by hand (as the run's own message says): what happened.
    by_hand: list[str] = field(default_factory=list)
    resumes_by_hand: int = 0
    stopped_killing: str = ""


def wait_for_new_step(run: Invocation, timeout: float) -> int | None:
    """The first step line of an invocation; None if it ended or printed none within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step = run.last_step()
        if step is not None:
            return step
        if run.proc.poll() is not None:
            return None
        time.sleep(0.1)
    return None


def error_lines(run: Invocation) -> str:
    """The ``error: ...`` lines the run printed (what it said when it gave up)."""
    return " / ".join(line for line in run.text().splitlines() if line.startswith("error:"))


def chaos_run(config: Path, args: argparse.Namespace) -> ChaosResult:
    out = config.parent / "out"
    rng = random.Random(args.seed)
    result = ChaosResult()
    t0 = time.monotonic()
    run = Invocation(config, 0)
    result.invocations.append(run)
    say(f"chaos run started (pid {run.proc.pid}), log {run.log}")
    alive = wait_for_new_step(run, args.recovery_timeout) is not None
    if not alive:
        result.failures.append(f"the run printed no first step:\n{tail(run.text(), 60)}")
    last_trainer_kill = -99
    while True:
        if not alive:  # the run gave up or hangs: as its message says, run the same command again
            if result.resumes_by_hand >= args.resumes_after_failure:
                stop(run)
                break
            run, alive = resume_by_hand(run, config, result, t0, args)
            if not alive or run.proc.poll() is not None:
                continue
        if len(result.kills) >= args.kills:
            break
        gap = rng.uniform(args.gap_min, args.gap_max)
        deadline = time.monotonic() + gap
        while time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.1)
        if run.proc.poll() is not None or error_lines(run):
            if run.proc.wait() != 0:
                alive = False
                result.failures.append(
                    f"the run exited with code {run.proc.returncode} between kills "
                    f"({len(result.kills)} done): {error_lines(run)}:\n{tail(run.text(), 60)}"
                )
                continue
            result.stopped_killing = f"the run finished after {len(result.kills)} of {args.kills} kills"
            break
        step = run.last_step()
        if step is not None and step >= args.steps:
            result.stopped_killing = (
                f"the last step was printed after {len(result.kills)} of {args.kills} kills (no more kills)"
            )
            break
        index = len(result.kills)
        kinds = ["server", "engine", "runner"]
        if index - last_trainer_kill >= 3 and has_checkpoint(out) and (step or 0) < args.steps - 1:
            kinds.append("trainer")
        kind = rng.choice(kinds)
        if kind == "trainer":
            last_trainer_kill = index
            run, alive = kill_trainer(run, config, result, index, t0, args)
        else:
            alive = kill_child(run, out, kind, result, index, t0, rng, args)
    reported = not alive  # that invocation's failure is already in the list
    while True:
        if run.proc.poll() is None:
            say("no more kills: waiting for the run to finish")
            try:
                run.proc.wait(args.finish_timeout)
            except subprocess.TimeoutExpired:
                result.failures.append(
                    f"the run did not finish within {args.finish_timeout:.0f} s:\n{tail(run.text(), 60)}"
                )
                stop(run)
                reported = True
        if run.proc.returncode == 0:
            break
        if not reported:
            result.failures.append(
                f"the run exited with code {run.proc.returncode}: {error_lines(run)}:\n{tail(run.text(), 60)}"
            )
        if result.resumes_by_hand >= args.resumes_after_failure:
            break
        run, ok = resume_by_hand(run, config, result, t0, args)
        reported = not ok
    result.exit_code = run.proc.returncode
    result.wall_s = time.monotonic() - t0
    return result


def resume_by_hand(
    run: Invocation, config: Path, result: ChaosResult, t0: float, args: argparse.Namespace
) -> tuple[Invocation, bool]:
    """After a failure: the invocation stopped (if it still runs), and the same command run again; returns it
    and whether it printed a step (or finished)."""
    stop(run)
    result.resumes_by_hand += 1
    again = Invocation(config, len(result.invocations))
    result.invocations.append(again)
    started = time.monotonic()
    say(f"after a failure: the same command run again by hand ({again.log})")
    first = wait_for_new_step(again, args.recovery_timeout)
    resumed = re.search(r"resuming from (\S+)", again.text())
    how = f"resumed from {Path(resumed.group(1)).name}" if resumed else "NOT resumed (a fresh start)"
    if first is None:
        note = f"printed no step (exit code {again.proc.poll()})"
        if again.proc.poll() != 0:
            result.failures.append(
                f"the same command run again by hand {note}: {error_lines(again)}:\n{tail(again.text(), 60)}"
            )
    else:
        note = f"first step line: step {first}, {time.monotonic() - started:.1f} s after its start"
    result.by_hand.append(f"at {started - t0:.0f} s: the same command again: {how}; {note}")
    say(f"  {result.by_hand[-1]}")
    return again, first is not None or again.proc.poll() == 0


def kill_child(
    run: Invocation,
    out: Path,
    kind: str,
    result: ChaosResult,
    index: int,
    t0: float,
    rng: random.Random,
    args: argparse.Namespace,
) -> bool:
    """Kill one child of that kind and wait for its restart; returns whether the run goes on."""
    process = run.child(kind, rng)
    if process is None:
        result.failures.append(f"kill {index + 1}: no {kind} child of the trainer was found")
        return run.proc.poll() is None
    before = sum(1 for e in journal(out) if journal_kind(e) == kind)
    step = run.last_step()
    killed_at = time.monotonic()
    process.send_signal(signal.SIGKILL)
    try:
        process.wait(10)
    except psutil.TimeoutExpired:
        pass
    kill = Kill(index + 1, kind, killed_at - t0, step, process.pid)
    result.kills.append(kill)
    say(f"kill {index + 1}: {kind} (pid {process.pid}) at step {step}")
    deadline = killed_at + args.recovery_timeout
    while True:
        found = [e for e in journal(out) if journal_kind(e) == kind]
        if len(found) > before:
            entry = found[-1]
            kill.recovered = True
            kill.seconds = float(entry.get("recovery_seconds", math.nan))
            kill.measured_s = time.monotonic() - killed_at
            kill.detail = f"{entry.get('process')}: {entry.get('recovery')}"
            say(f"  recovered: {kill.detail} ({kill.seconds:.1f} s)")
            return True
        if run.proc.poll() is not None:
            code = run.proc.returncode
            if code == 0:
                kill.detail = "the run finished before the restart was journaled"
                say(f"  {kill.detail}")
                return True
            kill.detail = f"the run exited with code {code} before a restart of the {kind} was journaled"
            result.failures.append(
                f"kill {index + 1} ({kind}): {kill.detail}: {error_lines(run)}:\n{tail(run.text(), 60)}"
            )
            say(f"  FAILED: {kill.detail}")
            return False
        if time.monotonic() > deadline:
            kill.detail = f"no restart of the {kind} journaled within {args.recovery_timeout:.0f} s"
            result.failures.append(f"kill {index + 1} ({kind}): {kill.detail}:\n{tail(run.text(), 60)}")
            say(f"  FAILED: {kill.detail}")
            return False
        time.sleep(0.1)


def kill_trainer(
    run: Invocation, config: Path, result: ChaosResult, index: int, t0: float, args: argparse.Namespace
) -> tuple[Invocation, bool]:
    """Kill -9 the trainer, wait for its children to go, run the same command again; returns the new
    invocation and whether it goes on."""
    step = run.last_step()
    children = run.children()
    killed_at = time.monotonic()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    kill = Kill(index + 1, "trainer", killed_at - t0, step, run.proc.pid)
    result.kills.append(kill)
    say(f"kill {index + 1}: trainer (pid {run.proc.pid}) at step {step}")
    _, alive = psutil.wait_procs(children, timeout=args.children_timeout)
    if alive:
        names = []
        for p in alive:
            try:
                names.append(" ".join(p.cmdline()[2:5]))
            except psutil.Error:
                names.append(str(p.pid))
        result.findings.append(
            f"kill {index + 1} (trainer): {len(alive)} children still alive {args.children_timeout:.0f} s "
            f"after the trainer died: {names} (killed by the probe to go on)"
        )
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)
    again = Invocation(config, len(result.invocations))
    result.invocations.append(again)
    first = wait_for_new_step(again, args.recovery_timeout)
    if first is None:
        code = again.proc.poll()
        if code == 0:
            kill.detail = "the resumed run finished without printing a step"
            return again, True
        kill.detail = f"the resumed run printed no step (exit code {code})"
        result.failures.append(
            f"kill {index + 1} (trainer): {kill.detail}: {error_lines(again)}:\n{tail(again.text(), 60)}"
        )
        return again, False
    kill.recovered = True
    kill.seconds = time.monotonic() - killed_at
    resumed = re.search(r"resuming from (\S+)", again.text())
    entries = [e for e in journal(config.parent / "out") if e.get("process") == "trainer"]
    kill.detail = (
        f"{'resumed from ' + Path(resumed.group(1)).name if resumed else 'NOT resumed (fresh start)'}; "
        f"first step line: step {first}"
        + (
            f"; journal: {entries[-1].get('recovery')} ({entries[-1].get('recovery_seconds')} s)"
            if entries
            else ""
        )
    )
    say(f"  recovered: {kill.detail} ({kill.seconds:.1f} s)")
    return again, True


def stop(run: Invocation) -> None:
    if run.proc.poll() is None:
        os.killpg(run.proc.pid, signal.SIGINT)
        try:
            run.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()


def reference_run(config: Path) -> tuple[int, float, str]:
    t0 = time.monotonic()
    done = subprocess.run(
        [*CLI, "train", str(config), "--no-progress"],
        cwd=ROOT,
        env=QUIET_ENV,
        capture_output=True,
        text=True,
    )
    (config.parent / "run-0.log").write_text(done.stdout + done.stderr)
    return done.returncode, time.monotonic() - t0, done.stdout + done.stderr


# ------------------------------------------------------------ the store read back
async def read_store(db: Path) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The training rollouts of a run's store file, by group id; and for each retried rollout, its attempts,
    its triplet report and the span ids of its earlier attempts."""
    from lightning_grpc.client import ClientConfig, StoreClient, TrainerClient
    from lightning_grpc.processes import Background, log_field
    from lightning_grpc.types import RolloutMode

    copy = db.parent / "probe-copy" / db.name  # read a copy: the run's own file stays as the run left it
    copy.parent.mkdir(exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        if db.with_name(db.name + suffix).exists():
            shutil.copy2(db.with_name(db.name + suffix), copy.with_name(copy.name + suffix))
    server = Background(
        "server", [*CLI[1:], "serve", "--db", str(copy), "--port", "0", "--no-dashboard"], QUIET_ENV
    )
    try:
        address = log_field(server.wait_for("event=server_started", timeout=60)[0], "address")
        config = ClientConfig(target=address, timeout=120)
        async with StoreClient(config) as store, TrainerClient(config) as trainer:
            groups: dict[str, list[Any]] = defaultdict(list)
            token = ""
            while True:
                page = await store.list_rollouts(mode=RolloutMode.TRAIN, page_size=500, page_token=token)
                for rollout in page.items:
                    groups[rollout.group_id].append(rollout)
                token = page.next_page_token
                if not token:
                    break
            retried: dict[str, Any] = {}
            for members in groups.values():
                for rollout in members:
                    attempts = (await store.list_attempts(rollout.rollout_id)).items
                    if len(attempts) > 1:
                        report = await trainer.triplets(rollout.rollout_id)
                        earlier = [
                            s.span_id
                            for a in attempts[:-1]
                            for s in await store.query_spans(rollout.rollout_id, a.attempt_id)
                        ]
                        retried[rollout.rollout_id] = (attempts, report, earlier)
            return dict(groups), retried
    finally:
        server.stop(10)


def accounting(
    groups: dict[str, list[Any]],
    retried: dict[str, Any],
    reference: dict[str, list[Any]] | None,
    args: argparse.Namespace,
    last_step: int | None = None,
) -> dict[str, Any]:
    """The chaos run's store read back against the plan. ``last_step``: the run's last step (fewer than
    ``--steps`` when it stopped at ``--target``)."""
    from lightning_grpc.batching.groups import BATCH_KEY
    from lightning_grpc.examples.combination_lock import train_tasks
    from lightning_grpc.training.plan import PLAN_EPOCH_KEY, PLAN_POSITION_KEY, PLAN_TASK_KEY

    notes: list[str] = []
    sync = args.mode == "sync"
    last_step = args.steps if last_step is None else last_step
    # -- the plan: positions and tasks
    positions: Counter[int] = Counter()
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for gid, members in groups.items():
        metas = {(m.metadata.get(PLAN_POSITION_KEY), m.metadata.get(PLAN_TASK_KEY)) for m in members}
        if len(metas) > 1:
            notes.append(f"group {gid}: its rollouts carry different plan positions {sorted(metas, key=str)}")
        meta = members[0].metadata
        if PLAN_POSITION_KEY not in meta:
            notes.append(f"group {gid}: no plan position")
            continue
        positions[int(meta[PLAN_POSITION_KEY])] += 1
        by_epoch[int(meta[PLAN_EPOCH_KEY])].append(int(meta[PLAN_TASK_KEY]))
    drawn_upto = max(last_step * GROUPS, max(positions, default=-1) + 1)
    skipped = [p for p in range(drawn_upto) if p not in positions]
    repeated_positions = {p: n for p, n in positions.items() if n > 1}
    repeated_in_epoch = {
        e: sorted(t for t, n in Counter(drawn).items() if n > 1)
        for e, drawn in by_epoch.items()
        if len(set(drawn)) != len(drawn)
    }
    tasks = len(train_tasks())
    incomplete_epochs = [
        e
        for e, drawn in by_epoch.items()
        if e < max(by_epoch, default=0) and sorted(drawn) != list(range(tasks))
    ]
    plan_matches = None
    if reference is not None:
        ours = {g: (m[0].input, m[0].metadata.get(PLAN_POSITION_KEY)) for g, m in groups.items()}
        theirs = {g: (m[0].input, m[0].metadata.get(PLAN_POSITION_KEY)) for g, m in reference.items()}
        if args.target is not None:  # the runs stop where each reached the target: compare what both drew
            both = set(ours) & set(theirs)
            ours = {g: v for g, v in ours.items() if g in both}
            theirs = {g: v for g, v in theirs.items() if g in both}
        plan_matches = ours == theirs
        if not plan_matches:
            only = sorted(set(ours) ^ set(theirs))
            differ = sorted(g for g in set(ours) & set(theirs) if ours[g] != theirs[g])
            notes.append(
                f"plan differs from the uninterrupted run's: groups in one run only {only[:10]}, "
                f"groups with another task or position {differ[:10]}"
            )
    # -- batches: each group whole in one batch; each batch the groups of one step (sync), batch_size of them
    mixed_groups = []
    mixed_rollouts = 0
    batch_groups: dict[str, list[str]] = defaultdict(list)
    untrained: list[str] = []
    sizes_wrong = []
    for gid, members in groups.items():
        ids = {m.metadata.get(BATCH_KEY) for m in members}
        if len(members) != GROUP_SIZE:
            sizes_wrong.append(f"{gid}: {len(members)} rollouts")
        if len(ids) > 1:
            mixed_groups.append(f"{gid}: {sorted(map(str, ids))}")
            mixed_rollouts += len(members)
            continue
        (bid,) = ids
        if bid is None:
            untrained.append(gid)
        else:
            batch_groups[str(bid)].append(gid)
    wrong_step_rollouts = 0
    wrong_step = []
    if sync:
        for bid, gids in batch_groups.items():
            step = bid.rsplit("-b", 1)[-1]
            for gid in gids:
                if gid.split("-s", 1)[1].split("-", 1)[0] != step:
                    wrong_step.append(f"{gid} in {bid}")
                    wrong_step_rollouts += len(groups[gid])
    expected_batches = {f"chaos-b{s}" for s in range(1, last_step + 1)}
    over = {b: len(g) for b, g in batch_groups.items() if len(g) > GROUPS}
    short = {b: len(g) for b, g in batch_groups.items() if len(g) < GROUPS}
    missing_batches = sorted(expected_batches - set(batch_groups), key=lambda b: int(b.rsplit("b", 1)[1]))
    extra_batches = sorted(set(batch_groups) - expected_batches)
    over_rollouts = sum((n - GROUPS) * GROUP_SIZE for n in over.values())
    # in sync mode every group of the plan is trained; in async the last in-flight groups are not
    expected_untrained = 0 if sync else ASYNC_GROUPS - GROUPS
    lost_groups = len(untrained) - expected_untrained
    # -- retried attempts: what trains is the last attempt's calls alone
    mixed_attempts = []
    empty_reports = []
    for rid, (attempts, report, earlier) in retried.items():
        if report.attempt_id != attempts[-1].attempt_id:
            mixed_attempts.append(
                f"{rid}: report of attempt {report.attempt_id}, last {attempts[-1].attempt_id}"
            )
        elif {t.span_id for t in report.triplets} & set(earlier):
            mixed_attempts.append(f"{rid}: triplets include spans of an earlier attempt")
        if not report.triplets:
            empty_reports.append(rid)
    return {
        "last_step": last_step,
        "groups": len(groups),
        "rollouts": sum(len(m) for m in groups.values()),
        "skipped": skipped,
        "repeated_positions": repeated_positions,
        "repeated_in_epoch": repeated_in_epoch,
        "incomplete_epochs": incomplete_epochs,
        "plan_matches": plan_matches,
        "mixed_groups": mixed_groups,
        "mixed_rollouts": mixed_rollouts,
        "wrong_step": wrong_step,
        "wrong_step_rollouts": wrong_step_rollouts,
        "over": over,
        "over_rollouts": over_rollouts,
        "short": short,
        "missing_batches": missing_batches,
        "extra_batches": extra_batches,
        "untrained": untrained,
        "expected_untrained": expected_untrained,
        "lost_groups": lost_groups,
        "sizes_wrong": sizes_wrong,
        "retried": len(retried),
        "retried_attempts": sum(len(a) - 1 for a, _, _ in retried.values()),
        "mixed_attempts": mixed_attempts,
        "empty_reports": empty_reports,
        "double_counted": mixed_rollouts + wrong_step_rollouts + over_rollouts,
        "tasks_repeated": sum(n - 1 for n in repeated_positions.values())
        + sum(len(v) for v in repeated_in_epoch.values()),
        "notes": notes,
    }


# ------------------------------------------------------------ metrics and weights
def metrics_rows(out: Path) -> list[dict[str, str]]:
    path = out / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def final_rewards(out: Path) -> dict[str, Any]:
    rows = metrics_rows(out)
    vals = [float(r["val_reward"]) for r in rows if r.get("val_reward")]
    curve = [(int(float(r["step"])), float(r["val_reward"])) for r in rows if r.get("val_reward")]
    train = [float(r["reward_mean"]) for r in rows if r.get("reward_mean")]
    steps = [int(float(r["step"])) for r in rows if r.get("step")]
    return {
        "val_reward": vals[-1] if vals else None,
        "reward_mean_last5": sum(train[-5:]) / len(train[-5:]) if train else None,
        "steps": steps,
        "val_curve": curve,
    }


def every_step_once(steps: list[int], args: argparse.Namespace) -> bool:
    """Whether metrics.csv has each step once, 1..--steps (1..its last step when the run stops at a target)."""
    last = max(steps, default=0) if args.target is not None else args.steps
    return steps == list(range(1, last + 1))


def reached(rewards: dict[str, Any], target: float) -> str:
    """The first step whose validation reward reached ``target`` ("not reached" else)."""
    hit = next((step for step, val in rewards["val_curve"] if val >= target), None)
    return "not reached" if hit is None else str(hit)


def compare_weights(a: Path, b: Path) -> tuple[bool | None, str]:
    from safetensors.torch import load_file

    fa, fb = a / "final" / "model.safetensors", b / "final" / "model.safetensors"
    if not fa.exists() or not fb.exists():
        return None, f"missing: {[str(p) for p in (fa, fb) if not p.exists()]}"
    wa, wb = load_file(str(fa)), load_file(str(fb))
    if wa.keys() != wb.keys():
        return False, "different tensor names"
    differ = [n for n in wa if not wa[n].equal(wb[n])]
    if not differ:
        return True, f"{len(wa)} tensors equal"
    worst = max(float((wa[n].float() - wb[n].float()).abs().max()) for n in differ)
    return False, f"{len(differ)} of {len(wa)} tensors differ (max abs difference {worst:.3g})"


# ------------------------------------------------------------ the report
def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = psutil.virtual_memory().total / 2**30
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} CPU cores (shared), {mem:.1f} GiB; load average at start {load}"


def report(
    args: argparse.Namespace,
    command: str,
    host: str,
    chaos: ChaosResult,
    acc: dict[str, Any] | None,
    ref: dict[str, Any],
    rewards: dict[str, Any],
    calm_rewards: dict[str, Any],
    bitexact: tuple[bool | None, str],
) -> str:
    lines = [
        f"## {args.mode} mode, {args.steps} steps, {args.kills} kills "
        f"({datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {host}  ",
        f"Config: combination lock, {args.mode}, group_size {GROUP_SIZE}, batch_size {GROUPS}"
        + (f", async_groups {ASYNC_GROUPS}, max_staleness {MAX_STALENESS}" if args.mode == "async" else "")
        + ", checkpoint.every 3, agent.unresponsive_timeout 3, services.restart_backoff 0.2, "
        f"services.restarts {args.kills + 2}, validation every 5 (8 val locks)"
        + (
            f", validation.target {args.target:g} (a run stops once it reaches it)"
            if args.target is not None
            else ""
        )
        + f", seed {args.seed}; "
        f"a kill every {args.gap_min:g}-{args.gap_max:g} s after the previous recovery.  ",
        f"Work directory: `{args.workdir}`",
        "",
        f"Wall time: chaos run {chaos.wall_s:.0f} s over {len(chaos.invocations)} invocation(s) "
        f"(exit code {chaos.exit_code}); uninterrupted run {ref['wall_s']:.0f} s (exit code {ref['code']}).",
    ]
    if chaos.stopped_killing:
        lines.append(f"Kills stopped early: {chaos.stopped_killing}.")
    lines += [
        "",
        "### Kills by process",
        "",
        "| process | kills | recovered | mean s to recover | max s |",
        "|---|---|---|---|---|",
    ]
    for kind in KINDS:
        ks = [k for k in chaos.kills if k.kind == kind]
        secs = [k.seconds for k in ks if k.recovered and k.seconds is not None]
        lines.append(
            f"| {kind} | {len(ks)} | {sum(k.recovered for k in ks)} | "
            f"{fmt(sum(secs) / len(secs) if secs else None, 1)} | {fmt(max(secs) if secs else None, 1)} |"
        )
    lines += [
        "",
        "Children: seconds from the death to the restart, as the run's journal (`interruptions.jsonl`) records "
        "it; trainer: seconds from the kill to the first step line of the same command run again (its start, "
        "validation at the resumed step and the redone steps included).",
        "",
        "| # | process | at s | step | recovered | s | how |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in chaos.kills:
        lines.append(
            f"| {k.index} | {k.kind} | {k.at_s:.0f} | {k.step if k.step is not None else '-'} | "
            f"{'yes' if k.recovered else 'NO'} | {fmt(k.seconds, 1)} | {k.detail} |"
        )
    lines += ["", "### Accounting (goal 0 / 0 / 0 / 0)", ""]
    if acc is None:
        lines.append("Not read: the store could not be read back (see failures).")
    else:
        lines += [
            "| check | count | goal |",
            "|---|---|---|",
            f"| tasks skipped (plan positions missing among 0..{max(acc['last_step'] * GROUPS, 1) - 1} and up to "
            f"the last drawn) | {len(acc['skipped'])} | 0 |",
            f"| tasks repeated (a position in two groups, a task twice in one epoch) | {acc['tasks_repeated']} | 0 |",
            f"| rollouts double-counted (groups with mixed batch ids, in another step's batch, batches over "
            f"{GROUPS} groups) | {acc['double_counted']} | 0 |",
            f"| retried attempts whose triplets include an earlier attempt's spans | {len(acc['mixed_attempts'])} | 0 |",
            "",
            f"Read back: {acc['groups']} training groups, {acc['rollouts']} rollouts; {acc['retried']} rollouts "
            f"retried ({acc['retried_attempts']} extra attempts), {len(acc['empty_reports'])} of them with no "
            f"triplets in their last attempt.  ",
            f"Batches: {acc['last_step'] - len(acc['missing_batches'])} of {acc['last_step']} present; missing "
            f"{acc['missing_batches'] or 'none'}; unexpected ids {acc['extra_batches'] or 'none'}; over "
            f"{GROUPS} groups {acc['over'] or 'none'}; short {acc['short'] or 'none'}.  ",
            f"Groups never taken by a batch: {len(acc['untrained'])} (expected {acc['expected_untrained']}"
            f"{', the groups still in flight at the end' if acc['expected_untrained'] else ''}).  ",
            f"Groups without {GROUP_SIZE} rollouts: {acc['sizes_wrong'] or 'none'}.  ",
            f"Epochs not covering every task once (before the last): {acc['incomplete_epochs'] or 'none'}.  ",
            "Task plan (group id, task, position) identical to the uninterrupted run's: "
            + {True: "yes", False: "NO", None: "-"}[acc["plan_matches"]]
            + ".",
        ]
        for name in ("skipped", "mixed_groups", "wrong_step", "mixed_attempts", "notes"):
            if acc[name]:
                lines.append(f"- {name}: {acc[name][:20]}")
        if acc["repeated_positions"] or acc["repeated_in_epoch"]:
            lines.append(
                f"- repeated: positions {acc['repeated_positions']}, tasks twice in an epoch "
                f"{acc['repeated_in_epoch']}"
            )
    chaos_steps, calm_steps = rewards["steps"], calm_rewards["steps"]
    lines += [
        "",
        "### Final rewards",
        "",
        "| | chaos run | uninterrupted |",
        "|---|---|---|",
        f"| final val_reward (last in metrics.csv) | {fmt(rewards['val_reward'])} | {fmt(calm_rewards['val_reward'])} |",
        f"| reward_mean, mean of the last 5 steps | {fmt(rewards['reward_mean_last5'])} | "
        f"{fmt(calm_rewards['reward_mean_last5'])} |",
        *(
            [
                f"| validation target {args.target:g} reached at step | {reached(rewards, args.target)} | "
                f"{reached(calm_rewards, args.target)} |"
            ]
            if args.target is not None
            else []
        ),
        f"| metrics.csv rows: each step 1..{'the last' if args.target is not None else args.steps} once | "
        f"{'yes' if every_step_once(chaos_steps, args) else 'NO: ' + str(chaos_steps)} | "
        f"{'yes' if every_step_once(calm_steps, args) else 'NO: ' + str(calm_steps)} |",
        f"| wall time (s) | {chaos.wall_s:.0f} | {ref['wall_s']:.0f} |",
        "",
    ]
    if args.mode == "sync":
        verdict = {True: "yes", False: "NO", None: "not compared"}[bitexact[0]]
        lines.append(
            f"Final weights bit-identical to the uninterrupted run's: **{verdict}** ({bitexact[1]})."
        )
    else:
        lines.append(
            f"Final weights (async: not expected to be bit-identical, the batches' make-up depends on timing): "
            f"{bitexact[1]}."
        )
    if chaos.findings:
        lines += ["", "### Findings (the run went on)", ""] + [f"- {f}" for f in chaos.findings]
    if chaos.failures or ref["code"] != 0:
        lines += ["", "### Failures", ""]
        if chaos.by_hand:
            lines += [
                "After each failure the probe ran the same command again, as the run's own message says "
                f"(at most {args.resumes_after_failure} times), and went on killing:",
                "",
                *[f"- {b}" for b in chaos.by_hand],
                "",
                "What failed:",
                "",
            ]
        for failure in chaos.failures:
            head, _, rest = failure.partition("\n")
            lines += [f"- {head}"] + (["", "```", rest, "```", ""] if rest else [])
        if ref["code"] != 0:
            lines += [
                f"- the uninterrupted run exited with code {ref['code']}",
                "",
                "```",
                tail(ref["text"]),
                "```",
            ]
    entries = journal(args.workdir / "chaos" / "out")
    lines += ["", f"<details><summary>interruptions.jsonl ({len(entries)} lines)</summary>", "", "```"]
    lines += [json.dumps(e) for e in entries]
    lines += ["```", "", "</details>", ""]
    return "\n".join(lines)


# ------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kills", type=int, default=12)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--seed", type=int, default=0, help="the kills' random moments and choices, and the run's")
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="validation.target of both runs (each stops once it reaches it; --steps is then their limit)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos_probe.md")
    p.add_argument("--workdir", type=Path, default=None, help="default: /tmp/chaos_probe-<mode>")
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: a tiny one made here)")
    p.add_argument(
        "--gap-min", type=float, default=5.0, help="seconds from a recovery to the next kill, at least"
    )
    p.add_argument("--gap-max", type=float, default=15.0, help="... at most")
    p.add_argument("--recovery-timeout", type=float, default=180.0)
    p.add_argument("--children-timeout", type=float, default=30.0)
    p.add_argument("--finish-timeout", type=float, default=900.0)
    p.add_argument(
        "--resumes-after-failure",
        type=int,
        default=2,
        help="after a failure (the run gave up or hangs), run the same command again this often and go on",
    )
    args = p.parse_args(argv)
    args.workdir = (args.workdir or Path(f"/tmp/chaos_probe-{args.mode}")).resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(["python bench/chaos_probe.py", *(sys.argv[1:] if argv is None else argv)])
    host = machine()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        model = args.workdir / "model"
        if not (model / "model.safetensors").exists():
            say(f"making the tiny model in {model}")
            subprocess.run(
                [*CLI, "init-model", str(model)], cwd=ROOT, env=QUIET_ENV, check=True, capture_output=True
            )
    config = write_run(args.workdir / "chaos", model.resolve(), args)
    chaos = chaos_run(config, args)
    say(
        f"chaos run done in {chaos.wall_s:.0f} s, exit code {chaos.exit_code}, {len(chaos.failures)} failure(s)"
    )

    calm_config = write_run(args.workdir / "reference", model.resolve(), args)
    say("uninterrupted run started")
    code, wall, text = reference_run(calm_config)
    ref = {"code": code, "wall_s": wall, "text": text}
    say(f"uninterrupted run done in {wall:.0f} s, exit code {code}")

    acc = None
    out, calm_out = config.parent / "out", calm_config.parent / "out"
    try:
        groups, retried = asyncio.run(read_store(out / "store.db"))
        calm_groups = asyncio.run(read_store(calm_out / "store.db"))[0] if code == 0 else None
        acc = accounting(groups, retried, calm_groups, args, max(final_rewards(out)["steps"], default=None))
    except Exception as exc:  # report it: the probe's point is to say what happened
        chaos.failures.append(f"reading the store back failed: {type(exc).__name__}: {exc}")
    bitexact = compare_weights(out, calm_out)
    text = report(args, command, host, chaos, acc, ref, final_rewards(out), final_rewards(calm_out), bitexact)
    print(text, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        if f.tell() == 0:
            f.write(
                "# Chaos probe\n\nA real `lightning-grpc train` run (CPU, tiny model, combination lock) killed -9 "
                "at seeded random moments: store server, engine, a runner or the trainer itself; then its store "
                "read back and its accounting checked, and the run compared with the same config never "
                "interrupted. Made by `bench/chaos_probe.py`; each section is one invocation.\n\n"
            )
        f.write(text + "\n")
    say(f"report appended to {args.out}")
    if acc is None or chaos.failures or code != 0:
        return 1
    ok = not (acc["skipped"] or acc["tasks_repeated"] or acc["double_counted"] or acc["mixed_attempts"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
