"""Reward spans, the rollout's final reward, and which call each reward goes to.

A call takes at most one reward. With ``first_occurrence`` each reward span, in call order, goes to the
latest call before it that had finished when the reward started and has no reward yet; with
``first_sibling`` the same, among the reward span's siblings only. A reward no call can take is returned
as unmatched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_grpc import semconv

from .tree import Node, TraceTree


@dataclass(frozen=True, eq=False)
class RewardSpan:
    node: Node
    value: float


def reward_spans(tree: TraceTree, dimension: str | None) -> list[RewardSpan]:
    """The spans carrying a value of the chosen dimension (None: the primary one), in call order."""
    found = []
    for node in sorted(tree.nodes.values(), key=lambda node: node.order):
        value = semconv.read_reward_dimension(node.attributes, dimension)
        if value is not None:
            found.append(RewardSpan(node, value))
    return found


def final_reward(rewards: Sequence[RewardSpan]) -> float | None:
    """The rollout's reward: the value of its last reward span in call order."""
    return rewards[-1].value if rewards else None


def finished_before(call: Node, reward: Node) -> bool:
    """Whether the call had ended when the reward started (by call order when either time is missing)."""
    if call.end > 0 and reward.start > 0:
        return call.end <= reward.start
    return call.order < reward.order


def take_reward(
    earlier_calls: Sequence[Node], reward: Node, rewarded: dict[str, float], value: float
) -> bool:
    """Give the reward to the latest earlier finished unrewarded call; False when there is none."""
    for call in reversed(earlier_calls):
        if call.span_id not in rewarded and finished_before(call, reward):
            rewarded[call.span_id] = value
            return True
    return False


def match_first_occurrence(
    calls: Sequence[Node], rewards: Sequence[RewardSpan]
) -> tuple[dict[str, float], list[RewardSpan]]:
    """(reward by call span id, unmatched rewards); ``calls`` are the trained calls."""
    events: list[tuple[tuple[int, int, int], Node | RewardSpan]] = [(call.order, call) for call in calls]
    events += [(reward.node.order, reward) for reward in rewards]
    events.sort(key=lambda event: event[0])
    rewarded: dict[str, float] = {}
    unmatched: list[RewardSpan] = []
    seen: list[Node] = []
    for _, item in events:
        if isinstance(item, Node):
            seen.append(item)
        elif not take_reward(seen, item.node, rewarded, item.value):
            unmatched.append(item)
    return rewarded, unmatched


def match_first_sibling(
    tree: TraceTree, calls: Iterable[Node], rewards: Sequence[RewardSpan]
) -> tuple[dict[str, float], list[RewardSpan]]:
    """(reward by call span id, unmatched rewards); a reward only goes to a call among its siblings."""
    trained = {id(call) for call in calls}
    reward_of = {id(reward.node): reward for reward in rewards}
    rewarded: dict[str, float] = {}
    matched: set[int] = set()
    for parent in tree.walk():
        seen: list[Node] = []
        for child in parent.children:
            if id(child) in trained:
                seen.append(child)
            elif id(child) in reward_of:
                reward = reward_of[id(child)]
                if take_reward(seen, child, rewarded, reward.value):
                    matched.add(id(child))
    unmatched = [reward for reward in rewards if id(reward.node) not in matched]
    return rewarded, unmatched
