"""The learner: one GRPO/PPO update of a causal LM from a batch of verl-shaped arrays, on CPU or GPU.

Advantages are computed once per rollout (its group's mean and spread over rollouts, not rows) and
broadcast to every row of the rollout; the loss is the dual-clip PPO surrogate of :mod:`.ppo` with
verl's knobs. Old log-probs are recomputed under the current weights, or taken from the proxy's
recorded ones (``old_log_probs="rollout"``, verl's bypass mode); the gap between the two is reported.
Log-probs (and entropy) of a row are computed at the temperature its calls were sampled at, as the proxy
recorded it per call (the batch's ``temperatures``); a batch without them uses ``OptimConfig.temperature``.
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

from lightning_grpc._extras import extra_imports

with extra_imports("train"):
    import numpy as np
    import torch

from . import ppo
from .sharded import SHARDED_DIR, load_sharded_checkpoint, random_states, restore_random_states

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "trainer_config.json"


@dataclass(frozen=True)
class OptimConfig:
    """The optimiser and how a batch is used (verl's names where verl has one)."""

    lr: float = field(default=3e-4, metadata={"help": "AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "AdamW betas."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradients are clipped to this total norm (0: no clipping)."}
    )
    ppo_epochs: int = field(default=1, metadata={"help": "Passes over each batch (verl: ppo_epochs)."})
    mini_batch_rollouts: int = field(
        default=0, metadata={"help": "Rollouts per optimiser step (0: the whole batch in one step)."}
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "The sampling temperature: log-probs of a row are computed at the temperature its calls "
            "were sampled at, as the proxy recorded it (the batch's temperatures), else at this one "
            "(an experiment file sets it as sampling.temperature)."
        },
    )
    old_log_probs: Literal["recompute", "rollout"] = field(
        default="recompute",
        metadata={
            "help": '"recompute": under the weights before the update; '
            "\"rollout\": the proxy's recorded log-probs (verl's bypass mode)."
        },
    )

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
        #: The tokenizer files of the model this learner started from, kept to write into every checkpoint:
        #: the directory they came from (a resumed-from checkpoint) may be deleted by ``keep`` meanwhile.
        self.tokenizer_files = read_tokenizer_files(Path(self.model_path))
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=torch.float32)
        reference = copy.deepcopy(model).eval().requires_grad_(False) if self.ppo_config.use_kl_loss else None
        self.model = self._place(model)
        self.model.train()
        self.reference = None if reference is None else self._place(reference)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.optim.lr,
            betas=self.optim.betas,
            weight_decay=self.optim.weight_decay,
        )

    # ------------------------------------------------------------ what a distributed rank overrides
    def _place(self, model: Any) -> Any:
        """The model on this learner's device (a rank of :mod:`.distributed` also shards it)."""
        return model.to(self.device)

    @property
    def world_size(self) -> int:
        """Processes that share each update (data parallel): 1 here."""
        return 1

    def _all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the processes sharing the update (here the only one)."""
        return values

    def _gather(self, value: Any) -> list[Any]:
        """``value`` of every process sharing the update, in rank order (here the only one)."""
        return [value]

    # ------------------------------------------------------------ one update
    def update(self, batch: UpdateInput, rows: Sequence[int] | np.ndarray | None = None) -> dict[str, float]:
        """One PPO/GRPO update from a batch; returns its metrics.

        ``rows``: the rows this process trains on (None: all of them). With several processes (the ranks
        of :mod:`.distributed`) each passes its own rows of the same batch: advantages, reward metrics and
        the mini-batches are the whole batch's, each loss is normalised over the whole mini-batch
        (:meth:`_batch_info`) and the metrics are combined over the ranks (:func:`combine_rank_metrics`),
        so that the update equals the one-process update of the whole batch.
        """
        started = time.perf_counter()
        t = self._tensors(batch.arrays)
        own = (
            torch.arange(t["response_mask"].shape[0], device=self.device)
            if rows is None
            else torch.as_tensor(np.asarray(rows, dtype=np.int64), device=self.device)
        )
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
        use_recorded = self.optim.old_log_probs == "rollout"
        if use_recorded and not bool(t["has_rollout_log_probs"].all()):
            raise ValueError("old_log_probs='rollout' needs recorded log-probs on every row")
        one_pass = self.optim.ppo_epochs == 1 and self.optim.mini_batch_rollouts == 0
        with torch.no_grad():
            # One update over the whole batch starts from the current weights: its own forward pass gives
            # the old log-probs (ratio 1), so a separate pass is only made when there are several updates.
            recomputed = None if one_pass else self._rows_log_probs(self.model, t, own)
            reference = self._rows_log_probs(self.reference, t, own) if self.reference else None
        old = t["rollout_log_probs"] if use_recorded else recomputed
        metrics.update(self._optimise(t, own, old, recomputed, advantages, reference, int(rewards.shape[0])))
        self.step += 1
        metrics["tokens"] = float(t["response_mask"].sum())
        metrics["rows"] = float(t["response_mask"].shape[0])
        metrics["update_seconds"] = time.perf_counter() - started
        return metrics

    def _optimise(
        self,
        t: dict[str, torch.Tensor],
        own: torch.Tensor,
        old: torch.Tensor | None,
        recomputed: torch.Tensor | None,
        advantages: torch.Tensor,
        reference: torch.Tensor | None,
        num_rollouts: int,
    ) -> dict[str, float]:
        """Optimiser steps over the batch, each on this process's rows of one mini-batch of the whole batch.

        ``old`` / ``recomputed`` None: taken from the (only) forward pass. Log-prob tensors are ``[B, L]``
        over the whole batch (filled on ``own`` rows); every process runs every mini-batch, one without
        rows of its own on a stand-in row that weighs nothing (FSDP needs each rank in each pass).
        """
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.optim.ppo_epochs):
            for batch_rows in mini_batches(t["rollout_index"], self.optim.mini_batch_rollouts):
                part, rows = take_rows(t, own[torch.isin(own, batch_rows)])
                log_prob, entropy = self._log_probs(self.model, part, with_entropy=True)
                if recomputed is None:
                    recomputed = torch.zeros_like(t["response_mask"])
                    recomputed[rows] = log_prob.detach()
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
                    **self._batch_info(part, num_rollouts),
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.optim.max_grad_norm or float("inf")
                )
                self.optimizer.step()
                metrics["loss"] = float(loss.detach())
                metrics["grad_norm"] = float(_full_tensor(norm))
                assert entropy is not None
                metrics["entropy"] = float(ppo.masked_mean(entropy.detach(), part["response_mask"]))
                if reference is not None:
                    kl = ppo.kl_penalty(log_prob.detach(), reference[rows], self.ppo_config.kl_loss_type)
                    metrics["kl"] = float(ppo.masked_mean(kl, part["response_mask"]))
                metrics.update(gap)
                weights = {
                    "tokens": float(part["response_mask"].sum()),
                    "gap_tokens": float(
                        (part["response_mask"] * part["has_rollout_log_probs"][:, None]).sum()
                    )
                    if gap
                    else 0.0,
                }
                metrics = combine_rank_metrics(self._gather((metrics, weights)))
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                count += 1
        return {name: value / count for name, value in sums.items()}

    def _batch_info(self, part: Mapping[str, torch.Tensor], num_rollouts: int) -> ppo.BatchInfo:
        """The loss's normalisers over the whole mini-batch (every process's rows), as verl passes them.

        Each process's loss is its rows' share of the mini-batch's loss times ``dp_size`` (``agg_loss``),
        and data-parallel training averages the gradients over the processes: the average is the
        gradient of the whole mini-batch's loss. With one process these are the counts ``agg_loss``
        would make of the mini-batch itself.
        """
        mask = part["response_mask"]
        mode = self.ppo_config.loss_agg_mode
        info: ppo.BatchInfo = {"dp_size": self.world_size, "rollout_index": part["rollout_index"]}
        if mode == "token-mean":
            info["batch_num_tokens"] = self._all_sum(mask.sum())
        elif mode.startswith("seq-mean"):
            info["global_batch_size"] = self._all_sum((mask.sum(dim=-1) > 0).float().sum())
        elif mode == "per-rollout-mean":
            # a rollout's rows may lie with several processes: its tokens are counted over all of them
            tokens = self._all_sum(ppo.count_rollout_tokens(part["rollout_index"], mask, num_rollouts))
            info["rollout_num_tokens"] = tokens
            info["global_batch_size"] = (tokens > 0).sum()
        return info

    def _rows_log_probs(self, model: Any, t: Mapping[str, torch.Tensor], own: torch.Tensor) -> torch.Tensor:
        """Log-probs of ``own`` rows (no entropy), as a ``[B, L]`` tensor over the whole batch."""
        part, rows = take_rows(t, own)
        out = torch.zeros_like(t["response_mask"])
        out[rows] = self._log_probs(model, part, with_entropy=False)[0]
        return out

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
        if "temperatures" in arrays:
            t["temperatures"] = row_temperatures(arrays["temperatures"], self.optim.temperature, self.device)
        return t

    def _log_probs(
        self, model: Any, t: Mapping[str, torch.Tensor], *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of the responses, at the sampling temperature: each row's
        recorded one (``temperatures``, when the batch has them), else the configured one."""
        responses = t["responses"]
        width = responses.shape[1]
        out = model(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            position_ids=t["position_ids"],
            logits_to_keep=width + 1,  # the LM head only where responses are predicted
        )
        logits = out.logits[:, :-1, :]
        temperature = t.get("temperatures", self.optim.temperature)
        log_prob = ppo.token_log_probs(logits, responses, temperature)
        entropy = ppo.entropy_from_logits(ppo.scale_logits(logits, temperature)) if with_entropy else None
        return log_prob, entropy

    # ------------------------------------------------------------ weights and checkpoints
    def export_weights(self, path: str | Path) -> Path:
        """The current weights as a ``save_pretrained`` directory (what the engine loads)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no bar per weight export in the run's output (every step)
        path = Path(path)
        self.model.save_pretrained(path, safe_serialization=True)
        return path

    def save_checkpoint(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> Path:
        """Weights, tokenizer files, optimiser, step and random states: enough to resume the same run."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.export_weights(path)
        write_files(self.tokenizer_files, path)
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
        self._write_config(path)
        return path

    def _write_config(self, path: Path) -> None:
        """The run's knobs beside a checkpoint (for a reader; resuming takes them from the experiment)."""
        (path / CONFIG_FILE).write_text(
            json.dumps(
                {"ppo": asdict(self.ppo_config), "optim": asdict(self.optim), "seed": self.seed}, indent=2
            )
        )

    @classmethod
    def resume(cls, path: str | Path, **options: Any) -> tuple[Learner, dict[str, Any]]:
        """A learner continuing from a checkpoint, and the checkpoint's ``extra`` values.

        A checkpoint of a learner with ranks (:mod:`.distributed`) is read whole into this process."""
        path = Path(path)
        if not (path / STATE_FILE).exists() and (path / SHARDED_DIR).is_dir():
            learner = cls(model_path=path, **options)
            return learner, load_sharded_checkpoint(learner, path, rank=0)
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        learner = cls(model_path=path, **options)
        learner.optimizer.load_state_dict(state["optimizer"])
        if learner.reference is not None and state["reference"] is not None:
            learner.reference.load_state_dict(state["reference"])
        learner.step = int(state["step"])
        restore_random_states(state["rng"])
        return learner, dict(state["extra"])


