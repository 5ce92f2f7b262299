"""What the adapter returns: triplets (one per trained LLM call) and drops (each call not trained, and why)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from lightning_grpc.semconv import DEFAULT_TEMPERATURE


class DropReason(enum.StrEnum):
    """Why a call (or a choice, or a reward) was not trained. The trainer adds batch-level reasons of its own."""

    #: A retry of a later call with the same prompt ids (or the same response id); the last one is trained.
    DUPLICATE_CALL = "duplicate_call"
    #: The call failed (``LLM_ERROR`` or span status ERROR).
    CALL_ERROR = "call_error"
    #: The call was made inside a reward scope (LLM-as-judge).
    JUDGE_CALL = "judge_call"
    #: The prompt or response ids are missing, empty or malformed.
    NO_TOKEN_IDS = "no_token_ids"
    #: The agent above the call does not match ``agent_match`` (or no agent is above it).
    OTHER_AGENT = "other_agent"
    #: A choice of an ``n > 1`` call that the agent did not continue.
    UNUSED_CHOICE = "unused_choice"
    #: A reward span no call could take (``first_occurrence`` / ``first_sibling``); its span id is given.
    UNMATCHED_REWARD = "unmatched_reward"


#: Reasons that account for a whole LLM-call span (each call is either a triplet or one of these).
CALL_DROP_REASONS = frozenset(
    {
        DropReason.DUPLICATE_CALL,
        DropReason.CALL_ERROR,
        DropReason.JUDGE_CALL,
        DropReason.NO_TOKEN_IDS,
        DropReason.OTHER_AGENT,
    }
)


@dataclass(frozen=True)
class Drop:
    """Something not trained: the reason, the span, the call's index among all the rollout's LLM calls in
    call order (-1 when the span is not a call in that order, such as a reward), and a short detail."""

    reason: DropReason | str
    span_id: str
    call_index: int
    detail: str


@dataclass(eq=False)
class Triplet:
    """One trained LLM call: the exact ids the model saw and produced, and the reward it earned."""

    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    logprobs: np.ndarray | None  # float32, one per response id
    reward: float | None
    span_id: str
    response_id: str
    model: str
    policy_version: int  # -1 when the span does not say
    call_index: int  # 0-based position among the rollout's trained calls, in call order
    agent_name: str
    finish_reason: str
    streamed: bool
    #: int32, sorted indices into ``response_ids`` of the tokens a grammar forced (the only token it
    #: allowed): not the policy's choice, so their rows' ``response_mask`` is 0 there.
    forced_positions: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    #: The sampling temperature and top_p the engine used for the call, as the proxy recorded them
    #: (``semconv.LLM_REQUEST_TEMPERATURE``, ``LLM_REQUEST_TOP_P``); None when the span does not say.
    temperature: float | None = None
    top_p: float | None = None

    @property
    def sampling_temperature(self) -> float:
        """The temperature the call was sampled at: the recorded one, else the engine default (1.0)."""
        return DEFAULT_TEMPERATURE if self.temperature is None else self.temperature


@dataclass(eq=False)
class RolloutTriplets:
    """A rollout's triplets in call order, what was dropped, its final reward and how many LLM-call spans it had.

    ``calls == len(triplets) + (drops whose reason is in CALL_DROP_REASONS)``.
    """

    triplets: list[Triplet] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    reward: float | None = None
    calls: int = 0


class FallbackReason(enum.StrEnum):
    """Why a rollout's trajectory rows fell back to one row per call (transition rows)."""

    #: A call's prompt does not start with its chain's previous prompt + response, token for token (an agent
    #: framework re-rendered the history: re-serialized tool-call arguments, a dropped reasoning part, ...).
    PROMPT_NOT_EXTENSION = "prompt_not_extension"
    #: A call was sampled at another temperature than its chain's first call: a row has one temperature,
    #: the one the learner computes its log-probs at, so the calls are trained as rows of their own.
    TEMPERATURE_DIFFERS = "temperature_differs"


@dataclass(frozen=True)
class Fallback:
    """Why trajectory aggregation gave up on a rollout: the first call (in call order) that did not extend
    its chain, the first position where its prompt differs from the earlier turns, the two token ids there
    (``actual_token`` is -1 when the prompt ended before), and a readable detail naming all of it.
    ``TEMPERATURE_DIFFERS``: the first call sampled at another temperature than its chain's first call; the
    position and tokens are -1, the detail names both temperatures."""

    reason: FallbackReason | str
    call_index: int
    span_id: str
    position: int
    expected_token: int
    actual_token: int
    detail: str
