"""How a batch is cut: the options of a batch request, checked, with the defaults the contract states."""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.triplets import AdapterConfig

DEFAULT_CHUNK_BYTES = 1024 * 1024
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 32 * 1024 * 1024
MAX_LENGTH = 1 << 20
MAX_GROUPS = 100_000


class Aggregation(enum.IntEnum):
    TRANSITION = 1
    TRAJECTORY = 2


class RewardMatch(enum.IntEnum):
    FINAL = 1
    FIRST_OCCURRENCE = 2
    FIRST_SIBLING = 3


class FailurePolicy(enum.IntEnum):
    """What a batch does with a rollout that did not succeed or has no reward (never a silent 0)."""

    DROP_GROUP = 1
    DROP_ROLLOUT = 2
    FILL = 3


class PromptOverflow(enum.IntEnum):
    DROP = 1
    TRUNCATE_LEFT = 2


class Layout(enum.IntEnum):
    RAGGED = 1
    PADDED = 2


def _member(kind: type[enum.IntEnum], value: int | str | enum.IntEnum, field: str, default: int) -> int:
    """An enum member from its number (0: the default) or its name in any case."""
    if isinstance(value, str):
        try:
            return int(kind[value.upper()])
        except KeyError:
            names = ", ".join(m.name.lower() for m in kind)
            raise InvalidArgumentError(field, f"{value!r} is not one of {names}") from None
    if value == 0:
        return default
    try:
        return int(kind(value))
    except ValueError:
        raise InvalidArgumentError(field, f"{value} is not a valid {kind.__name__} number") from None


@dataclass(frozen=True)
class BatchOptions:
    """The options of one batch request (see ``BatchOptions`` in trainer_service.proto)."""

    aggregation: Aggregation = Aggregation.TRANSITION
    reward_match: RewardMatch = RewardMatch.FINAL
    reward_dimension: str = ""
    agent_match: str = ""
    failure_policy: FailurePolicy = FailurePolicy.DROP_ROLLOUT
    fill_reward: float = 0.0
    min_policy_version: int | None = None
    pad_token_id: int = 0
    max_prompt_length: int = 0
    max_response_length: int = 0
    prompt_overflow: PromptOverflow = PromptOverflow.DROP
    layout: Layout = Layout.RAGGED
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    exclude_log_probs: bool = False
    include_calls_under_reward: bool = False

    @classmethod
    def checked(cls, field: str = "options", **values: object) -> BatchOptions:
        """Options from raw values (enum numbers or names, 0 for defaults), each checked by name."""
        v = dict(values)
        enums = {
            "aggregation": (Aggregation, Aggregation.TRANSITION),
            "reward_match": (RewardMatch, RewardMatch.FINAL),
            "failure_policy": (FailurePolicy, FailurePolicy.DROP_ROLLOUT),
            "prompt_overflow": (PromptOverflow, PromptOverflow.DROP),
            "layout": (Layout, Layout.RAGGED),
        }
        for name, (kind, default) in enums.items():
            if name in v:
                v[name] = kind(_member(kind, v[name], f"{field}.{name}", default))  # type: ignore[arg-type]
        for name in ("pad_token_id", "max_prompt_length", "max_response_length"):
            number = v.get(name, 0)
            if not isinstance(number, int) or not 0 <= number <= MAX_LENGTH:
                raise InvalidArgumentError(
                    f"{field}.{name}", f"must be between 0 and {MAX_LENGTH} (got {number})"
                )
        chunk = v.get("max_chunk_bytes") or DEFAULT_CHUNK_BYTES
        if not isinstance(chunk, int) or not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"{field}.max_chunk_bytes",
                f"must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES} (got {chunk})",
            )
        v["max_chunk_bytes"] = chunk
        fill = v.get("fill_reward", 0.0)
        if not isinstance(fill, int | float) or fill != fill or fill in (float("inf"), float("-inf")):
            raise InvalidArgumentError(f"{field}.fill_reward", f"must be a finite number (got {fill})")
        pattern = v.get("agent_match") or ""
        if not isinstance(pattern, str) or len(pattern) > 1000:
            raise InvalidArgumentError(
                f"{field}.agent_match", "must be a regular expression of at most 1000 characters"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise InvalidArgumentError(
                f"{field}.agent_match", f"is not a valid regular expression: {exc}"
            ) from None
        dimension = v.get("reward_dimension") or ""
        if not isinstance(dimension, str) or len(dimension) > 256:
            raise InvalidArgumentError(f"{field}.reward_dimension", "must be at most 256 characters")
        return cls(**v)  # type: ignore[arg-type]

    @functools.cached_property
    def adapter_config(self) -> AdapterConfig:
        return _adapter_config(
            self.aggregation.name.lower(),
            self.reward_match.name.lower(),
            self.reward_dimension or None,
            self.agent_match or None,
            not self.include_calls_under_reward,
        )


@functools.lru_cache(maxsize=256)
def _adapter_config(
    aggregation: str,
    reward_match: str,
    reward_dimension: str | None,
    agent_match: str | None,
    exclude_calls_under_reward: bool,
) -> AdapterConfig:
    """One shared object per distinct choice, so cache lookups keyed by it find it by identity."""
    return AdapterConfig(aggregation, reward_match, reward_dimension, agent_match, exclude_calls_under_reward)
