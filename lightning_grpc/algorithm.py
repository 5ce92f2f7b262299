"""A small helper for code that drives the Store: publish resources, run batches, read rewards.

    async with Algorithm("127.0.0.1:4747") as algo:
        rid = await algo.publish({"prompt": PromptTemplate("Q: {question}")})
        results = await algo.run_batch([{"question": "2+2"}], resources_id=rid, timeout=60)
        print([r.reward for r in results])

A failed or cancelled rollout has ``reward`` None, never a silent 0.0.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_grpc import semconv
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.types import (
    Resource,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutSpec,
    RolloutStatus,
    Span,
)


@dataclass
class RolloutResult:
    rollout: Rollout
    #: The primary value of the last reward the latest attempt recorded; None when there is none
    #: (including every rollout that did not succeed).
    reward: float | None
    #: Every reward of the latest attempt, in order, with all its dimensions.
    rewards: list[dict[str, float]]

    @property
    def succeeded(self) -> bool:
        return self.rollout.status == RolloutStatus.SUCCEEDED


def rewards_of(spans: Sequence[Span]) -> list[dict[str, float]]:
    """The rewards recorded in a list of spans (in sequence order)."""
    return [dims for s in spans if (dims := semconv.read_reward(s.attributes))]


def final_reward(spans: Sequence[Span]) -> float | None:
    """The primary value of the last reward in the spans, or None."""
    for s in reversed(spans):
        value = semconv.read_primary_reward(s.attributes)
        if value is not None:
            return value
    return None


class Algorithm:
    """Drives the Store from an algorithm's side (async; create it inside the loop that uses it)."""

    def __init__(self, store: str | ClientConfig | StoreClient = "127.0.0.1:4747", **options: Any) -> None:
        self.client = store if isinstance(store, StoreClient) else StoreClient(store, **options)
        self._owns_client = not isinstance(store, StoreClient)

    async def __aenter__(self) -> Algorithm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._owns_client:
            await self.client.close()

    async def publish(self, resources: Mapping[str, Resource]) -> str:
        """A new resources set; returns its id (it also becomes the latest)."""
        return (await self.client.add_resources(resources)).resources_id

    async def enqueue(
        self,
        inputs: Sequence[Any],
        *,
        resources_id: str = "",
        mode: RolloutMode | str | None = None,
        group_size: int = 1,
        config: RolloutConfig | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> list[Rollout]:
        """Queue ``group_size`` rollouts per input; siblings of one input share a group id (GRPO)."""
        specs = []
        batch = uuid.uuid4().hex[:10]
        for i, task in enumerate(inputs):
            group = f"g-{batch}-{i}" if group_size > 1 else ""
            for _ in range(group_size):
                specs.append(
                    RolloutSpec(
                        input=task,
                        resources_id=resources_id,
                        mode=_mode(mode),
                        group_id=group,
                        config=config or RolloutConfig(),
                        metadata=dict(metadata or {}),
                    )
                )
        out: list[Rollout] = []
        for start in range(0, len(specs), 1000):
            out += await self.client.enqueue_rollouts(specs[start : start + 1000])
        return out

    async def results(self, rollouts: Sequence[Rollout]) -> list[RolloutResult]:
        """Rewards of finished rollouts, read from the spans of their latest attempts."""
        limit = asyncio.Semaphore(16)

        async def result(r: Rollout) -> RolloutResult:
            if r.status != RolloutStatus.SUCCEEDED:
                return RolloutResult(r, None, [])
            async with limit:
                spans = await self.client.query_spans(r.rollout_id, "latest")
            return RolloutResult(r, final_reward(spans), rewards_of(spans))

        return list(await asyncio.gather(*(result(r) for r in rollouts)))

    async def wait(self, rollouts: Sequence[Rollout], timeout: float | None = None) -> list[RolloutResult]:
        """Wait for the rollouts (no polling) and return their results, in the order given.

        Rollouts still unfinished when ``timeout`` passes are returned as they are, with reward None.
        """
        ids = [r.rollout_id for r in rollouts]
        done = {r.rollout_id: r for r in await self.client.wait_for_rollouts(ids, timeout=timeout)}
        current = [done.get(rid) or await self.client.get_rollout(rid) for rid in ids]
        return await self.results(current)

    async def run_batch(
        self, inputs: Sequence[Any], *, timeout: float | None = None, **enqueue_options: Any
    ) -> list[RolloutResult]:
        """Enqueue, wait and read rewards in one call."""
        return await self.wait(await self.enqueue(inputs, **enqueue_options), timeout=timeout)


def _mode(mode: RolloutMode | str | None) -> RolloutMode:
    if mode is None:
        return RolloutMode.UNSPECIFIED
    if isinstance(mode, str):
        return RolloutMode[mode.upper()]
    return mode
