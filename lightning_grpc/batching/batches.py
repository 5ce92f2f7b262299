"""One batch from whole groups: each rollout's spans through the adapter, the failure policy, staleness,
length limits, then packed rows. Everything left out or changed is counted by reason."""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from lightning_grpc.triplets import (
    AdapterConfig,
    Aggregated,
    Fallback,
    RolloutTriplets,
    Row,
    rows_from_triplets,
    triplets_from_spans,
)
from lightning_grpc.types import AttemptStatus, Rollout, RolloutStatus, Span

from .groups import Group
from .options import BatchOptions, FailurePolicy, PromptOverflow
from .tensors import Ragged, RaggedBuilder, pack

T = TypeVar("T")
#: Reads the spans of one attempt: (rollout id, attempt id) -> spans in sequence order.
SpanReader = Callable[[str, str], Awaitable[list[Span]]]

# Reasons counted by the batch (the adapter's own reasons are counted alongside).
ROLLOUT_FAILED = "rollout_failed"
ROLLOUT_TIMED_OUT = "rollout_timed_out"
ROLLOUT_UNRESPONSIVE = "rollout_unresponsive"
ROLLOUT_CANCELLED = "rollout_cancelled"
NO_REWARD = "no_reward"
GROUP_DROPPED = "group_dropped_for_failed_sibling"
ROLLOUT_DROPPED = "rollout_dropped"
ROLLOUT_FILLED = "rollout_filled"
ROLLOUT_WITHOUT_ROWS = "rollout_without_rows"
STALE_POLICY = "stale_policy"
PROMPT_TOO_LONG = "prompt_too_long"
TRUNCATED_PROMPT = "truncated_prompt"
TRUNCATED_RESPONSE = "truncated_response"
ZERO_TRAINABLE_TOKENS = "zero_trainable_tokens"


@dataclass
class BatchRollout:
    rollout_id: str
    attempt_id: str
    group_id: str
    status: RolloutStatus
    reward: float
    filled: bool
    row_count: int = 0


@dataclass
class RowInfo:
    rollout_index: int
    turn_index: int
    policy_versions: list[int]
    truncated: bool
    filled: bool
    has_log_probs: bool
    call_span_ids: list[str]


def row_infos(
    arrays: Mapping[str, np.ndarray], call_span_ids: Sequence[str], call_policy_versions: Sequence[int]
) -> list[RowInfo]:
    """Each row's description, from a batch's per-row arrays and its per-call columns (row after row)."""
    out: list[RowInfo] = []
    at = 0
    names = ("rollout_index", "turn_index", "calls_per_row", "truncated", "filled", "has_rollout_log_probs")
    columns = zip(*(arrays[name].tolist() for name in names), strict=True)
    versions = [int(v) for v in call_policy_versions]
    for rollout_index, turn_index, calls, truncated, filled, has_lp in columns:
        out.append(
            RowInfo(
                rollout_index,
                turn_index,
                versions[at : at + calls],
                truncated,
                filled,
                has_lp,
                list(call_span_ids[at : at + calls]),
            )
        )
        at += calls
    return out


@dataclass
class BuiltBatch:
    batch_id: str
    group_ids: list[str]
    rollouts: list[BatchRollout]
    ragged: Ragged
    drops: Counter[str] = field(default_factory=Counter)
    #: Row restarts in the rollouts that fell back to one row per call (:attr:`Aggregated.breaks`).
    trajectory_breaks: int = 0
    #: Rollouts whose trajectory rows fell back to one row per call, by reason (``FallbackReason``).
    fallbacks: Counter[str] = field(default_factory=Counter)
    #: The span id and policy version of every call of every row, row after row (``calls_per_row`` apart).
    call_span_ids: list[str] = field(default_factory=list)
    call_policy_versions: list[int] = field(default_factory=list)

    @property
    def row_count(self) -> int:
        return self.ragged.rows

    @property
    def rows(self) -> list[RowInfo]:
        return row_infos(self.ragged.arrays(), self.call_span_ids, self.call_policy_versions)


def failure_of(rollout: Rollout, reward: float | None) -> str:
    """Why a rollout cannot be trained as it is ("" when it can)."""
    if rollout.status == RolloutStatus.CANCELLED:
        return ROLLOUT_CANCELLED
    if rollout.status != RolloutStatus.SUCCEEDED:
        attempt = rollout.latest_attempt.status if rollout.latest_attempt else None
        if attempt == AttemptStatus.TIMEOUT:
            return ROLLOUT_TIMED_OUT
        if attempt == AttemptStatus.UNRESPONSIVE:
            return ROLLOUT_UNRESPONSIVE
        return ROLLOUT_FAILED
    return NO_REWARD if reward is None else ""


@dataclass
class _Evaluated:
    rollout: Rollout
    triplets: RolloutTriplets
    failure: str


