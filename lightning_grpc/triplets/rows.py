"""Triplets -> training rows: one row per call (transition), or consecutive calls merged (trajectory)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .config import check_aggregation
from .records import Triplet
from .tokens import logprobs_from, starts_with


@dataclass(eq=False)
class Row:
    """One training row. ``response_mask`` is 1 at the model's own tokens and 0 at observation tokens
    (``logprobs`` holds 0.0 there)."""

    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    response_mask: np.ndarray  # uint8, len == len(response_ids)
    logprobs: np.ndarray | None  # float32, len == len(response_ids)
    reward: float  # transition: the triplet's reward or 0.0; trajectory: the sum of its calls' rewards
    turn_index: int  # call_index of its first call
    call_span_ids: list[str]
    policy_versions: list[int]
    finish_reason: str  # of its last call

    @cached_property
    def trainable_tokens(self) -> int:
        return int(np.count_nonzero(self.response_mask))


@dataclass(eq=False)
class Aggregated:
    """The rows made, and the call_index of each call where a trajectory row had to restart."""

    rows: list[Row] = field(default_factory=list)
    breaks: list[int] = field(default_factory=list)


def rows_from_triplets(triplets: Sequence[Triplet], aggregation: str) -> Aggregated:
    """The rows of one rollout's triplets, in call order. Rows with no trainable token are not made.

    Trajectory: a call merges into the current row when its prompt starts with the row's latest prompt and
    response; the prompt tokens after them (the observation) join the response with mask 0 and logprob 0,
    then the call's response with mask 1. Otherwise the row ends and a new one starts (a break).
    """
    check_aggregation(aggregation)
    ordered = sorted(triplets, key=lambda triplet: triplet.call_index)
    if aggregation == "transition":
        rows = [row_of_call(triplet) for triplet in ordered]
        return Aggregated(rows=[row for row in rows if row.trainable_tokens], breaks=[])
    aggregated = Aggregated()
    current: TrajectoryRow | None = None
    for triplet in ordered:
        if current is not None and current.is_continued_by(triplet):
            current.extend(triplet)
            continue
        if current is not None:
            aggregated.breaks.append(triplet.call_index)
            current.emit_into(aggregated.rows)
        current = TrajectoryRow(triplet)
    if current is not None:
        current.emit_into(aggregated.rows)
    return aggregated


def ids_of(value: np.ndarray) -> np.ndarray:
    return np.asarray(value, dtype=np.int32)


def logprobs_of(triplet: Triplet, response: np.ndarray) -> np.ndarray | None:
    if triplet.logprobs is None:
        return None
    return logprobs_from(triplet.logprobs, len(response))


def row_of_call(triplet: Triplet) -> Row:
    response = ids_of(triplet.response_ids)
    return Row(
        prompt_ids=ids_of(triplet.prompt_ids),
        response_ids=response,
        response_mask=np.ones(len(response), dtype=np.uint8),
        logprobs=logprobs_of(triplet, response),
        reward=float(triplet.reward) if triplet.reward is not None else 0.0,
        turn_index=triplet.call_index,
        call_span_ids=[triplet.span_id],
        policy_versions=[triplet.policy_version],
        finish_reason=triplet.finish_reason,
    )


class TrajectoryRow:
    """A row being built from consecutive calls; pieces are joined once, when it is emitted."""

    def __init__(self, first: Triplet) -> None:
        self.prompt = ids_of(first.prompt_ids)
        self.last_prompt = self.prompt
        self.last_response = ids_of(first.response_ids)
        self.responses: list[np.ndarray] = [self.last_response]
        self.masks: list[np.ndarray] = [np.ones(len(self.last_response), dtype=np.uint8)]
        first_logprobs = logprobs_of(first, self.last_response)
        self.logprobs: list[np.ndarray] | None = [first_logprobs] if first_logprobs is not None else None
        self.rewards = [first.reward]
        self.first = first
        self.last = first
        self.span_ids = [first.span_id]
        self.versions = [first.policy_version]

    def is_continued_by(self, triplet: Triplet) -> bool:
        return starts_with(ids_of(triplet.prompt_ids), self.last_prompt, self.last_response)

    def extend(self, triplet: Triplet) -> None:
        prompt = ids_of(triplet.prompt_ids)
        response = ids_of(triplet.response_ids)
        observation = prompt[len(self.last_prompt) + len(self.last_response) :]
        self.responses += [observation, response]
        self.masks += [np.zeros(len(observation), dtype=np.uint8), np.ones(len(response), dtype=np.uint8)]
        logprobs = logprobs_of(triplet, response)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += [np.zeros(len(observation), dtype=np.float32), logprobs]
        else:
            self.logprobs = None
        self.last_prompt, self.last_response = prompt, response
        self.rewards.append(triplet.reward)
        self.last = triplet
        self.span_ids.append(triplet.span_id)
        self.versions.append(triplet.policy_version)

    def emit_into(self, rows: list[Row]) -> None:
        mask = np.concatenate(self.masks)
        if not mask.any():
            return
        rows.append(
            Row(
                prompt_ids=self.prompt,
                response_ids=np.concatenate(self.responses),
                response_mask=mask,
                logprobs=np.concatenate(self.logprobs) if self.logprobs is not None else None,
                reward=math.fsum(reward for reward in self.rewards if reward is not None),
                turn_index=self.first.call_index,
                call_span_ids=self.span_ids,
                policy_versions=self.versions,
                finish_reason=self.last.finish_reason,
            )
        )
