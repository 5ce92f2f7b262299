"""How the adapter turns a rollout's spans into triplets and rows."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

AGGREGATIONS = ("transition", "trajectory")
REWARD_MATCHES = ("final", "first_occurrence", "first_sibling")


@dataclass(frozen=True)
class AdapterConfig:
    """The adapter's choices; invalid values raise ValueError when the config is made.

    * ``aggregation``: ``"transition"`` (one row per call) or ``"trajectory"`` (each agent's calls merge
      into one row when every prompt extends the previous prompt + response token for token; otherwise the
      rollout falls back to one row per call, with the reason).
    * ``reward_match``: ``"final"`` (the rollout's final reward goes to its last trained call),
      ``"first_occurrence"`` or ``"first_sibling"`` (each reward span goes to the latest earlier finished
      unrewarded call; with ``first_sibling`` only to a call that is its sibling in the trace tree).
    * ``reward_dimension``: the reward dimension to read; None reads each reward's primary dimension.
    * ``agent_match``: a regular expression searched in the agent name above a call; None trains every agent.
    * ``exclude_calls_under_reward``: calls made inside a reward scope (LLM-as-judge) are not trained.
    * ``repair_hierarchy``: LLM-call spans without a (known) parent are placed under the tightest span
      that encloses them in time.
    """

    aggregation: str = "transition"
    reward_match: str = "final"
    reward_dimension: str | None = None
    agent_match: str | None = None
    exclude_calls_under_reward: bool = True
    repair_hierarchy: bool = True

    def __post_init__(self) -> None:
        check_aggregation(self.aggregation)
        if self.reward_match not in REWARD_MATCHES:
            raise ValueError(f"unknown reward_match {self.reward_match!r}; expected one of {REWARD_MATCHES}")
        if self.reward_dimension is not None and (
            not isinstance(self.reward_dimension, str) or not self.reward_dimension
        ):
            raise ValueError(
                f"reward_dimension must be a non-empty name or None, not {self.reward_dimension!r}"
            )
        if self.agent_match is not None:
            compile_agent_match(self.agent_match)

    def __hash__(self) -> int:  # computed once: configs key the trainer's per-rollout caches
        found: int | None = self.__dict__.get("_hash")
        if found is None:
            found = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", found)
        return found


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def compile_agent_match(pattern: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ValueError(f"agent_match must be a regular expression string, not {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"agent_match {pattern!r} is not a valid regular expression: {exc}") from None


DEFAULT_CONFIG = AdapterConfig()