class PreparedRollouts:
    """Each attempt's triplets and rows, computed once per (attempt, spans stored, adapter options).

    A finished rollout is usually prepared as soon as it ends (:meth:`TrainerCore.start` watches for
    that), so cutting a batch mostly joins prepared rows. Spans arriving later change the count and so
    the key: nothing stale is served. The oldest entries go beyond ``capacity``.
    """

    def __init__(
        self, read_spans: SpanReader, span_count: Callable[[str], int], capacity: int = 50_000
    ) -> None:
        self.read_spans = read_spans
        self.span_count = span_count
        self.capacity = capacity
        self._triplets: OrderedDict[tuple[Any, ...], RolloutTriplets] = OrderedDict()
        self._rows: OrderedDict[tuple[Any, ...], Aggregated] = OrderedDict()
        self._fitted: OrderedDict[tuple[Any, ...], Fitted] = OrderedDict()

    def _key(self, attempt_id: str, config: AdapterConfig) -> tuple[Any, ...]:
        return (attempt_id, self.span_count(attempt_id), config)

    async def triplets(self, rollout: Rollout, config: AdapterConfig) -> RolloutTriplets:
        """The triplets of the rollout's latest attempt (none for a rollout never started)."""
        attempt = rollout.latest_attempt
        if attempt is None:
            return triplets_from_spans([], config)
        key = self._key(attempt.attempt_id, config)
        found = self._triplets.get(key)
        if found is None:
            spans = await self.read_spans(rollout.rollout_id, attempt.attempt_id)
            key = self._key(attempt.attempt_id, config)  # spans may have arrived while reading
            found = self._remember(self._triplets, key, triplets_from_spans(spans, config))
        return found

    def rows(
        self, rollout: Rollout, config: AdapterConfig, triplets: RolloutTriplets, aggregation: str
    ) -> Aggregated:
        attempt = rollout.latest_attempt
        key = (*self._key(attempt.attempt_id if attempt else "", config), aggregation)
        found = self._rows.get(key)
        if found is None or self._triplets.get(key[:3]) is not triplets:
            found = self._remember(self._rows, key, rows_from_triplets(triplets.triplets, aggregation))
        return found

    def fitted(self, ev: _Evaluated, options: BatchOptions) -> Fitted:
        """The rollout's rows as the batch options cut them (recent calls, length limits), with what was
        counted on the way; remembered per attempt, spans stored and options."""
        attempt = ev.rollout.latest_attempt
        key = (
            *self._key(attempt.attempt_id if attempt else "", options.adapter_config),
            options.min_policy_version,
            options.max_prompt_length,
            options.max_response_length,
            options.prompt_overflow,
        )
        found = self._fitted.get(key)
        if found is None or found.triplets is not ev.triplets:
            found = self._remember(self._fitted, key, fit_rows(ev, options, self))
        return found

    def _remember(self, cache: OrderedDict[tuple[Any, ...], T], key: tuple[Any, ...], value: T) -> T:
        cache[key] = value
        while len(cache) > self.capacity:
            cache.popitem(last=False)
        return value


async def evaluate(rollout: Rollout, prepared: PreparedRollouts, options: BatchOptions) -> _Evaluated:
    """A rollout's triplets (from its latest attempt only) and why it cannot be trained, if it cannot."""
    triplets = await prepared.triplets(rollout, options.adapter_config)
    return _Evaluated(rollout, triplets, failure_of(rollout, triplets.reward))


def fresh_rows(
    ev: _Evaluated, options: BatchOptions, prepared: PreparedRollouts, drops: Counter[str]
) -> Aggregated:
    """The rollout's rows from the calls recent enough (``min_policy_version``)."""
    triplets = ev.triplets.triplets
    aggregation = options.aggregation.name.lower()
    if options.min_policy_version is not None:
        fresh = [t for t in triplets if t.policy_version >= options.min_policy_version]
        if len(fresh) < len(triplets):
            drops[STALE_POLICY] += len(triplets) - len(fresh)
            return rows_from_triplets(fresh, aggregation)
    return prepared.rows(ev.rollout, options.adapter_config, ev.triplets, aggregation)


def fit_to_limits(row: Row, options: BatchOptions, drops: Counter[str]) -> tuple[Row | None, bool]:
    """The row within the length limits: (row or None when it is left out, truncated)."""
    if not (options.max_prompt_length or options.max_response_length):
        if row.trainable_tokens:
            return row, False
        drops[ZERO_TRAINABLE_TOKENS] += 1
        return None, False
    truncated = False
    limit = options.max_prompt_length
    if limit and len(row.prompt_ids) > limit:
        if options.prompt_overflow == PromptOverflow.DROP:
            drops[PROMPT_TOO_LONG] += 1
            return None, False
        row = dataclasses.replace(row, prompt_ids=row.prompt_ids[-limit:])
        drops[TRUNCATED_PROMPT] += 1
        truncated = True
    limit = options.max_response_length
    if limit and len(row.response_ids) > limit:
        row = dataclasses.replace(
            row,
            response_ids=row.response_ids[:limit],
            response_mask=row.response_mask[:limit],
            logprobs=None if row.logprobs is None else row.logprobs[:limit],
        )
        drops[TRUNCATED_RESPONSE] += 1
        truncated = True
    if not row.trainable_tokens:
        drops[ZERO_TRAINABLE_TOKENS] += 1
        return None, truncated
    return row, truncated


