"""The prompt-search example (`python -m lightning_grpc.examples.prompt_search_demo`): it runs end to end and picks the candidate the scoring favours.

Also the demo's pieces on an in-process store: the agent's trace (the score operation and the
reward), and a search where some rollouts fail (reported apart, never averaged in as 0).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from statistics import fmean

import pytest

from lightning_grpc import semconv
from lightning_grpc.algorithm import Algorithm
from lightning_grpc.client import StoreClient
from lightning_grpc.examples import prompt_search_demo as demo
from lightning_grpc.runner import Runner
from lightning_grpc.server.app import RunningServer
from lightning_grpc.types import PromptTemplate, RolloutStatus
from tests.conftest import ROOT

ROLLOUTS = len(demo.CANDIDATES) * len(demo.TASKS)


def expected_score(candidate: str, task_id: str) -> float:
    """The reward of one trial, computed here without any store or runner."""
    (task,) = [t for t in demo.TASKS if t["task_id"] == task_id]
    return float(demo.score(PromptTemplate(demo.CANDIDATES[candidate]).format(**task), task))


def favoured_candidate() -> str:
    """The best mean score over the tasks, computed here without any store or runner."""
    means = {name: fmean(expected_score(name, t["task_id"]) for t in demo.TASKS) for name in demo.CANDIDATES}
    ranked = sorted(means.values(), reverse=True)
    assert ranked[0] > ranked[1], "the scoring must single out one candidate"
    return max(means, key=lambda name: means[name])


@pytest.fixture(scope="module")
def demo_run() -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "lightning_grpc.examples.prompt_search_demo"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    return done, time.monotonic() - started


def lines(output: str, who: str) -> list[str]:
    """The text of the lines one part of the demo printed."""
    return [line[9:] for line in output.splitlines() if line.startswith(f"{who:<8} ")]


def test_demo_exits_cleanly_in_under_a_minute(
    demo_run: tuple[subprocess.CompletedProcess[str], float],
) -> None:
    done, elapsed = demo_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert elapsed < 60
    assert f"{ROLLOUTS}/{ROLLOUTS} rollouts rewarded" in done.stdout
    assert not lines(done.stdout, "failed")
    runners = lines(done.stdout, "runners")
    assert runners[0].startswith("2 processes x 8 rollouts at once: " + demo.AGENT_REF)
    stopped = re.fullmatch(r"stopped \(exit 0\); rollouts run per process: (\d+), (\d+)", runners[-1])
    assert stopped is not None, runners
    assert int(stopped.group(1)) + int(stopped.group(2)) == ROLLOUTS
    assert lines(done.stdout, "store")[-1] == "stopped (exit 0)"
    assert lines(done.stdout, "done")


def test_demo_finds_the_favoured_prompt(demo_run: tuple[subprocess.CompletedProcess[str], float]) -> None:
    done, _ = demo_run
    winner = re.search(r"^winner\s+(\S+) \(mean reward (\d\.\d+) over 5 tasks\)$", done.stdout, re.MULTILINE)
    assert winner is not None, done.stdout
    assert winner.group(1) == favoured_candidate()
    mean = fmean(expected_score(winner.group(1), t["task_id"]) for t in demo.TASKS)
    assert winner.group(2) == f"{mean:.3f}"
    assert f"template: {demo.CANDIDATES[winner.group(1)]!r}" in done.stdout
    table = lines(done.stdout, "search")
    start = table.index(f"{'candidate':<18} {'mean':>6}  rewarded")
    assert [row.split()[0] for row in table[start + 1 :]] == sorted(
        demo.CANDIDATES, key=lambda name: -fmean(expected_score(name, t["task_id"]) for t in demo.TASKS)
    )


def test_demo_prints_the_winners_trace_with_the_score_operation_and_the_reward(
    demo_run: tuple[subprocess.CompletedProcess[str], float],
) -> None:
    done, _ = demo_run
    winner = favoured_candidate()
    header, *spans = lines(done.stdout, "trace")
    found = re.fullmatch(r"ro-\S+ \((\S+), task (\S+)\), latest attempt, 3 spans:", header)
    assert found is not None, header
    assert found.group(1) == winner
    reward = expected_score(winner, found.group(2))
    assert reward == max(expected_score(winner, t["task_id"]) for t in demo.TASKS)  # its best rollout
    assert spans == [  # one trace: the attempt's root span, and the agent's spans under it
        f"  {semconv.SPAN_ROLLOUT}",
        f"    {semconv.SPAN_OPERATION} name=score output={reward}",
        f"    {semconv.SPAN_REWARD} primary={reward}",
    ]


@pytest.mark.parametrize("backend", ["memory"])
async def test_the_agent_traces_its_score_as_an_operation_and_returns_the_reward(
    server: RunningServer, client: StoreClient
) -> None:
    task = demo.TASKS[0]
    template = PromptTemplate(demo.CANDIDATES["grounded"])
    runner = Runner(demo.agent, f"127.0.0.1:{server.port}")
    try:
        outcome = await runner.step(task, resources={"candidate": template}, mode="val")
    finally:
        await runner.close()
    prompt = template.format(**task)
    expected = demo.score(prompt, task)
    assert outcome.error is None and outcome.result == expected
    assert outcome.rollout.status == RolloutStatus.SUCCEEDED
    spans = await client.query_spans(outcome.rollout.rollout_id, "latest")
    assert [s.name for s in spans] == [semconv.SPAN_OPERATION, semconv.SPAN_REWARD, semconv.SPAN_ROLLOUT]
    op, reward, root = spans
    assert op.parent_span_id == reward.parent_span_id == root.span_id and not root.parent_span_id
    assert op.attributes[semconv.OPERATION_NAME] == "score"
    assert op.attributes[f"{semconv.OPERATION_INPUT}.prompt"] == prompt
    assert op.attributes[f"{semconv.OPERATION_INPUT}.task.task_id"] == task["task_id"]
    assert op.attributes[semconv.OPERATION_OUTPUT] == expected
    assert semconv.read_primary_reward(reward.attributes) == expected


@pytest.mark.parametrize("backend", ["memory"])
async def test_the_search_reports_rollouts_without_a_reward_apart_and_never_as_zero(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"127.0.0.1:{server.port}"
    no_context = {"task_id": "no-context", "question": "Do you ship to Finland?", "keywords": ["finland"]}
    tasks = [*demo.TASKS[:2], no_context]
    candidates = {
        "broken": "{question} {missing}",  # renders for no task: every rollout fails
        "grounded": demo.CANDIDATES["grounded"],  # needs {context}: fails on the last task
        "bare": "{question}",
    }
    runner = Runner(demo.agent, target, concurrency=4, poll_wait=0.2)
    loop = asyncio.create_task(runner.run())
    try:
        async with Algorithm(target) as algo:
            found = await demo.search(algo, candidates, tasks, timeout=30)
    finally:
        runner.stop()
        await loop
    broken, grounded, bare = found.candidates
    assert broken.mean is None and broken.rewards == [] and len(broken.failures) == 3
    assert {r.rollout.status for r in broken.failures} == {RolloutStatus.FAILED}
    assert all("KeyError" in r.rollout.status_message for r in broken.failures)
    (failure,) = grounded.failures
    assert failure.rollout.input["task_id"] == "no-context"
    expected = [demo.score(PromptTemplate(candidates["grounded"]).format(**t), t) for t in tasks[:2]]
    assert grounded.rewards == expected and grounded.mean == fmean(expected)  # over 2 tasks, not 3
    assert len(bare.rewards) == 3 and not bare.failures
    assert not found.complete and found.rewarded == 5 and found.rollouts == 9
    assert found.best is grounded

    demo.print_report(found)
    out = capsys.readouterr().out
    assert re.search(r"^search\s+broken\s+n/a  0/3 \(3 failed\)$", out, re.MULTILINE), out
    assert re.search(rf"^search\s+grounded\s+{fmean(expected):.3f}  2/3 \(1 failed\)$", out, re.MULTILINE)
    assert len(re.findall(r"^failed\s+ro-\S+ broken/\S+ failed: KeyError", out, re.MULTILINE)) == 3
    assert re.search(r"^failed\s+ro-\S+ grounded/no-context failed: KeyError", out, re.MULTILINE)
    assert re.search(r"^winner\s+grounded \(mean reward \d\.\d+ over 2 tasks\)$", out, re.MULTILINE)
