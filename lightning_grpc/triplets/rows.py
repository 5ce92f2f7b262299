"""Triplets -> training rows: one row per call (transition), or each agent's calls merged into one row while
every prompt extends the turns before it token for token (trajectory; else one row per call, with the reason)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from lightning_grpc.semconv import DEFAULT_TEMPERATURE

from .config import check_aggregation
from .records import Fallback, FallbackReason, Triplet
from .tokens import first_difference, logprobs_from


@dataclass(eq=False)
class Row:
    """One training row. ``response_mask`` is 1 at the model's own tokens and 0 at observation tokens
    (``logprobs`` holds 0.0 there) and at the tokens a grammar forced (``Triplet.forced_positions``: the
    policy did not choose them; their ``logprobs`` stay as recorded)."""

    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    response_mask: np.ndarray  # uint8, len == len(response_ids)
    logprobs: np.ndarray | None  # float32, len == len(response_ids)
    reward: float  # transition: the triplet's reward or 0.0; trajectory: the sum of its calls' rewards
    turn_index: int  # call_index of its first call
    call_span_ids: list[str]
    policy_versions: list[int]
    finish_reason: str  # of its last call
    #: The temperature its calls were sampled at (recorded per call; 1.0, the engine default, when a span
    #: does not say): the learner computes the row's log-probs at it. A trajectory row's calls share one.
    temperature: float = DEFAULT_TEMPERATURE

    @cached_property
    def trainable_tokens(self) -> int:
        return int(np.count_nonzero(self.response_mask))


@dataclass(eq=False)
class Aggregated:
    """The rows made; the call_index of each call that started a row but is not the first call of its chain
    (``breaks``: in trajectory mode only a rollout that fell back has any); and, in trajectory mode, why the
    rollout fell back to one row per call (``fallback``, None when its chains held)."""

    rows: list[Row] = field(default_factory=list)
    breaks: list[int] = field(default_factory=list)
    fallback: Fallback | None = None


def rows_from_triplets(triplets: Sequence[Triplet], aggregation: str) -> Aggregated:
    """The rows of one rollout's triplets, in call order. Rows with no trainable token are not made.

    Trajectory: the calls of each agent (``Triplet.agent_name``) form one chain, in call order; a chain is
    one row when each call's prompt starts with the previous call's prompt and response, token for token:
    the prompt tokens after them (the observation) join the response with mask 0 and logprob 0, then the
    call's response with mask 1. When any call does not extend its chain, or was sampled at another
    temperature than its chain's first call, the whole rollout falls back to one row per call and
    ``fallback`` says which call and why (where its prompt first differs, or both temperatures).
    """
    check_aggregation(aggregation)
    ordered = sorted(triplets, key=lambda triplet: triplet.call_index)
    if aggregation == "transition":
        return Aggregated(rows=rows_of_calls(ordered))
    chains = chains_by_agent(ordered)
    fallback = first_fallback(chains)
    if fallback is not None:
        restarts = sorted(triplet.call_index for chain in chains for triplet in chain[1:])
        return Aggregated(rows=rows_of_calls(ordered), breaks=restarts, fallback=fallback)
    rows = [row_of_chain(chain) for chain in chains]
    return Aggregated(rows=[row for row in rows if row.trainable_tokens])


def rows_of_calls(ordered: Sequence[Triplet]) -> list[Row]:
    rows = [row_of_call(triplet) for triplet in ordered]
    return [row for row in rows if row.trainable_tokens]


def chains_by_agent(ordered: Sequence[Triplet]) -> list[list[Triplet]]:
    """The calls of each agent, in call order; the chains ordered by their first call."""
    chains: dict[str, list[Triplet]] = {}
    for triplet in ordered:
        chains.setdefault(triplet.agent_name, []).append(triplet)
    return list(chains.values())


def first_fallback(chains: Sequence[Sequence[Triplet]]) -> Fallback | None:
    """The earliest call (in call order) whose prompt does not extend its chain, as a Fallback."""
    found = [fallback for chain in chains if (fallback := chain_fallback(chain)) is not None]
    return min(found, key=lambda fallback: fallback.call_index, default=None)


def chain_fallback(chain: Sequence[Triplet]) -> Fallback | None:
    for previous, triplet in itertools.pairwise(chain):
        expected = np.concatenate((ids_of(previous.prompt_ids), ids_of(previous.response_ids)))
        prompt = ids_of(triplet.prompt_ids)
        position = first_difference(prompt, expected)
        if position is not None:
            return prompt_not_extension(previous, triplet, prompt, expected, position)
        if triplet.sampling_temperature != chain[0].sampling_temperature:
            return temperature_differs(chain[0], triplet)
    return None


def temperature_differs(first: Triplet, triplet: Triplet) -> Fallback:
    """A call sampled at another temperature than its chain's first: one row has one temperature."""
    detail = (
        f"call {triplet.call_index} (span {triplet.span_id}) was sampled at temperature "
        f"{triplet.sampling_temperature:g}, call {first.call_index} at {first.sampling_temperature:g}: "
        "a row's log-probs are computed at one temperature"
    )
    return Fallback(
        FallbackReason.TEMPERATURE_DIFFERS, triplet.call_index, triplet.span_id, -1, -1, -1, detail
    )


