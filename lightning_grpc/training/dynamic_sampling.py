"""Dynamic sampling (DAPO; verl's ``algorithm.filter_groups``): groups without a reward spread set aside,
more groups drawn until a step's batch holds ``data.batch_size`` groups that give GRPO a gradient.

A GRPO group whose rollouts all earned the same final reward has zero advantage everywhere: it adds
nothing to the update but tokens to the loss. With ``[data] filter_groups = true`` the loop
(:meth:`~.loop.TrainingRun.train_step`) takes each generation round's batch from TrainerService as usual
(whole groups, its own request id), keeps the groups :func:`has_signal` accepts and, while fewer than
``batch_size`` were kept and fewer than ``max_num_gen_batches`` rounds were played, draws the groups still
missing; the update trains on the kept groups of every round (:meth:`GenerationRounds.batch`).

Pure: :class:`GenerationRounds` only reads the batches it is given and joins them; the loop submits,
waits and asks for them. Every group set aside was taken by its round's batch, so it never enters another
one, and a request id asked again returns the same groups: a repeated step makes the same choices.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from lightning_grpc.batching import BatchRollout
from lightning_grpc.batching.tensors import OPTIONAL_ROW_ARRAYS, Ragged, concat, pad, take

from .learner import reward_metrics

if TYPE_CHECKING:  # the client module imports gRPC; only its batch type is needed here
    from lightning_grpc.client.trainer import TrainingBatch

#: What verl calls the metric the groups are filtered by: the final reward of each rollout.
VERL_METRIC = "seq_final_reward"


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's final rewards (those of its rollouts in the batch) give GRPO a gradient.

    They do when they differ, and when only one rollout of the group reached the batch (its advantage is
    its reward; verl keeps such a group too). A group none of whose rollouts reached the batch has none.
    """
    if len(rewards) == 1:
        return True
    return len(rewards) > 1 and max(rewards) != min(rewards)


def rollout_rewards(batch: TrainingBatch) -> np.ndarray:
    """Each rollout's final reward (``batch.rollouts`` order), read from the rows as the learner reads it."""
    rewards = np.zeros(len(batch.rollouts), dtype=np.float32)
    index = np.asarray(batch.arrays["rollout_index"], dtype=np.int64)
    rewards[index] = np.asarray(batch.arrays["rollout_rewards"], dtype=np.float32)
    return rewards


def group_rewards(batch: TrainingBatch) -> dict[str, list[float]]:
    """Each group of the batch (``group_ids`` order) with the final rewards of its rollouts that have rows."""
    out: dict[str, list[float]] = {g: [] for g in batch.group_ids}
    for rollout, reward in zip(batch.rollouts, rollout_rewards(batch).tolist(), strict=True):
        out.setdefault(rollout.group_id, []).append(reward)
    return out


def split_groups(batch: TrainingBatch) -> tuple[list[str], list[str]]:
    """(the groups with a reward spread, the groups set aside), each in the batch's order."""
    kept: list[str] = []
    flat: list[str] = []
    for group, rewards in group_rewards(batch).items():
        (kept if has_signal(rewards) else flat).append(group)
    return kept, flat


