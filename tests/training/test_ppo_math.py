"""The GRPO/PPO update math of lightning_grpc.training.ppo, on tiny tensors with values worked out by hand.

Expected numbers come from the formulas (written out below), never from the code under test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

from lightning_grpc.training.ppo import (
    PPOConfig,
    agg_loss,
    broadcast_to_rows,
    compute_actor_loss,
    compute_policy_loss,
    count_rollout_tokens,
    entropy_from_logits,
    grpo_outcome_advantage,
    kl_penalty,
    masked_mean,
    token_log_probs,
)

LN2 = math.log(2.0)


def tensor(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- GRPO advantages --------------------------------------------------------------------------------


def test_grpo_advantage_is_reward_less_group_mean_over_unbiased_std() -> None:
    # Group "a" = 1, 2, 3, 4 (interleaved with "b"): mean 2.5, unbiased std sqrt(5/3).
    rewards = tensor([1.0, 7.0, 2.0, 3.0, 9.0, 4.0])
    groups = ["a", "b", "a", "a", "b", "a"]
    std_a = math.sqrt((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 3)
    std_b = math.sqrt((1.0**2 + 1.0**2) / 1)  # 7 and 9: mean 8
    expected = [-1.5 / (std_a + 1e-6), -1 / (std_b + 1e-6), -0.5 / (std_a + 1e-6)]
    expected += [0.5 / (std_a + 1e-6), 1 / (std_b + 1e-6), 1.5 / (std_a + 1e-6)]
    assert_close(grpo_outcome_advantage(rewards, groups), tensor(expected))


def test_grpo_singleton_group_keeps_its_reward_over_one_plus_epsilon() -> None:
    # verl gives a group of one mean 0 and std 1: the advantage is not 0.
    advantages = grpo_outcome_advantage(tensor([0.8, 1.0, 0.0]), ["solo", "pair", "pair"], epsilon=1e-6)
    assert_close(advantages[0], tensor(0.8 / (1 + 1e-6)))


def test_grpo_equal_rewards_give_zero_advantage() -> None:
    advantages = grpo_outcome_advantage(tensor([0.5, 0.5, 0.5, 0.5]), ["g"] * 4)
    assert_close(advantages, torch.zeros(4))


def test_grpo_without_std_normalisation_only_centres() -> None:
    advantages = grpo_outcome_advantage(
        tensor([1.0, 2.0, 3.0, 4.0, 0.8]), ["a"] * 4 + ["solo"], norm_adv_by_std_in_grpo=False
    )
    assert_close(advantages, tensor([-1.5, -0.5, 0.5, 1.5, 0.8]))


def test_grpo_rejects_a_group_id_count_that_differs_from_the_rewards() -> None:
    with pytest.raises(ValueError, match="one group id each"):
        grpo_outcome_advantage(tensor([1.0, 2.0]), ["a"])


def test_broadcast_puts_each_rollouts_advantage_on_its_rows_masked_tokens() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0]])
    rows = broadcast_to_rows(tensor([0.5, -2.0]), torch.tensor([0, 0, 1]), mask)
    assert_close(rows, tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [-2.0, 0.0, 0.0]]))


# --- clipped surrogate ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "clipfrac", "clipfrac_lower"),
    [
        pytest.param(1.1, 2.0, -2.2, 0.0, 0.0, id="inside-the-clip-range"),
        pytest.param(1.5, 1.0, -1.2, 1.0, 0.0, id="above-1+eps-positive-advantage-clipped"),
        pytest.param(0.5, -1.0, 0.8, 1.0, 0.0, id="below-1-eps-negative-advantage-clipped"),
        pytest.param(4.0, -1.0, 3.0, 0.0, 1.0, id="dual-clip-negative-advantage-ratio-above-c"),
        pytest.param(2.0, -1.0, 2.0, 0.0, 0.0, id="above-1+eps-negative-advantage-not-clipped"),
        pytest.param(0.5, 1.0, -0.5, 0.0, 0.0, id="below-1-eps-positive-advantage-not-clipped"),
    ],
)
def test_clipped_surrogate_in_each_region(
    ratio: float, advantage: float, loss: float, clipfrac: float, clipfrac_lower: float
) -> None:
    # loss = max(-A·r, -A·clip(r, 0.8, 1.2)), and for A < 0 at most -A·3.
    old = tensor([[-1.0]])
    new = old + math.log(ratio)
    value, metrics = compute_policy_loss(old, new, tensor([[advantage]]), torch.ones(1, 1))
    assert_close(value, tensor(loss))
    assert metrics["pg_clipfrac"] == pytest.approx(clipfrac, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(clipfrac_lower, abs=1e-6)
    assert metrics["ppo_kl"] == pytest.approx(-math.log(ratio), abs=1e-6)


def test_asymmetric_clip_uses_the_high_bound_above_and_the_low_bound_below() -> None:
    old = torch.zeros(1, 2)
    new = tensor([[math.log(1.5), math.log(0.5)]])
    value, _ = compute_policy_loss(
        old, new, tensor([[1.0, -1.0]]), torch.ones(1, 2), clip_ratio_low=0.1, clip_ratio_high=0.28
    )
    assert_close(value, tensor((-1.28 + 0.9) / 2))


def test_policy_loss_token_mean_skips_masked_tokens_and_applies_importance_weights() -> None:
    old = torch.zeros(1, 3)
    new = tensor([[math.log(1.1), math.log(1.5), 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    weights = tensor([[2.0, 0.5, 7.0]])
    value, metrics = compute_policy_loss(
        old, new, tensor([[1.0, 1.0, 1.0]]), mask, rollout_is_weights=weights
    )
    assert_close(value, tensor((-1.1 * 2.0 + -1.2 * 0.5) / 2))
    assert metrics["pg_clipfrac"] == pytest.approx(0.5, abs=1e-6)


def test_policy_loss_rejects_a_dual_clip_bound_of_one_or_less() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=1.0
        )


# --- loss aggregation -------------------------------------------------------------------------------

LOSS = tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
RAGGED = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # 3 tokens, 1 token, none


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 5) / 4),
        ("token-sum", 1 + 2 + 3 + 5),
        ("seq-mean-token-sum", (6 + 5) / 2),  # the empty row does not count
        ("seq-mean-token-mean", (2 + 5) / 2),
        ("seq-mean-token-sum-norm", (6 + 5) / 2 / 4),  # / L
    ],
)
def test_agg_loss_modes_on_a_ragged_mask(mode: str, expected: float) -> None:
    assert_close(agg_loss(LOSS, RAGGED, mode), tensor(expected))  # type: ignore[arg-type]


def test_agg_loss_uses_global_normalisers_and_multiplies_by_dp_size() -> None:
    assert_close(agg_loss(LOSS, RAGGED, "token-mean", dp_size=2, batch_num_tokens=8), tensor(11 / 8 * 2))
    assert_close(
        agg_loss(LOSS, RAGGED, "seq-mean-token-mean", dp_size=2, global_batch_size=4), tensor(7 / 4 * 2)
    )
    assert_close(agg_loss(LOSS, RAGGED, "seq-mean-token-sum-norm", loss_scale_factor=2), tensor(11 / 2 / 2))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "per-rollout-mean"])
def test_agg_loss_refuses_local_normalisers_with_several_ranks(mode: str) -> None:
    with pytest.raises(ValueError, match="required when dp_size > 1"):
        agg_loss(LOSS, RAGGED, mode, dp_size=2, rollout_index=torch.tensor([0, 0, 1]))  # type: ignore[arg-type]


def test_agg_loss_token_mean_ignores_nan_outside_the_mask() -> None:
    loss = tensor([[1.0, float("nan")], [3.0, float("inf")]])
    assert_close(agg_loss(loss, torch.tensor([[1, 0], [1, 0]]), "token-mean"), tensor(2.0))


def test_agg_loss_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, RAGGED, "mean")  # type: ignore[arg-type]


# Rollout 0: two rows, 3 + 1 tokens of loss 1; rollout 1: one row, 1 token of loss 3.
ROLLOUT_LOSS = tensor([[1.0, 1.0, 1.0], [1.0, 9.0, 9.0], [3.0, 9.0, 9.0]])
ROLLOUT_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]])
ROLLOUT_INDEX = torch.tensor([0, 0, 1])


def test_per_rollout_mean_averages_each_rollouts_token_mean() -> None:
    # (mean of rollout 0 = 1, mean of rollout 1 = 3) / 2 rollouts; token-mean would give (4·1 + 3) / 5.
    value = agg_loss(ROLLOUT_LOSS, ROLLOUT_MASK, "per-rollout-mean", rollout_index=ROLLOUT_INDEX)
    assert_close(value, tensor(2.0))
    assert_close(agg_loss(ROLLOUT_LOSS, ROLLOUT_MASK, "token-mean"), tensor(7 / 5))


def test_per_rollout_mean_gives_rollouts_of_different_rows_and_lengths_equal_weight() -> None:
    loss = ROLLOUT_LOSS.clone().requires_grad_()
    agg_loss(loss, ROLLOUT_MASK, "per-rollout-mean", rollout_index=ROLLOUT_INDEX).backward()
    assert loss.grad is not None
    per_token = tensor([[1 / 8, 1 / 8, 1 / 8], [1 / 8, 0, 0], [1 / 2, 0, 0]])  # 1 / (tokens · rollouts)
    assert_close(loss.grad, per_token)
    assert_close(loss.grad[:2].sum(), loss.grad[2].sum())


def test_per_rollout_mean_over_micro_batches_adds_up_with_global_normalisers() -> None:
    tokens = count_rollout_tokens(ROLLOUT_INDEX, ROLLOUT_MASK)
    assert_close(tokens, tensor([4.0, 1.0]))
    parts = [
        agg_loss(
            ROLLOUT_LOSS[rows],
            ROLLOUT_MASK[rows],
            "per-rollout-mean",
            rollout_index=ROLLOUT_INDEX[rows],
            rollout_num_tokens=tokens,
            global_batch_size=2,
        )
        for rows in (slice(0, 1), slice(1, 3))  # rollout 0 split across the two
    ]
    assert_close(parts[0], tensor(3 / 4 / 2))
    assert_close(sum(parts), tensor(2.0))


def test_per_rollout_mean_needs_the_rollout_of_each_row() -> None:
    with pytest.raises(ValueError, match="rollout_index"):
        agg_loss(ROLLOUT_LOSS, ROLLOUT_MASK, "per-rollout-mean")


# --- KL, entropy, log-probs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("log_prob", "ref_log_prob", "expected"),
    [
        (0.0, LN2, 2 - LN2 - 1),  # exp(d) - d - 1 with d = ref - log_prob = ln 2
        (LN2, 0.0, 0.5 + LN2 - 1),  # d = -ln 2
        (-1.3, -1.3, 0.0),
        (0.0, 15.0, 10.0),  # exp(15) - 16, clamped to 10
        (0.0, -30.0, 10.0),  # d clamped to -20: exp(-20) + 19, clamped to 10
    ],
)
def test_low_var_kl(log_prob: float, ref_log_prob: float, expected: float) -> None:
    assert_close(kl_penalty(tensor([log_prob]), tensor([ref_log_prob]), "low_var_kl"), tensor([expected]))
    assert_close(kl_penalty(tensor([log_prob]), tensor([ref_log_prob]), "k3"), tensor([expected]))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("kl", -0.5), ("k1", -0.5), ("abs", 0.5), ("mse", 0.125), ("k2", 0.125)],
)
def test_other_kl_estimators(kind: str, expected: float) -> None:
    assert_close(kl_penalty(tensor([-1.5]), tensor([-1.0]), kind), tensor([expected]))  # type: ignore[arg-type]


def test_kl_penalty_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kl_penalty"):
        kl_penalty(tensor([0.0]), tensor([0.0]), "full")  # type: ignore[arg-type]


def test_entropy_from_logits() -> None:
    logits = torch.log(tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.25, 1e-30]]))
    assert_close(entropy_from_logits(logits), tensor([math.log(4), 0.5 * LN2 + 0.5 * math.log(4)]))


def test_masked_mean_ignores_masked_values_and_is_zero_on_an_empty_mask() -> None:
    assert_close(masked_mean(tensor([1.0, 2.0, 3.0, float("nan")]), torch.tensor([1, 1, 1, 0])), tensor(2.0))
    assert_close(masked_mean(tensor([5.0]), torch.tensor([0])), tensor(0.0))
    assert_close(
        masked_mean(tensor([[1.0, 3.0], [4.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]), axis=-1),
        tensor([2.0, 4.0]),
    )


def test_token_log_probs_at_temperature_07() -> None:
    logits = [[1.0, 2.0, 3.0], [0.0, -1.0, 5.0]]
    tokens = [0, 2]
    expected = []
    for row, token in zip(logits, tokens, strict=True):
        scaled = [value / 0.7 for value in row]
        expected.append(scaled[token] - math.log(sum(math.exp(value) for value in scaled)))
    assert_close(token_log_probs(tensor([logits]), torch.tensor([tokens]), 0.7), tensor([expected]))


def test_token_log_probs_over_a_large_vocabulary_in_chunks_matches_log_softmax() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 200, 40_000, generator=generator) * 4  # 600 positions: two chunks of 419 rows
    tokens = torch.randint(0, 40_000, (3, 200), generator=generator)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert_close(token_log_probs(logits, tokens, 0.7), expected)


def test_token_log_probs_returns_float32_and_carries_gradients() -> None:
    logits = torch.zeros(1, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    log_probs = token_log_probs(logits, torch.tensor([[1, 3]]))
    assert log_probs.dtype == torch.float32
    assert_close(log_probs, torch.full((1, 2), -math.log(4)))
    log_probs.sum().backward()
    assert logits.grad is not None


def test_token_log_probs_rejects_a_temperature_of_zero() -> None:
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(torch.zeros(1, 2), torch.tensor([0]), 0.0)


# --- the actor loss and its config ------------------------------------------------------------------


def test_actor_loss_adds_entropy_bonus_and_kl_loss_to_the_policy_loss() -> None:
    config = PPOConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    zero = torch.zeros(1, 2)
    loss, metrics = compute_actor_loss(
        config,
        zero,
        zero,
        tensor([[1.0, -1.0]]),  # ratio 1: per-token losses -1 and 1, mean 0
        torch.ones(1, 2),
        entropy=tensor([[2.0, 4.0]]),  # mean 3
        ref_log_prob=tensor([[LN2, 0.0]]),  # low_var_kl 1 - ln 2 and 0
    )
    kl_loss = (1 - LN2) / 2
    assert_close(loss, tensor(0 - 0.01 * 3 + 0.1 * kl_loss))
    assert metrics["pg_loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["entropy_loss"] == pytest.approx(3.0)
    assert metrics["kl_loss"] == pytest.approx(kl_loss, rel=1e-6)
    assert metrics["kl_coef"] == 0.1


def test_actor_loss_with_kl_needs_reference_log_probs() -> None:
    with pytest.raises(ValueError, match="ref_log_prob"):
        zero = torch.zeros(1, 1)
        compute_actor_loss(PPOConfig(use_kl_loss=True), zero, zero, zero, torch.ones(1, 1))


def test_ppo_config_defaults_are_verls() -> None:
    config = PPOConfig()
    assert (config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert (config.loss_agg_mode, config.kl_loss_type, config.kl_loss_coef) == (
        "token-mean",
        "low_var_kl",
        0.001,
    )
    assert (config.use_kl_loss, config.entropy_coeff, config.norm_adv_by_std_in_grpo) == (False, 0.0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.clip_ratio_c = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_ratio_low", 1.0),
        ("clip_ratio_low", -0.1),
        ("clip_ratio_high", -0.2),
        ("clip_ratio_c", 1.0),
        ("loss_agg_mode", "mean"),
        ("kl_loss_type", "k4"),
        ("kl_loss_coef", -0.001),
        ("entropy_coeff", float("nan")),
        ("epsilon", 0.0),
        ("use_kl_loss", "yes"),
        ("norm_adv_by_std_in_grpo", 1),
    ],
)
def test_ppo_config_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        PPOConfig(**{field: value})  # type: ignore[arg-type]