@dataclass(frozen=True)
class Fitted:
    """A rollout's rows within a batch's options: (row, truncated) each, the drops counted making them, and
    why its trajectory rows fell back to one row per call (None when they did not)."""

    triplets: RolloutTriplets
    rows: tuple[tuple[Row, bool], ...]
    drops: Counter[str]
    breaks: int
    fallback: Fallback | None = None


def fit_rows(ev: _Evaluated, options: BatchOptions, prepared: PreparedRollouts) -> Fitted:
    drops: Counter[str] = Counter()
    _count_adapter_drops(ev, drops)
    aggregated = fresh_rows(ev, options, prepared, drops)
    kept: list[tuple[Row, bool]] = []
    for row in aggregated.rows:
        fitted, truncated = fit_to_limits(row, options, drops)
        if fitted is not None:
            kept.append((fitted, truncated))
    if not kept:
        drops[ROLLOUT_WITHOUT_ROWS] += 1
    return Fitted(ev.triplets, tuple(kept), drops, len(aggregated.breaks), aggregated.fallback)


def _count_adapter_drops(ev: _Evaluated, drops: Counter[str]) -> None:
    for drop in ev.triplets.drops:
        drops[reason_name(drop.reason)] += 1


def reason_name(reason: object) -> str:
    """A reason as counted: an enum's value, else the string itself."""
    return str(getattr(reason, "value", reason))


async def build_batch(
    batch_id: str,
    groups: Sequence[Group],
    rollouts: dict[str, Rollout],
    prepared: PreparedRollouts,
    options: BatchOptions,
) -> BuiltBatch:
    """The batch of these (ended) groups."""
    drops: Counter[str] = Counter()
    out = BuiltBatch(batch_id, [], [], pack([]), drops)
    builder = RaggedBuilder(include_log_probs=not options.exclude_log_probs)
    for group in groups:
        members = [rollouts[rid] for rid in group.rollout_ids if rid in rollouts]
        evaluated = [await evaluate(r, prepared, options) for r in members]
        failures = [ev.failure for ev in evaluated if ev.failure]
        for reason in failures:
            drops[reason] += 1
        if failures and options.failure_policy == FailurePolicy.DROP_GROUP:
            drops[GROUP_DROPPED] += 1
            continue
        out.group_ids.append(group.group_id)
        for ev in evaluated:
            if ev.failure and options.failure_policy == FailurePolicy.DROP_ROLLOUT:
                drops[ROLLOUT_DROPPED] += 1
                continue
            _add_rollout(out, builder, ev, group, options, prepared)
    out.ragged = builder.build()
    return out


def _add_rollout(
    out: BuiltBatch,
    builder: RaggedBuilder,
    ev: _Evaluated,
    group: Group,
    options: BatchOptions,
    prepared: PreparedRollouts,
) -> None:
    filled = bool(ev.failure)
    if filled:
        out.drops[ROLLOUT_FILLED] += 1
    reward = options.fill_reward if filled else float(ev.triplets.reward)  # type: ignore[arg-type]
    fitted = prepared.fitted(ev, options)
    if fitted.drops:
        out.drops.update(fitted.drops)
    out.trajectory_breaks += fitted.breaks
    if fitted.fallback is not None:
        out.fallbacks[reason_name(fitted.fallback.reason)] += 1
    kept = fitted.rows
    if not kept:
        return
    index = len(out.rollouts)
    attempt = ev.rollout.latest_attempt
    out.rollouts.append(
        BatchRollout(
            ev.rollout.rollout_id,
            attempt.attempt_id if attempt else "",
            group.group_id,
            ev.rollout.status,
            reward,
            filled,
            len(kept),
        )
    )
    last = len(kept) - 1
    for position, (row, truncated) in enumerate(kept):
        score = row.reward
        if filled:  # the stated value, at the rollout's last row, as a final reward would be
            score = options.fill_reward if position == last else 0.0
        builder.add(
            row.prompt_ids,
            row.response_ids,
            row.response_mask,
            row.logprobs,
            score=score,
            rollout_reward=reward,
            rollout_index=index,
            turn_index=row.turn_index,
            truncated=truncated,
            filled=filled,
            calls=len(row.call_span_ids),
            temperature=row.temperature,
        )
        out.call_span_ids += row.call_span_ids
        out.call_policy_versions += row.policy_versions