def combine(parts: Sequence[tuple[TrainingBatch, Collection[str]]], *, pad_token_id: int) -> TrainingBatch:
    """One batch of the groups kept of each batch (whole groups; rows and groups in the parts' order).

    The rows are cut from each batch's ragged form (the RAGGED layout, the default) and padded again as
    one; per-row arrays, call span ids and policy versions follow their rows, ``uid`` and ``rollout_ids``
    are renumbered. Drops and fallbacks are summed over the parts (those of the groups left out too: they
    were built); ``carried_over_groups`` is the last part's. A single batch kept whole is returned as is.
    """
    from lightning_grpc.client.trainer import TrainingBatch

    if not parts:
        raise ValueError("no batch to combine")
    if len(parts) == 1 and set(parts[0][1]) >= set(parts[0][0].group_ids):
        return parts[0][0]
    pieces: list[Ragged] = []
    rollouts: list[BatchRollout] = []
    group_ids: list[str] = []
    span_ids: list[str] = []
    versions: list[np.ndarray] = []
    drops: Counter[str] = Counter()
    fallbacks: Counter[str] = Counter()
    for batch, keep in parts:
        ragged = batch.ragged
        if ragged is None:
            raise ValueError(f"batch {batch.batch_id}: only batches in the RAGGED layout can be combined")
        kept = set(keep)
        chosen = [i for i, r in enumerate(batch.rollouts) if r.group_id in kept]
        renumber = np.full(len(batch.rollouts), -1, dtype=np.int64)
        renumber[chosen] = np.arange(len(rollouts), len(rollouts) + len(chosen))
        rows = renumber[ragged.rollout_index.astype(np.int64)] >= 0
        piece = take(ragged, rows)
        piece.rollout_index = renumber[piece.rollout_index.astype(np.int64)].astype(np.int32)
        pieces.append(piece)
        calls = np.repeat(rows, ragged.calls_per_row.astype(np.int64))
        span_ids += np.asarray(batch.call_span_ids, dtype=object)[calls].tolist()
        versions.append(np.asarray(batch.call_policy_versions, dtype=np.int64)[calls])
        rollouts += [batch.rollouts[i] for i in chosen]
        group_ids += [g for g in batch.group_ids if g in kept]
        drops.update(batch.drops)
        fallbacks.update(batch.fallbacks)
    if any(p.rollout_log_probs is not None for p in pieces):  # rows without recorded log-probs hold 0
        for p in pieces:
            if p.rollout_log_probs is None:
                p.rollout_log_probs = np.zeros(p.response_mask.shape[0], dtype=np.float32)
    for name in OPTIONAL_ROW_ARRAYS:  # an optional array some batches lack (an older server): left out
        if any(getattr(p, name) is None for p in pieces):
            for p in pieces:
                setattr(p, name, None)
    ragged = concat(pieces)
    arrays = pad(ragged, pad_token_id=pad_token_id)
    index = ragged.rollout_index
    return TrainingBatch(
        batch_id="+".join(b.batch_id for b, _ in parts),
        group_ids=group_ids,
        rollouts=rollouts,
        arrays=arrays,
        drops=dict(drops),
        carried_over_groups=parts[-1][0].carried_over_groups,
        closed_by_deadline=any(b.closed_by_deadline for b, _ in parts),
        trajectory_breaks=sum(b.trajectory_breaks for b, _ in parts),
        fallbacks=dict(fallbacks),
        ragged=ragged,
        uid=np.array([r.group_id for r in rollouts], dtype=object)[index]
        if rollouts
        else np.zeros(0, object),
        rollout_ids=np.array([r.rollout_id for r in rollouts], dtype=object)[index]
        if rollouts
        else np.zeros(0, object),
        messages=[m for b, _ in parts for m in b.messages],
        call_span_ids=span_ids,
        call_policy_versions=np.concatenate(versions),
    )


@dataclass
class GenerationRounds:
    """One step's generation rounds: each round's batch and the groups kept of it.

    ``wanted`` groups with a reward spread are sought over at most ``limit`` rounds (the first included):
    :attr:`missing` is how many the next round draws while :attr:`more` says there is one.
    """

    wanted: int
    limit: int
    parts: list[tuple[TrainingBatch, list[str]]] = field(default_factory=list)
    #: Groups set aside (no reward spread), over the rounds so far.
    filtered: int = 0

    def add(self, batch: TrainingBatch) -> list[str]:
        """A round's batch; returns the groups set aside."""
        kept, flat = split_groups(batch)
        self.parts.append((batch, kept))
        self.filtered += len(flat)
        return flat

    @property
    def rounds(self) -> int:
        return len(self.parts)

    @property
    def kept(self) -> int:
        return sum(len(kept) for _, kept in self.parts)

    @property
    def missing(self) -> int:
        return max(0, self.wanted - self.kept)

    @property
    def more(self) -> bool:
        """Another round is due: groups are missing and the cap is not reached."""
        return self.missing > 0 and self.rounds < self.limit

    @property
    def capped(self) -> bool:
        """The rounds stopped at the cap with groups still missing (the step trains on fewer)."""
        return self.missing > 0 and self.rounds >= self.limit

    def batch(self, *, pad_token_id: int) -> TrainingBatch:
        """The batch the update trains on: the kept groups of every round."""
        return combine(self.parts, pad_token_id=pad_token_id)

    def metrics(self, solved_at: float) -> dict[str, float]:
        """``filtered_groups``, ``gen_batches`` and ``filter_groups_capped``, and the reward metrics over every
        group generated (those set aside included: what the policy did, and what the no-signal watch reads)."""
        rewards = [rollout_rewards(b) for b, _ in self.parts]
        groups = [np.array([r.group_id for r in b.rollouts], dtype=object) for b, _ in self.parts]
        generated = reward_metrics(
            np.concatenate(rewards) if rewards else np.zeros(0, np.float32),
            np.concatenate(groups) if groups else np.zeros(0, object),
            solved_at,
        )
        return {
            **generated,
            "filtered_groups": float(self.filtered),
            "gen_batches": float(self.rounds),
            "filter_groups_capped": float(self.capped),
        }
