"""The math of one GRPO/PPO actor update, in plain torch, with verl 0.9.1's names and semantics.

Every function names its counterpart in ``verl.trainer.ppo.core_algos`` (``core_algos``),
``verl.utils.torch_functional`` (``verl_F``) or ``verl.workers.utils.losses`` (``losses``) and computes
the same numbers (``tests/training/test_verl_parity.py`` checks them against verl itself); verl is never imported
here. One addition of ours: the ``"per-rollout-mean"`` loss aggregation, where each rollout gets equal
total weight however many rows and tokens it has (agent-lightning's ``per_rollout_mean`` loss).

Shapes: ``R`` rollouts, ``B`` rows (a rollout may span several rows), ``L`` response tokens per row,
``V`` vocabulary entries. Masks are ``[B, L]``, bool or 0/1, 1 on the tokens the policy generated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict, TypeVar, Unpack, get_args

from lightning_grpc._extras import extra_imports

with extra_imports("train"):
    import numpy as np
    import torch
    from torch import Tensor

LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "per-rollout-mean",
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

KlPenaltyKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
KL_PENALTY_KINDS: tuple[str, ...] = get_args(KlPenaltyKind)

#: verl clamps the log-ratio before exponentiating it (both in the surrogate and in low_var_kl).
_LOG_RATIO_BOUND = 20.0
#: verl clamps the low_var_kl estimate to [-10, 10].
_LOW_VAR_KL_BOUND = 10.0
#: Logit elements ``token_log_probs`` turns into float32 at once (64 MiB), whatever the vocabulary.
_LOG_PROB_CHUNK_ELEMENTS = 1 << 24

_Normaliser = TypeVar("_Normaliser", bound=int | Tensor)


class BatchInfo(TypedDict, total=False):
    """Normalisers of a loss over the global batch, as verl's ``ActorConfig.global_batch_info`` holds them.

    Left out, each is computed from the micro-batch at hand (only allowed with ``dp_size == 1``).
    ``global_batch_size`` counts rows in the ``seq-mean-*`` modes and rollouts in ``per-rollout-mean``.
    ``rollout_index`` (``[B]`` int, the rollout of each row, required by ``per-rollout-mean``) and
    ``rollout_num_tokens`` (``[R]``, each rollout's response tokens over the whole global batch) are ours.
    """

    dp_size: int
    batch_num_tokens: int | Tensor | None
    global_batch_size: int | Tensor | None
    loss_scale_factor: float | None
    rollout_index: Tensor | None
    rollout_num_tokens: Tensor | None


@dataclass(frozen=True)
class PPOConfig:
    """The knobs of a GRPO/PPO actor update, named as in verl's ``ActorConfig`` and ``AlgoConfig``.

    Defaults are verl 0.9.1's. ``epsilon`` and ``norm_adv_by_std_in_grpo`` are the GRPO advantage's
    (``algorithm.norm_adv_by_std_in_grpo``); the rest are ``actor_rollout_ref.actor.*``.
    """

    clip_ratio_low: float = field(
        default=0.2, metadata={"help": "The ratio is clipped below at 1 - clip_ratio_low."}
    )
    clip_ratio_high: float = field(
        default=0.2, metadata={"help": "The ratio is clipped above at 1 + clip_ratio_high."}
    )
    clip_ratio_c: float = field(
        default=3.0, metadata={"help": "Dual-clip bound on the loss of negative advantages (> 1)."}
    )
    loss_agg_mode: LossAggMode = field(
        default="token-mean",
        metadata={"help": "How token losses are averaged into the batch loss (per-rollout-mean: ours)."},
    )
    use_kl_loss: bool = field(
        default=False, metadata={"help": "Add a KL loss against a frozen copy of the starting model."}
    )
    kl_loss_coef: float = field(default=0.001, metadata={"help": "Weight of the KL loss."})
    kl_loss_type: KlPenaltyKind = field(
        default="low_var_kl", metadata={"help": "The KL estimator of the KL loss."}
    )
    entropy_coeff: float = field(default=0.0, metadata={"help": "Weight of the entropy bonus (0: none)."})
    norm_adv_by_std_in_grpo: bool = field(
        default=True, metadata={"help": "Divide each GRPO advantage by its group's reward std."}
    )
    epsilon: float = field(default=1e-6, metadata={"help": "Added to the group std before dividing by it."})

    def __post_init__(self) -> None:
        for flag in ("use_kl_loss", "norm_adv_by_std_in_grpo"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        for number in _PPO_NUMBERS:
            value = getattr(self, number)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{number} must be a finite number, got {value!r}")
        _require(0.0 <= self.clip_ratio_low < 1.0, "clip_ratio_low", "must be in [0, 1)", self.clip_ratio_low)
        _require(self.clip_ratio_high >= 0.0, "clip_ratio_high", "must be >= 0", self.clip_ratio_high)
        _require(self.clip_ratio_c > 1.0, "clip_ratio_c", "must be > 1 (dual-clip PPO)", self.clip_ratio_c)
        _require(
            self.loss_agg_mode in LOSS_AGG_MODES,
            "loss_agg_mode",
            f"must be one of {LOSS_AGG_MODES}",
            self.loss_agg_mode,
        )
        _require(
            self.kl_loss_type in KL_PENALTY_KINDS,
            "kl_loss_type",
            f"must be one of {KL_PENALTY_KINDS}",
            self.kl_loss_type,
        )
        _require(self.kl_loss_coef >= 0.0, "kl_loss_coef", "must be >= 0", self.kl_loss_coef)
        _require(self.entropy_coeff >= 0.0, "entropy_coeff", "must be >= 0", self.entropy_coeff)
        _require(self.epsilon > 0.0, "epsilon", "must be > 0", self.epsilon)


_PPO_NUMBERS = (
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "kl_loss_coef",
    "entropy_coeff",
    "epsilon",
)


def _require(holds: bool, name: str, rule: str, value: object) -> None:
    if not holds:
        raise ValueError(f"{name} {rule}, got {value!r}")


# --- advantages -------------------------------------------------------------------------------------


def grpo_outcome_advantage(
    rewards: Tensor,
    group_index: Sequence[str] | np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Tensor:
    """One GRPO advantage per rollout: its reward less its group's mean, over the group's std.

    verl: ``core_algos.compute_grpo_outcome_advantage`` on the summed token-level rewards, before its
    broadcast over the response mask (see ``broadcast_to_rows``). The std is ``torch.std`` (unbiased);
    a group of one rollout gets mean 0 and std 1, so its advantage is ``reward / (1 + epsilon)``, not 0;
    a group of equal rewards gets advantage 0. ``norm_adv_by_std_in_grpo=False`` is Dr. GRPO (no std).

    rewards: ``[R]`` float; group_index: ``R`` group ids (verl's ``uid``).
    """
    if rewards.dim() != 1 or len(group_index) != rewards.shape[0]:
        raise ValueError(
            f"rewards must be [R] with one group id each, got {tuple(rewards.shape)} and {len(group_index)} ids"
        )
    advantages = torch.empty_like(rewards)
    with torch.no_grad():
        for members in _members_by_group(group_index):
            scores = rewards[members]
            mean, std = _group_mean_std(scores)
            centred = scores - mean
            advantages[members] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    return advantages


def _members_by_group(group_index: Sequence[str] | np.ndarray) -> list[Tensor]:
    members: dict[object, list[int]] = {}
    for position, group in enumerate(group_index):
        members.setdefault(group, []).append(position)
    return [torch.tensor(positions, dtype=torch.long) for positions in members.values()]


def _group_mean_std(scores: Tensor) -> tuple[Tensor, Tensor]:
    if scores.numel() == 1:
        return torch.tensor(0.0), torch.tensor(1.0)
    return torch.mean(scores), torch.std(scores)


def broadcast_to_rows(per_rollout: Tensor, rollout_index: Tensor, response_mask: Tensor) -> Tensor:
    """Spread one value per rollout over the response tokens of each of its rows: ``[B, L]``.

    verl: the ``scores.unsqueeze(-1) * response_mask`` ending ``compute_grpo_outcome_advantage``, done
    per rollout as agent-lightning's rollout-level advantage does. rollout_index: ``[B]`` int in ``[0, R)``.
    """
    return per_rollout[rollout_index].unsqueeze(-1) * response_mask


# --- masked reductions ------------------------------------------------------------------------------


def masked_sum(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set; NaNs outside the mask do not leak. verl: ``verl_F.masked_sum``."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=axis)


def masked_mean(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is set (0 for an empty mask). verl: ``verl_F.masked_mean``."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: LossAggMode,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
    rollout_index: Tensor | None = None,
    rollout_num_tokens: Tensor | None = None,
) -> Tensor:
    """Reduce a ``[B, L]`` per-token loss to a scalar. verl: ``core_algos.agg_loss`` (0.9.1 signature).

    - ``token-mean``: sum over masked tokens / ``batch_num_tokens``;
    - ``token-sum``: sum over masked tokens;
    - ``seq-mean-token-sum``: per row, sum over its tokens; summed over rows with a token, / ``global_batch_size``;
    - ``seq-mean-token-mean``: the same with each row's token mean;
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / ``loss_scale_factor`` (default ``L``);
    - ``per-rollout-mean`` (ours): each rollout's token sum / its ``rollout_num_tokens``, summed over
      rollouts and / ``global_batch_size`` (the number of rollouts with a token): each rollout weighs
      the same whatever its rows and lengths.

    Each result is multiplied by ``dp_size``, because data-parallel training averages gradients over ranks.
    Normalisers left out are counted in this micro-batch, which verl refuses when ``dp_size > 1``.
    """
    if loss_agg_mode == "token-mean":
        batch_num_tokens = _local_unless_given(batch_num_tokens, "batch_num_tokens", dp_size, loss_mask.sum)
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        loss = _seq_mean(loss_mat, loss_mask, loss_agg_mode, dp_size, global_batch_size)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "per-rollout-mean":
        if rollout_index is None:
            raise ValueError("loss_agg_mode 'per-rollout-mean' needs rollout_index")
        return _per_rollout_mean(
            loss_mat, loss_mask, rollout_index, dp_size, global_batch_size, rollout_num_tokens
        )
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def _local_unless_given(
    given: _Normaliser | None, name: str, dp_size: int, count_locally: Callable[[], Tensor]
) -> _Normaliser | Tensor:
    """A global normaliser if given, else counted in this micro-batch, which only one rank may do."""
    if given is not None:
        return given
    if dp_size > 1:
        raise ValueError(f"(global) {name} is required when dp_size > 1")
    return count_locally()


def _seq_mean(
    loss_mat: Tensor, loss_mask: Tensor, mode: str, dp_size: int, global_batch_size: int | Tensor | None
) -> Tensor:
    row_tokens = torch.sum(loss_mask, dim=-1)
    row_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    if mode == "seq-mean-token-mean":
        row_losses = row_losses / (row_tokens + 1e-8)
    rows_with_tokens = (row_tokens > 0).float()
    global_batch_size = _local_unless_given(
        global_batch_size, "global_batch_size", dp_size, rows_with_tokens.sum
    )
    return masked_sum(row_losses, rows_with_tokens) / global_batch_size * dp_size


def _per_rollout_mean(
    loss_mat: Tensor,
    loss_mask: Tensor,
    rollout_index: Tensor,
    dp_size: int,
    num_rollouts: int | Tensor | None,
    rollout_num_tokens: Tensor | None,
) -> Tensor:
    tokens = _local_unless_given(
        rollout_num_tokens,
        "rollout_num_tokens",
        dp_size,
        lambda: count_rollout_tokens(rollout_index, loss_mask),
    )
    num_rollouts = _local_unless_given(num_rollouts, "global_batch_size", dp_size, lambda: (tokens > 0).sum())
    row_losses = masked_sum(loss_mat, loss_mask, axis=-1) / tokens[rollout_index].clamp(min=1)
    return row_losses.sum() / num_rollouts * dp_size


def count_rollout_tokens(
    rollout_index: Tensor, response_mask: Tensor, num_rollouts: int | None = None
) -> Tensor:
    """Response tokens of each rollout, over its rows: ``[R]`` float32 (``R = num_rollouts`` or the largest index + 1).

    Counted over a whole mini-batch, it is the ``rollout_num_tokens`` that ``per-rollout-mean`` needs when
    the mini-batch is split into micro-batches.
    """
    size = int(rollout_index.max()) + 1 if num_rollouts is None else num_rollouts
    row_tokens = response_mask.sum(dim=-1).to(torch.float32)
    return torch.zeros(size, dtype=torch.float32, device=rollout_index.device).index_add_(
        0, rollout_index, row_tokens
    )


# --- losses -----------------------------------------------------------------------------------------


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    rollout_is_weights: Tensor | None = None,
    **batch_info: Unpack[BatchInfo],
) -> tuple[Tensor, dict[str, float]]:
    """The dual-clip PPO surrogate, aggregated. verl: ``core_algos.compute_policy_loss_vanilla``.

    Per token, with ``ratio = exp(clamp(log_prob - old_log_prob, ±20))`` and advantage ``A``:
    ``max(-A·ratio, -A·clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``, and where ``A < 0`` at most
    ``-A·clip_ratio_c``. Then times ``rollout_is_weights`` (rollout-correction importance weights,
    ``[B, L]``) if given, then ``agg_loss``. Metrics (masked means, as verl's ``actor/*``): ``pg_clipfrac``
    (tokens where the clip bound), ``pg_clipfrac_lower`` (where the dual clip bound), ``ppo_kl``
    (mean of ``old_log_prob - log_prob``).
    """
    _require(clip_ratio_c > 1.0, "clip_ratio_c", "must be > 1 (dual-clip PPO)", clip_ratio_c)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_loss = torch.maximum(unclipped, clipped)
    dual_clip_bound = -advantages * clip_ratio_c
    is_negative = advantages < 0
    pg_losses = torch.where(is_negative, torch.min(dual_clip_bound, clipped_loss), clipped_loss)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    metrics = {
        "pg_clipfrac": masked_mean(torch.gt(clipped, unclipped).float(), response_mask),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
        "pg_clipfrac_lower": masked_mean(
            torch.gt(clipped_loss, dual_clip_bound) * is_negative.float(), response_mask
        ),
    }
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **batch_info)
    return loss, {name: value.detach().item() for name, value in metrics.items()}


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kl_penalty: KlPenaltyKind = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy ‖ reference). verl: ``core_algos.kl_penalty`` (without the ``+`` kinds).

    ``kl``/``k1``: ``log_prob - ref_log_prob``; ``abs``: its absolute value; ``mse``/``k2``: half its
    square; ``low_var_kl``/``k3``: ``exp(d) - d - 1`` with ``d = clamp(ref_log_prob - log_prob, ±20)``,
    clamped to ``[-10, 10]``.
    """
    difference = log_prob - ref_log_prob
    if kl_penalty in ("kl", "k1"):
        return difference
    if kl_penalty == "abs":
        return difference.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * difference.square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_log_prob - log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
        estimate = torch.exp(log_ratio) - log_ratio - 1
        return torch.clamp(estimate, min=-_LOW_VAR_KL_BOUND, max=_LOW_VAR_KL_BOUND)
    raise ValueError(f"kl_penalty must be one of {KL_PENALTY_KINDS}, got {kl_penalty!r}")


def compute_actor_loss(
    config: PPOConfig,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    entropy: Tensor | None = None,
    ref_log_prob: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    **batch_info: Unpack[BatchInfo],
) -> tuple[Tensor, dict[str, float]]:
    """The actor's loss: policy loss − ``entropy_coeff``·entropy + ``kl_loss_coef``·KL. verl: ``losses.ppo_loss``.

    The entropy term is added when ``entropy`` (``[B, L]``) is given, the KL term when ``use_kl_loss``
    (then ``ref_log_prob`` is required); both are aggregated with the same mode and normalisers.
    Metrics: the policy loss's, plus ``pg_loss``, ``entropy_loss``, ``kl_loss``, ``kl_coef`` as computed.
    """
    if config.use_kl_loss and ref_log_prob is None:
        raise ValueError("use_kl_loss needs ref_log_prob")
    pg_loss, metrics = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=config.loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        **batch_info,
    )
    metrics["pg_loss"] = pg_loss.detach().item()
    loss = pg_loss
    if entropy is not None:
        entropy_loss = agg_loss(entropy, response_mask, config.loss_agg_mode, **batch_info)
        loss = loss - config.entropy_coeff * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach().item()
    if config.use_kl_loss and ref_log_prob is not None:
        kl = kl_penalty(log_prob, ref_log_prob, config.kl_loss_type)
        kl_loss = agg_loss(kl, response_mask, config.loss_agg_mode, **batch_info)
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach().item()
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics


# --- from logits ------------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last axis: ``[..., V] -> [...]``. verl: ``verl_F.entropy_from_logits``."""
    probabilities = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probabilities * logits, dim=-1)


def token_log_probs(logits: Tensor, tokens: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """Log-probabilities (float32) of ``tokens`` under ``softmax(logits / temperature)``: ``[..., V] -> [...]``.

    verl: the actor's ``logits.div_(temperature)`` then ``verl_F.logprobs_from_logits``. Computed as
    ``logit - logsumexp(logits)`` a chunk of positions at a time, so that without autograd (old and
    reference log-probs) the float32 copy of the logits held at once stays near 64 MiB whatever the
    vocabulary (2k to 150k entries); with autograd, backward keeps one float32 copy, as log_softmax would.

    ``temperature``: one number, or one per row (a tensor of shape ``tokens.shape[:1]``, such as a batch's
    recorded ``temperatures``): row ``i`` under ``softmax(logits[i] / temperature[i])``.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_tokens = tokens.reshape(-1)
    chunk = max(1, _LOG_PROB_CHUNK_ELEMENTS // vocab)
    logit_chunks, token_chunks = flat_logits.split(chunk), flat_tokens.split(chunk)
    divisors: Sequence[float | Tensor]
    if isinstance(temperature, Tensor):
        per_row = _row_temperatures(temperature, tokens)
        per_position = per_row.reshape(-1, *([1] * (tokens.dim() - 1))).expand(tokens.shape).reshape(-1, 1)
        divisors = per_position.split(chunk)
    else:
        _require(temperature > 0.0, "temperature", "must be > 0", temperature)
        divisors = [temperature] * len(token_chunks)
    pieces = [
        _chunk_log_probs(logit_chunk, token_chunk, divisor)
        for logit_chunk, token_chunk, divisor in zip(logit_chunks, token_chunks, divisors, strict=True)
    ]
    return torch.cat(pieces).reshape(tokens.shape)


def scale_logits(logits: Tensor, temperature: float | Tensor) -> Tensor:
    """``logits / temperature``: one number, or one per row (shape ``logits.shape[:1]``) over ``[B, ..., V]``."""
    if isinstance(temperature, Tensor):
        per_row = _row_temperatures(temperature, logits)
        return logits / per_row.reshape(-1, *([1] * (logits.dim() - 1))).to(logits.dtype)
    _require(temperature > 0.0, "temperature", "must be > 0", temperature)
    return logits / temperature


def _row_temperatures(temperature: Tensor, rows_of: Tensor) -> Tensor:
    _require(
        temperature.dim() == 1 and temperature.shape[0] == rows_of.shape[0],
        "temperature",
        f"must be one per row ({rows_of.shape[0]})",
        tuple(temperature.shape),
    )
    _require(bool((temperature > 0.0).all()), "temperature", "must be > 0 on every row", temperature.tolist())
    return temperature.float()


def _chunk_log_probs(logits: Tensor, tokens: Tensor, temperature: float | Tensor) -> Tensor:
    scaled = logits.float() / temperature
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(scaled, dim=-1)