def prompt_not_extension(
    previous: Triplet, triplet: Triplet, prompt: np.ndarray, expected: np.ndarray, position: int
) -> Fallback:
    expected_token = int(expected[position])
    actual_token = int(prompt[position]) if position < len(prompt) else -1
    found = f"token {actual_token}" if actual_token >= 0 else "the end of the prompt"
    detail = (
        f"call {triplet.call_index} (span {triplet.span_id}): its prompt differs from call "
        f"{previous.call_index}'s prompt + response at position {position}: {found} where "
        f"{expected_token} was expected"
    )
    return Fallback(
        FallbackReason.PROMPT_NOT_EXTENSION,
        triplet.call_index,
        triplet.span_id,
        position,
        expected_token,
        actual_token,
        detail,
    )


def row_of_chain(chain: Sequence[Triplet]) -> Row:
    row = TrajectoryRow(chain[0])
    for triplet in chain[1:]:
        row.extend(triplet)
    return row.row()


def ids_of(value: np.ndarray) -> np.ndarray:
    return np.asarray(value, dtype=np.int32)


def logprobs_of(triplet: Triplet, response: np.ndarray) -> np.ndarray | None:
    if triplet.logprobs is None:
        return None
    return logprobs_from(triplet.logprobs, len(response))


def mask_of(triplet: Triplet, response: np.ndarray) -> np.ndarray:
    """1 at each of the call's response tokens the policy chose, 0 where a grammar forced the token:
    training a token the sampler had no choice over only adds gradient and KL noise."""
    mask = np.ones(len(response), dtype=np.uint8)
    forced = np.asarray(triplet.forced_positions, dtype=np.int64)
    mask[forced[(forced >= 0) & (forced < len(response))]] = 0
    return mask


def row_of_call(triplet: Triplet) -> Row:
    response = ids_of(triplet.response_ids)
    return Row(
        prompt_ids=ids_of(triplet.prompt_ids),
        response_ids=response,
        response_mask=mask_of(triplet, response),
        logprobs=logprobs_of(triplet, response),
        reward=float(triplet.reward) if triplet.reward is not None else 0.0,
        turn_index=triplet.call_index,
        call_span_ids=[triplet.span_id],
        policy_versions=[triplet.policy_version],
        finish_reason=triplet.finish_reason,
        temperature=triplet.sampling_temperature,
    )


class TrajectoryRow:
    """A row being built from a chain's calls; pieces are joined once, when it is made."""

    def __init__(self, first: Triplet) -> None:
        self.prompt = ids_of(first.prompt_ids)
        self.last_prompt = self.prompt
        self.last_response = ids_of(first.response_ids)
        self.responses: list[np.ndarray] = [self.last_response]
        self.masks: list[np.ndarray] = [mask_of(first, self.last_response)]
        first_logprobs = logprobs_of(first, self.last_response)
        self.logprobs: list[np.ndarray] | None = [first_logprobs] if first_logprobs is not None else None
        self.rewards = [first.reward]
        self.first = first
        self.last = first
        self.span_ids = [first.span_id]
        self.versions = [first.policy_version]

    def extend(self, triplet: Triplet) -> None:
        prompt = ids_of(triplet.prompt_ids)
        response = ids_of(triplet.response_ids)
        observation = prompt[len(self.last_prompt) + len(self.last_response) :]
        self.responses += [observation, response]
        self.masks += [np.zeros(len(observation), dtype=np.uint8), mask_of(triplet, response)]
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

    def row(self) -> Row:
        return Row(
            prompt_ids=self.prompt,
            response_ids=np.concatenate(self.responses),
            response_mask=np.concatenate(self.masks),
            logprobs=np.concatenate(self.logprobs) if self.logprobs is not None else None,
            reward=math.fsum(reward for reward in self.rewards if reward is not None),
            turn_index=self.first.call_index,
            call_span_ids=self.span_ids,
            policy_versions=self.versions,
            finish_reason=self.last.finish_reason,
            temperature=self.first.sampling_temperature,
        )
