"""The algorithm helper against a live store and a real runner."""

from __future__ import annotations

import asyncio
from typing import Any

from lightning_grpc.algorithm import Algorithm
from lightning_grpc.client import StoreClient
from lightning_grpc.runner import Runner, rollout
from lightning_grpc.server.app import RunningServer
from lightning_grpc.tracing import emit_reward
from lightning_grpc.types import PromptTemplate, RolloutStatus, Span


@rollout
def scorer(task: Any, prompt_template: PromptTemplate) -> float | None:
    if task["n"] < 0:
        raise ValueError("negative task")
    if task["n"] == 0:
        emit_reward(0.1)
        emit_reward({"final": 0.5, "style": 0.9}, primary="final")  # the last reward counts
        return None
    return len(prompt_template.format(n=task["n"])) / 100


async def test_a_batch_runs_groups_and_reports_rewards_without_hiding_failures(
    server: RunningServer, client: StoreClient
) -> None:
    target = f"127.0.0.1:{server.port}"
    runner = Runner(scorer, target, concurrency=4, poll_wait=0.2)
    loop_task = asyncio.create_task(runner.run())
    try:
        async with Algorithm(target) as algo:
            rid = await algo.publish({"p": PromptTemplate("n={n}")})
            results = await algo.run_batch(
                [{"n": 7}, {"n": 0}, {"n": -1}], resources_id=rid, group_size=2, mode="train", timeout=30
            )
    finally:
        runner.stop()
        await loop_task
    assert [r.rollout.input["n"] for r in results] == [7, 7, 0, 0, -1, -1]
    assert [r.reward for r in results[:2]] == [0.03, 0.03]
    assert results[2].reward == 0.5 and results[2].rewards == [{"primary": 0.1}, {"final": 0.5, "style": 0.9}]
    assert [r.reward for r in results[4:]] == [None, None]  # failed, not zero
    assert not results[4].succeeded and results[4].rollout.status == RolloutStatus.FAILED
    groups = [r.rollout.group_id for r in results]
    assert groups[0] == groups[1] and groups[2] == groups[3] and len(set(groups)) == 3


async def test_waiting_past_the_timeout_returns_unfinished_rollouts_with_no_reward(
    server: RunningServer,
) -> None:
    async with Algorithm(f"127.0.0.1:{server.port}") as algo:
        results = await algo.run_batch([{"n": 1}], timeout=0.2)  # no runner is running
    assert len(results) == 1 and results[0].reward is None
    assert results[0].rollout.status == RolloutStatus.QUEUING


async def test_a_plain_number_under_lightning_reward_is_the_rollouts_reward(client: StoreClient) -> None:
    """What a user writes first (``attributes={"lightning.reward": 1.0}``) reads back as the reward."""
    rollouts = []
    for i, key in enumerate(("lightning.reward", "agentlightning.reward")):
        ro = await client.start_rollout({"i": i}, worker_id="w")
        span = Span(trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", name="agent", attributes={key: 0.75})
        await client.add_spans([span], rollout_id=ro.rollout_id, attempt_id=ro.latest_attempt.attempt_id)
        await client.complete_attempt(ro.rollout_id, ro.latest_attempt.attempt_id, "succeeded")
        rollouts.append(await client.get_rollout(ro.rollout_id))
    async with Algorithm(client) as algo:
        results = await algo.results(rollouts)
    assert [r.reward for r in results] == [0.75, 0.75]
    assert results[0].rewards == [{"primary": 0.75}]