# ------------------------------------------------------------ batch helpers
def row_temperatures(recorded: np.ndarray, configured: float, device: Any = None) -> torch.Tensor:
    """The temperature the learner computes each row's log-probs at: the one its calls were sampled at, as
    the proxy recorded it (the batch's ``temperatures``); a greedy row (0, where there is no distribution to
    match) or a value that is not a positive number keeps the configured one."""
    values = torch.as_tensor(np.asarray(recorded), dtype=torch.float32, device=device)
    usable = torch.isfinite(values) & (values > 0)
    return torch.where(usable, values, torch.full_like(values, float(configured)))


def take_rows(
    t: Mapping[str, torch.Tensor], rows: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The tensors of ``rows`` and the rows taken. No rows: row 0 stands in with an empty response mask,
    so the forward and backward passes run (and a sharded model's collectives with them) but it adds
    nothing to any loss, gradient or metric."""
    if rows.numel():
        return {name: value[rows] for name, value in t.items()}, rows
    stand_in = torch.zeros(1, dtype=torch.long, device=rows.device)
    part = {name: value[stand_in] for name, value in t.items()}
    part["response_mask"] = torch.zeros_like(part["response_mask"])
    return part, stand_in


#: Metrics that are already shares of the whole mini-batch's figure times ``dp_size`` (the losses) or the
#: same on every process (the global grad norm, constants): their mean over the processes is the figure.
RANK_MEAN_METRICS = frozenset({"loss", "pg_loss", "entropy_loss", "kl_loss", "kl_coef", "grad_norm"})


def combine_rank_metrics(
    parts: Sequence[tuple[Mapping[str, float], Mapping[str, float]]],
) -> dict[str, float]:
    """One mini-batch's metrics over every process's rows, from each process's ``(metrics, weights)``.

    Losses: the mean over processes (each is its share times ``dp_size``); ``log_prob_gap_max``: the
    maximum; ``log_prob_gap_mean``: weighted by the tokens with a recorded log-prob (``gap_tokens``);
    the other per-token means (clip fractions, ``ppo_kl``, entropy, KL): weighted by ``tokens``.
    One process: its metrics as they are.
    """
    if len(parts) == 1:
        return dict(parts[0][0])
    names = dict.fromkeys(name for metrics, _ in parts for name in metrics)
    out: dict[str, float] = {}
    for name in names:
        present = [(float(metrics[name]), weights) for metrics, weights in parts if name in metrics]
        if name in RANK_MEAN_METRICS:
            out[name] = sum(value for value, _ in present) / len(parts)
        elif name == "log_prob_gap_max":
            out[name] = max(value for value, _ in present)
        else:
            key = "gap_tokens" if name == "log_prob_gap_mean" else "tokens"
            total = sum(weights[key] for _, weights in present)
            out[name] = sum(value * weights[key] for value, weights in present) / total if total else 0.0
    return out


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value made whole; a plain tensor as it is."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


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


#: The files of a model directory that make its tokenizer and chat template (an engine started from a
#: checkpoint needs them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def read_tokenizer_files(source: Path) -> dict[str, bytes]:
    """The tokenizer files of a model directory, by name."""
    return {name: (source / name).read_bytes() for name in TOKENIZER_FILES if (source / name).is_file()}


def write_files(files: Mapping[str, bytes], target: Path) -> None:
    for name, data in files.items():
        (target / name).write_bytes(data)


__all__: Sequence[str] = ("Learner", "OptimConfig", "UpdateInput", "mini_batches", "reward_metrics")
