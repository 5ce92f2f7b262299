"""lightning_grpc.training.ppo against verl 0.9.1's own functions, on the same seeded random tensors.

Runs where verl is installed: `make verl-parity` (which builds .venv-verl with `make verl-env` first).
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import pytest
import torch
from torch.testing import assert_close

verl = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not installed in this environment; `make verl-parity` runs this test in .venv-verl",
)

from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from lightning_grpc.training import ppo  # noqa: E402

VERL_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
ROWS, LENGTH = 16, 11
GLOBAL_BATCH_INFO = {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 40, "loss_scale_factor": 7}


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def ragged_mask(rng: torch.Generator, *, empty_row: bool) -> torch.Tensor:
    """Right-padded response masks of lengths 1..LENGTH, with a hole (an observation) in rows longer than 2."""
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=rng)
    mask = (torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)).float()
    mask[lengths > 2, 1] = 0.0
    if empty_row:
        mask[-1] = 0.0
    return mask


def actor_config(loss_agg_mode: str, **global_batch_info: int) -> ActorConfig:
    config = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=4,
        rollout_n=4,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=loss_agg_mode,
    )
    config.global_batch_info.update(global_batch_info)
    return config


class PolicyInputs(TypedDict):
    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor


def policy_inputs(rng: torch.Generator) -> PolicyInputs:
    """Log-prob gaps wide enough to land tokens in every region, dual clip included (ratio > 3)."""
    mask = ragged_mask(rng, empty_row=True)
    old_log_prob = -torch.rand(ROWS, LENGTH, generator=rng) * 4
    log_prob = old_log_prob + torch.randn(ROWS, LENGTH, generator=rng) * 0.8
    advantages = torch.randn(ROWS, 1, generator=rng).expand(ROWS, LENGTH) * mask
    return {
        "old_log_prob": old_log_prob,
        "log_prob": log_prob,
        "advantages": advantages,
        "response_mask": mask,
    }


# --- advantages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_adv_by_std_in_grpo", [True, False])
def test_grpo_advantage_matches_verl(norm_adv_by_std_in_grpo: bool) -> None:
    rng = generator()
    mask = ragged_mask(rng, empty_row=False)
    rewards = torch.rand(ROWS, generator=rng)
    rewards[8:12] = 0.5  # a group of equal rewards
    uids = [f"g{row // 4}" for row in range(ROWS - 1)] + ["singleton"]
    last_token = (mask * torch.arange(LENGTH)).argmax(dim=-1)
    token_level_rewards = torch.zeros(ROWS, LENGTH)
    token_level_rewards[torch.arange(ROWS), last_token] = rewards

    theirs, returns = verl.compute_grpo_outcome_advantage(
        token_level_rewards,
        mask,
        np.array(uids, dtype=object),
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    per_rollout = ppo.grpo_outcome_advantage(rewards, uids, 1e-6, norm_adv_by_std_in_grpo)
    ours = ppo.broadcast_to_rows(per_rollout, torch.arange(ROWS), mask)

    assert_close(ours, theirs, rtol=0, atol=0)
    assert_close(ours, returns, rtol=0, atol=0)


# --- policy loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("global_batch_info", [{}, GLOBAL_BATCH_INFO], ids=["local", "global"])
@pytest.mark.parametrize("with_weights", [False, True], ids=["plain", "is-weights"])
@pytest.mark.parametrize("mode", VERL_MODES)
def test_policy_loss_matches_verl_vanilla(
    mode: str, with_weights: bool, global_batch_info: dict[str, int]
) -> None:
    rng = generator()
    inputs = policy_inputs(rng)
    weights = torch.rand(ROWS, LENGTH, generator=rng) * 2 if with_weights else None
    ratio = (inputs["log_prob"] - inputs["old_log_prob"]).exp()[inputs["response_mask"].bool()]
    assert (ratio > 3).any() and (ratio > 1.28).any() and (ratio < 0.8).any()

    theirs, their_metrics = verl.compute_policy_loss_vanilla(
        **inputs,
        loss_agg_mode=mode,
        config=actor_config(mode, **global_batch_info),
        rollout_is_weights=weights,
    )
    ours, our_metrics = ppo.compute_policy_loss(
        **inputs,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,  # type: ignore[arg-type]
        rollout_is_weights=weights,
        **global_batch_info,  # type: ignore[arg-type]
    )

    assert_close(ours, theirs)
    assert our_metrics == pytest.approx({name.removeprefix("actor/"): v for name, v in their_metrics.items()})
    assert our_metrics["pg_clipfrac_lower"] > 0


def test_policy_loss_gradients_match_verl() -> None:
    inputs = policy_inputs(generator())
    ours = inputs["log_prob"].clone().requires_grad_()
    theirs = inputs["log_prob"].clone().requires_grad_()
    old, advantages, mask = inputs["old_log_prob"], inputs["advantages"], inputs["response_mask"]
    ppo.compute_policy_loss(old, ours, advantages, mask, clip_ratio_high=0.28)[0].backward()
    verl.compute_policy_loss_vanilla(old, theirs, advantages, mask, config=actor_config("token-mean"))[
        0
    ].backward()
    assert_close(ours.grad, theirs.grad)


# --- aggregation, KL, entropy, log-probs ------------------------------------------------------------


@pytest.mark.parametrize("global_batch_info", [{}, GLOBAL_BATCH_INFO], ids=["local", "global"])
@pytest.mark.parametrize("mode", VERL_MODES)
def test_agg_loss_matches_verl(mode: str, global_batch_info: dict[str, int]) -> None:
    rng = generator()
    mask = ragged_mask(rng, empty_row=True)
    loss_mat = torch.randn(ROWS, LENGTH, generator=rng)
    theirs = verl.agg_loss(loss_mat, mask, mode, **global_batch_info)
    assert_close(ppo.agg_loss(loss_mat, mask, mode, **global_batch_info), theirs)  # type: ignore[arg-type]


def test_per_rollout_mean_of_one_row_rollouts_is_verls_seq_mean_token_mean() -> None:
    rng = generator()
    mask = ragged_mask(rng, empty_row=True)
    loss_mat = torch.randn(ROWS, LENGTH, generator=rng)
    theirs = verl.agg_loss(loss_mat, mask, "seq-mean-token-mean")
    ours = ppo.agg_loss(loss_mat, mask, "per-rollout-mean", rollout_index=torch.arange(ROWS))
    assert_close(ours, theirs)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty_matches_verl(kind: str) -> None:
    rng = generator()
    log_prob = -torch.rand(ROWS, LENGTH, generator=rng) * 6
    ref_log_prob = log_prob + torch.randn(ROWS, LENGTH, generator=rng) * 3  # some past the ±10 clamp
    ref_log_prob[0, :3] = torch.tensor([40.0, -40.0, 0.0])  # and past the ±20 log-ratio clamp
    theirs = verl.kl_penalty(log_prob, ref_log_prob, kind)
    assert_close(ppo.kl_penalty(log_prob, ref_log_prob, kind), theirs)  # type: ignore[arg-type]


def test_entropy_and_masked_mean_match_verl() -> None:
    rng = generator()
    logits = torch.randn(4, 5, 2048, generator=rng) * 3
    assert_close(ppo.entropy_from_logits(logits), verl_F.entropy_from_logits(logits))
    values, mask = torch.randn(ROWS, LENGTH, generator=rng), ragged_mask(rng, empty_row=True)
    assert_close(ppo.masked_mean(values, mask), verl_F.masked_mean(values, mask))
    assert_close(ppo.masked_mean(values, mask, axis=-1), verl_F.masked_mean(values, mask, axis=-1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_match_verl(temperature: float) -> None:
    rng = generator()
    logits = torch.randn(3, 7, 2048, generator=rng) * 3
    tokens = torch.randint(0, 2048, (3, 7), generator=rng)
    theirs = verl_F.logprobs_from_logits(logits / temperature, tokens)
    assert_close(ppo.token_log_probs(logits, tokens, temperature), theirs)


def test_actor_loss_composes_like_verls_ppo_loss() -> None:
    """verl's ``losses.ppo_loss`` needs its engine's no-padding batches; this composes its parts the same way."""
    rng = generator()
    inputs = policy_inputs(rng)
    entropy = torch.rand(ROWS, LENGTH, generator=rng) * 5
    ref_log_prob = inputs["log_prob"] + torch.randn(ROWS, LENGTH, generator=rng) * 0.3
    mode: ppo.LossAggMode = "seq-mean-token-mean"
    config = ppo.PPOConfig(clip_ratio_high=0.28, loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True)

    pg_loss, _ = verl.compute_policy_loss_vanilla(**inputs, loss_agg_mode=mode, config=actor_config(mode))
    mask = inputs["response_mask"]
    kl = verl.kl_penalty(inputs["log_prob"], ref_log_prob, "low_var_kl")
    theirs = pg_loss - 0.01 * verl.agg_loss(entropy, mask, mode) + 0.001 * verl.agg_loss(kl, mask, mode)

    ours, _ = ppo.compute_actor_loss(config, **inputs, entropy=entropy, ref_log_prob=ref_log_prob)
    assert_close(ours, theirs)
