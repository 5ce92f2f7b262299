"""The learner: one GRPO/PPO update of a causal LM from a batch of verl-shaped arrays, on CPU or GPU.

Advantages are computed once per rollout (its group's mean and spread over rollouts, not rows) and
broadcast to every row of the rollout; the loss is the dual-clip PPO surrogate of :mod:`.ppo` with
verl's knobs. Old log-probs are recomputed under the current weights, or taken from the proxy's
recorded ones (``old_log_probs="rollout"``, verl's bypass mode); the gap between the two is reported.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from . import ppo

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "trainer_config.json"


@dataclass(frozen=True)
class OptimConfig:
    """The optimiser and how a batch is used (verl's names where verl has one)."""

    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    #: Gradients are clipped to this total norm (0: no clipping).
    max_grad_norm: float = 1.0
    #: Passes over each batch (verl: ppo_epochs).
    ppo_epochs: int = 1
    #: Rollouts per optimiser step (0: the whole batch in one step).
    mini_batch_rollouts: int = 0
    #: The sampling temperature: log-probs are computed at it, as the engine sampled.
    temperature: float = 1.0
    #: "recompute" under the weights before the update, or "rollout": the proxy's recorded log-probs.
    old_log_probs: Literal["recompute", "rollout"] = "recompute"

    def __post_init__(self) -> None:
        checks = [
            ("lr", self.lr > 0 and math.isfinite(self.lr), "must be a positive number"),
            ("weight_decay", self.weight_decay >= 0, "must be at least 0"),
            ("max_grad_norm", self.max_grad_norm >= 0, "must be at least 0"),
            ("ppo_epochs", self.ppo_epochs >= 1, "must be at least 1"),
            ("mini_batch_rollouts", self.mini_batch_rollouts >= 0, "must be at least 0"),
            ("temperature", self.temperature > 0, "must be greater than 0"),
            (
                "old_log_probs",
                self.old_log_probs in ("recompute", "rollout"),
                "must be 'recompute' or 'rollout'",
            ),
        ]
        for name, holds, rule in checks:
            if not holds:
                raise ValueError(f"{name} {rule} (got {getattr(self, name)!r})")


@dataclass
class UpdateInput:
    """What an update needs of a batch (``TrainingBatch.arrays`` and ``uid`` fit it)."""

    arrays: Mapping[str, np.ndarray]
    #: The group id of each row.
    uid: np.ndarray
    rewards_solved_at: float = 1.0


@dataclass
class Learner:
    """A model, its optimiser (and an optional frozen reference for the KL loss), updated batch by batch."""

    model_path: str | Path
    ppo_config: ppo.PPOConfig = field(default_factory=ppo.PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    device: str | None = None
    seed: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        from transformers import AutoModelForCausalLM

        seed_everything(self.seed)
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=torch.float32)
        self.model.to(self.device)  # type: ignore[arg-type]
        self.model.train()
        self.reference = None
        if self.ppo_config.use_kl_loss:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.optim.lr,
            betas=self.optim.betas,
            weight_decay=self.optim.weight_decay,
        )

    # ------------------------------------------------------------ one update
    def update(self, batch: UpdateInput) -> dict[str, float]:
        """One PPO/GRPO update from a batch; returns its metrics."""
        started = time.perf_counter()
        t = self._tensors(batch.arrays)
        rewards, groups = rollout_rewards_and_groups(batch.arrays, batch.uid)
        metrics = reward_metrics(rewards.numpy(), groups, batch.rewards_solved_at)
        advantages = ppo.broadcast_to_rows(
            ppo.grpo_outcome_advantage(
                rewards,
                groups,
                epsilon=self.ppo_config.epsilon,
                norm_adv_by_std_in_grpo=self.ppo_config.norm_adv_by_std_in_grpo,
            ).to(self.device),
            t["rollout_index"],
            t["response_mask"],
        )
        one_pass = self.optim.ppo_epochs == 1 and self.optim.mini_batch_rollouts == 0
        with torch.no_grad():
            # One update over the whole batch starts from the current weights: its own forward pass gives
            # the old log-probs (ratio 1), so a separate pass is only made when there are several updates.
            recomputed = None if one_pass else self._log_probs(self.model, t, with_entropy=False)[0]
            reference = self._log_probs(self.reference, t, with_entropy=False)[0] if self.reference else None
        use_recorded = self.optim.old_log_probs == "rollout"
        if use_recorded and not bool(t["has_rollout_log_probs"].all()):
            raise ValueError("old_log_probs='rollout' needs recorded log-probs on every row")
        old = t["rollout_log_probs"] if use_recorded else recomputed
        metrics.update(self._optimise(t, old, recomputed, advantages, reference))
        self.step += 1
        metrics["tokens"] = float(t["response_mask"].sum())
        metrics["rows"] = float(t["response_mask"].shape[0])
        metrics["update_seconds"] = time.perf_counter() - started
        return metrics

    def _optimise(
        self,
        t: dict[str, torch.Tensor],
        old: torch.Tensor | None,
        recomputed: torch.Tensor | None,
        advantages: torch.Tensor,
        reference: torch.Tensor | None,
    ) -> dict[str, float]:
        """Optimiser steps over the batch; ``old`` / ``recomputed`` None: taken from the (only) forward pass."""
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.optim.ppo_epochs):
            for rows in mini_batches(t["rollout_index"], self.optim.mini_batch_rollouts):
                part = {name: value[rows] for name, value in t.items()}
                log_prob, entropy = self._log_probs(self.model, part, with_entropy=True)
                if recomputed is None:
                    recomputed = log_prob.detach()
                if old is None:
                    old = recomputed
                gap = log_prob_gap(part, recomputed[rows])
                loss, metrics = ppo.compute_actor_loss(
                    self.ppo_config,
                    old[rows],
                    log_prob,
                    advantages[rows],
                    part["response_mask"],
                    entropy=entropy if self.ppo_config.entropy_coeff else None,
                    ref_log_prob=None if reference is None else reference[rows],
                    rollout_index=part["rollout_index"],
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.optim.max_grad_norm or float("inf")
                )
                self.optimizer.step()
                metrics["loss"] = float(loss.detach())
                metrics["grad_norm"] = float(norm)
                assert entropy is not None
                metrics["entropy"] = float(ppo.masked_mean(entropy.detach(), part["response_mask"]))
                if reference is not None:
                    kl = ppo.kl_penalty(log_prob.detach(), reference[rows], self.ppo_config.kl_loss_type)
                    metrics["kl"] = float(ppo.masked_mean(kl, part["response_mask"]))
                metrics.update(gap)
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                count += 1
        return {name: value / count for name, value in sums.items()}

    def _tensors(self, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        names = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "rollout_index")
        t = {
            name: torch.as_tensor(np.asarray(arrays[name]), dtype=torch.long, device=self.device)
            for name in names
        }
        t["response_mask"] = t["response_mask"].to(torch.float32)
        t["has_rollout_log_probs"] = torch.as_tensor(
            np.asarray(arrays["has_rollout_log_probs"]), dtype=torch.float32, device=self.device
        )
        if "rollout_log_probs" in arrays:
            t["rollout_log_probs"] = torch.as_tensor(
                np.asarray(arrays["rollout_log_probs"]), dtype=torch.float32, device=self.device
            )
        return t

    def _log_probs(
        self, model: Any, t: Mapping[str, torch.Tensor], *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of the responses, at the sampling temperature."""
        responses = t["responses"]
        width = responses.shape[1]
        out = model(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            position_ids=t["position_ids"],
            logits_to_keep=width + 1,  # the LM head only where responses are predicted
        )
        logits = out.logits[:, :-1, :]
        log_prob = ppo.token_log_probs(logits, responses, self.optim.temperature)
        entropy = ppo.entropy_from_logits(logits / self.optim.temperature) if with_entropy else None
        return log_prob, entropy

    # ------------------------------------------------------------ weights and checkpoints
    def export_weights(self, path: str | Path) -> Path:
        """The current weights as a ``save_pretrained`` directory (what the engine loads)."""
        path = Path(path)
        self.model.save_pretrained(path, safe_serialization=True)
        return path

    def save_checkpoint(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> Path:
        """Weights, tokenizer files, optimiser, step and random states: enough to resume the same run."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.export_weights(path)
        _copy_tokenizer(Path(self.model_path), path)
        torch.save(
            {
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "reference": self.reference.state_dict() if self.reference is not None else None,
                "rng": random_states(),
                "extra": dict(extra or {}),
            },
            path / STATE_FILE,
        )
        (path / CONFIG_FILE).write_text(
            json.dumps(
                {"ppo": asdict(self.ppo_config), "optim": asdict(self.optim), "seed": self.seed}, indent=2
            )
        )
        return path

    @classmethod
    def resume(cls, path: str | Path, **options: Any) -> tuple[Learner, dict[str, Any]]:
        """A learner continuing from a checkpoint, and the checkpoint's ``extra`` values."""
        path = Path(path)
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        learner = cls(model_path=path, **options)
        learner.optimizer.load_state_dict(state["optimizer"])
        if learner.reference is not None and state["reference"] is not None:
            learner.reference.load_state_dict(state["reference"])
        learner.step = int(state["step"])
        restore_random_states(state["rng"])
        return learner, dict(state["extra"])


# ------------------------------------------------------------ batch helpers
def log_prob_gap(t: Mapping[str, torch.Tensor], recomputed: torch.Tensor) -> dict[str, float]:
    """How far the proxy's recorded log-probs are from the learner's, over the rows that have them."""
    recorded = t.get("rollout_log_probs")
    if recorded is None or not bool(t["has_rollout_log_probs"].any()):
        return {}
    mask = t["response_mask"] * t["has_rollout_log_probs"][:, None]
    if not bool(mask.any()):
        return {}
    gap = (recorded - recomputed).abs() * mask
    return {"log_prob_gap_mean": float(gap.sum() / mask.sum()), "log_prob_gap_max": float(gap.max())}


def rollout_rewards_and_groups(
    arrays: Mapping[str, np.ndarray], uid: np.ndarray
) -> tuple[torch.Tensor, np.ndarray]:
    """Each rollout's reward and group id, from its rows (the rollout-level view GRPO normalises over)."""
    index = np.asarray(arrays["rollout_index"], dtype=np.int64)
    count = int(index.max()) + 1 if index.size else 0
    rewards = np.zeros(count, dtype=np.float32)
    rewards[index] = np.asarray(arrays["rollout_rewards"], dtype=np.float32)
    groups = np.empty(count, dtype=object)
    groups[index] = np.asarray(uid, dtype=object)
    return torch.from_numpy(rewards), groups


def reward_metrics(rewards: np.ndarray, groups: np.ndarray, solved_at: float) -> dict[str, float]:
    """Reward mean and spread over rollouts, the solved fraction, and groups whose rewards are all equal."""
    if rewards.size == 0:
        return {
            "reward_mean": math.nan,
            "reward_std": math.nan,
            "solved": math.nan,
            "zero_variance_groups": 0.0,
        }
    by_group: dict[Any, list[float]] = {}
    for reward, group in zip(rewards.tolist(), groups.tolist(), strict=True):
        by_group.setdefault(group, []).append(reward)
    flat = sum(1 for values in by_group.values() if max(values) == min(values))
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "solved": float((rewards >= solved_at).mean()),
        "zero_variance_groups": float(flat),
        "groups": float(len(by_group)),
        "rollouts": float(rewards.size),
    }


def mini_batches(rollout_index: torch.Tensor, rollouts_per_batch: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch: whole rollouts, ``rollouts_per_batch`` at a time (0: all)."""
    rows = torch.arange(rollout_index.shape[0], device=rollout_index.device)
    if rollouts_per_batch <= 0:
        return [rows]
    batches = []
    ids = torch.unique(rollout_index)
    for start in range(0, ids.numel(), rollouts_per_batch):
        chosen = torch.isin(rollout_index, ids[start : start + rollouts_per_batch])
        batches.append(rows[chosen])
    return batches


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def random_states() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_random_states(states: Mapping[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def _copy_tokenizer(source: Path, target: Path) -> None:
    if source.resolve() == target.resolve():
        return
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).exists():
            (target / name).write_bytes((source / name).read_bytes())


__all__: Sequence[str] = ("Learner", "OptimConfig", "UpdateInput", "mini_batches", "reward_metrics")
