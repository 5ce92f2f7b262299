"""verl as the trainer's cluster backend: the one module that knows verl (0.9.1, the ``verl`` extra).

verl owns the update (its FSDP actor), the weight sync and the vLLM rollout replicas; lightning-grpc owns
the rest of the loop, unchanged: the proxy routes the agents' calls to verl's vLLM replicas (registered
as the proxy's backends through ProxyService), runners play the agents in any language, the Store keeps
the rollouts and TrainerService cuts the whole-group batches that :func:`data_proto` turns into verl's
``DataProto``. The policy version every call records is verl's global step.

The seam is a ``RayPPOTrainer`` subclass (:func:`trainer_class`) that takes a batch built here and runs
verl's own step on it (old log-probs, reference, GRPO advantage, actor update, weight sync), as Agent
Lightning's verl trainer does. verl 0.9.1 offers no documented entry for rollouts made elsewhere: its
generation is written inline in ``RayPPOTrainer.fit``, and its agent-loop seam
(``agent_loop_manager_class``) hands the manager verl's own dataloader prompts, repeated ``rollout.n``
times with uids verl chose, which cannot carry our groups, our task files or failed-rollout policies.

Everything here but :func:`run_verl` runs on CPU (verl has no CPU platform for its workers: the FSDP
engine and vLLM need GPUs), and is tested in the environment ``make verl-env`` builds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_grpc.batching.tensors import INDEX_ARRAYS
from lightning_grpc.processes import start_ray

from .dynamic_sampling import VERL_METRIC as VERL_FILTER_METRIC
from .experiment import ConfigError, ExperimentConfig

if TYPE_CHECKING:  # the client module imports gRPC; only its batch type is needed here
    from lightning_grpc.client.trainer import TrainingBatch

#: The verl release this module is written against (the ``verl`` extra pins it).
VERL_VERSION = "0.9.1"
INSTALL_HINT = "pip install 'lightning-grpc[verl]' (verl 0.9.1)"
#: verl's flattened default trainer config, relative to the verl package.
DEFAULT_CONFIG = Path("trainer") / "config" / "_generated_ppo_trainer.yaml"
#: Our loss aggregation modes verl 0.9.1's actor has too (per-rollout-mean is Agent Lightning's).
VERL_LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


class VerlUnavailable(RuntimeError):
    """verl cannot be used here (not installed, another version, or no GPU); the message says what to do."""


def require_verl() -> Any:
    """The imported ``verl`` package, checked to be the pinned release."""
    try:
        import verl
    except ImportError as exc:
        raise VerlUnavailable(f"the verl backend needs verl: {INSTALL_HINT} ({exc})") from None
    version = getattr(verl, "__version__", "")
    if version != VERL_VERSION:
        raise VerlUnavailable(f"the verl backend is written for verl {VERL_VERSION}, found {version or '?'}")
    return verl


# ------------------------------------------------------------------ the experiment as verl's config


def verl_overrides(config: ExperimentConfig) -> list[str]:
    """The experiment translated into verl trainer-config keys ("dotted.key=value"), ``[verl] overrides`` last.

    Refuses, naming our key, what verl 0.9.1 cannot do the same way.
    """
    c = config
    if c.ppo.loss_agg_mode not in VERL_LOSS_AGG_MODES:
        raise ConfigError(
            f"ppo.loss_agg_mode {c.ppo.loss_agg_mode!r} has no verl {VERL_VERSION} equivalent "
            f"(verl has {', '.join(VERL_LOSS_AGG_MODES)})"
        )
    if c.optim.mini_batch_rollouts % c.data.group_size:
        raise ConfigError(
            "optim.mini_batch_rollouts must be a whole number of groups for verl "
            f"(a multiple of data.group_size = {c.data.group_size})"
        )
    mini_groups = c.optim.mini_batch_rollouts // c.data.group_size or c.data.batch_size
    if c.data.batch_size % mini_groups:
        raise ConfigError(
            f"data.batch_size ({c.data.batch_size} groups) must be a multiple of the mini-batch "
            f"({mini_groups} groups) for verl"
        )
    prompt_length = c.data.max_prompt_length or 1024
    response_length = c.data.max_response_length or max(c.sampling.max_tokens, 256)
    output = c.path(c.experiment.output_dir).resolve()
    micro = c.verl.micro_batch_size_per_gpu
    values: dict[str, Any] = {
        # the model and the rollout replicas
        "actor_rollout_ref.model.path": c.path(c.model.path).resolve(),
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": c.data.group_size,
        "actor_rollout_ref.rollout.temperature": c.sampling.temperature,
        "actor_rollout_ref.rollout.top_p": c.sampling.top_p,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": c.verl.tensor_parallel_size,
        "actor_rollout_ref.rollout.gpu_memory_utilization": c.verl.gpu_memory_utilization,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": micro,
        "data.max_prompt_length": prompt_length,
        "data.max_response_length": response_length,
        "data.train_batch_size": c.data.batch_size,
        "data.seed": c.experiment.seed,
        # the actor: optimiser and loss, with the same names as [optim] and [ppo]
        "actor_rollout_ref.actor.optim.lr": c.optim.lr,
        "actor_rollout_ref.actor.optim.weight_decay": c.optim.weight_decay,
        "actor_rollout_ref.actor.optim.betas": list(c.optim.betas),
        "actor_rollout_ref.actor.optim.clip_grad": c.optim.max_grad_norm,
        "actor_rollout_ref.actor.ppo_epochs": c.optim.ppo_epochs,
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini_groups,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.actor.clip_ratio_low": c.ppo.clip_ratio_low,
        "actor_rollout_ref.actor.clip_ratio_high": c.ppo.clip_ratio_high,
        "actor_rollout_ref.actor.clip_ratio_c": c.ppo.clip_ratio_c,
        "actor_rollout_ref.actor.loss_agg_mode": c.ppo.loss_agg_mode,
        "actor_rollout_ref.actor.use_kl_loss": c.ppo.use_kl_loss,
        "actor_rollout_ref.actor.kl_loss_coef": c.ppo.kl_loss_coef,
        "actor_rollout_ref.actor.kl_loss_type": c.ppo.kl_loss_type,
        "actor_rollout_ref.actor.entropy_coeff": c.ppo.entropy_coeff,
        "actor_rollout_ref.actor.data_loader_seed": c.experiment.seed,
        # GRPO, and where old log-probs come from: recomputed, or the proxy's recorded ones (bypass)
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": c.ppo.norm_adv_by_std_in_grpo,
        "algorithm.use_kl_in_reward": False,
        "algorithm.rollout_correction.bypass_mode": c.optim.old_log_probs == "rollout",
        # dynamic sampling, under verl's names; our loop does it (data.filter_groups: its batches come from
        # TrainerService, each round's groups filtered by their final reward), so this states what the run does
        "algorithm.filter_groups._target_": "verl.trainer.config.FilterGroupsConfig",
        "algorithm.filter_groups.enable": c.data.filter_groups,
        "algorithm.filter_groups.metric": VERL_FILTER_METRIC,
        "algorithm.filter_groups.max_num_gen_batches": c.data.max_num_gen_batches,
        # the run: our loop validates, verl checkpoints its actor
        "trainer.total_training_steps": c.experiment.steps,
        "trainer.n_gpus_per_node": c.verl.n_gpus_per_node,
        "trainer.nnodes": c.verl.nnodes,
        "trainer.save_freq": c.checkpoint.every or -1,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.balance_batch": True,
        "trainer.logger": ["console"],
        "trainer.project_name": "lightning-grpc",
        "trainer.experiment_name": c.experiment.name,
        "trainer.default_local_dir": output / "verl",
        "trainer.resume_mode": "auto",
    }
    return [f"{key}={_dotlist_value(value)}" for key, value in values.items()] + list(c.verl.overrides)


def _dotlist_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(_dotlist_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def verl_config(config: ExperimentConfig) -> Any:
    """verl's trainer config (an OmegaConf ``DictConfig``) for the experiment, checked by verl's own classes.

    verl's flattened defaults, then :func:`verl_overrides`; the actor, rollout and algorithm sections
    are turned into verl's config dataclasses (their checks run) and the actor's batch sizes are
    validated for the cluster. A rule verl refuses raises :class:`ConfigError` with verl's message.
    """
    verl = require_verl()
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from verl.utils.config import omega_conf_to_dataclass

    defaults = Path(verl.__file__).parent / DEFAULT_CONFIG
    overrides = verl_overrides(config)  # refuses what verl cannot do, naming our key
    try:
        cfg = OmegaConf.merge(OmegaConf.load(defaults), OmegaConf.from_dotlist(overrides))
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        actor.validate(
            n_gpus=config.verl.n_gpus_per_node * config.verl.nnodes,
            train_batch_size=cfg.data.train_batch_size,
            model_config=cfg.actor_rollout_ref.model,
        )
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        omega_conf_to_dataclass(cfg.algorithm)
    except (AssertionError, ValueError, TypeError, OmegaConfBaseException) as exc:
        raise ConfigError(f"verl {VERL_VERSION} refuses the translated config: {exc}") from None
    rows = config.data.batch_size * config.data.group_size
    gpus = config.verl.n_gpus_per_node * config.verl.nnodes
    if rows % gpus:
        raise ConfigError(
            f"data.batch_size x data.group_size ({rows} rows) must divide among the {gpus} GPUs "
            "(verl.n_gpus_per_node x verl.nnodes)"
        )
    return cfg


# ------------------------------------------------------------------ batches as verl's DataProto


def data_proto(batch: TrainingBatch, *, temperature: float) -> Any:
    """A TrainingBatch as the ``DataProto`` verl's PPO step takes.

    Tensors: prompts (left-padded), responses (right-padded), input_ids, attention_mask, position_ids,
    response_mask, ``rm_scores`` (the reward at the last response token: what verl's reward step
    extracts), token_level_scores, and rollout_log_probs when the proxy recorded them. Non-tensors:
    ``uid`` (the GRPO group), the rollout id of each row, and ``multi_modal_inputs`` (empty for text).
    meta_info: the sampling temperature and each row's token count (``global_token_num``).
    """
    require_verl()
    import torch
    from verl import DataProto

    arrays = batch.arrays
    tensors = {
        name: torch.from_numpy(np.ascontiguousarray(arrays[name]))
        for name in (*INDEX_ARRAYS, "token_level_scores")
    }
    tensors["rm_scores"] = tensors["token_level_scores"].clone()
    if "rollout_log_probs" in arrays:
        tensors["rollout_log_probs"] = torch.from_numpy(np.ascontiguousarray(arrays["rollout_log_probs"]))
    rows = len(batch)
    non_tensors = {
        "uid": np.asarray(batch.uid, dtype=object),
        "rollout_id": np.asarray(batch.rollout_ids, dtype=object),
        "multi_modal_inputs": np.array([{} for _ in range(rows)], dtype=object),
    }
    meta = {
        "temperature": float(temperature),
        "global_token_num": arrays["attention_mask"].sum(axis=1).astype(int).tolist(),
        "batch_id": batch.batch_id,
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


def replica_backends(
    addresses: Sequence[str], *, model_name: str, served_model: str, policy_version: int = 0
) -> list[Any]:
    """verl's vLLM replicas ("host:port" each, as ``LLMServerManager.get_addresses()`` gives them) as the
    proxy's backends for ``model_name``: the agents' calls reach them through the proxy, recorded with
    ``policy_version`` (vLLM does not report one; the loop sets it again after every weight sync)."""
    from lightning_grpc.proxy import Backend

    if not addresses:
        raise VerlUnavailable("verl started no vLLM rollout replica")
    backends = []
    for address in addresses:
        base = address if address.startswith(("http://", "https://")) else f"http://{address}"
        backends.append(
            Backend(
                model_name=model_name,
                api_base=f"{base}/v1",
                backend_model=served_model,
                policy_version=policy_version,
            )
        )
    return backends


# ------------------------------------------------------------------ verl's step on a batch made here


def trainer_class() -> type:
    """``RayPPOTrainer`` with one step that takes its batch from us (importing it needs ``verl[verl-core]``)."""
    require_verl()
    import torch
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.metric import reduce_metrics

    class LightningPPOTrainer(RayPPOTrainer):  # type: ignore[misc]
        """verl's trainer, driven by lightning-grpc's loop one batch at a time.

        ``init_workers()`` (verl's) starts the actor and the vLLM replicas; :meth:`replica_addresses`
        gives them to the proxy; :meth:`train_on` runs verl's step on a batch from TrainerService;
        :meth:`sync_weights` pushes the actor's weights to the replicas (and wakes them).
        """

        def replica_addresses(self) -> list[str]:
            return list(self.llm_server_manager.get_addresses())

        def sync_weights(self, global_step: int) -> None:
            self.checkpoint_manager.update_weights(global_step)

        def sleep_replicas(self) -> None:
            self.checkpoint_manager.sleep_replicas()

        def train_on(self, batch: Any, global_step: int) -> dict[str, float]:
            """verl's step on a DataProto from :func:`data_proto`: returns verl's metrics."""
            cfg = self.config
            self.global_steps = global_step
            metrics: dict[str, Any] = {}
            if cfg.trainer.balance_batch:
                self._balance_batch(batch, metrics=metrics)
            batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
            batch.meta_info["images_seqlens"] = []
            reward_tensor, _ = extract_reward(batch)
            if cfg.algorithm.rollout_correction.get("bypass_mode", False):
                batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            else:
                old_log_prob, _ = self._compute_old_log_prob(batch)
                old_log_prob.batch.pop("entropys", None)
                batch = batch.union(old_log_prob)
            if self.use_reference_policy:
                batch = batch.union(self._compute_ref_log_prob(batch))
            batch.batch["token_level_scores"] = reward_tensor
            batch.batch["token_level_rewards"] = reward_tensor
            batch = compute_advantage(
                batch,
                adv_estimator=cfg.algorithm.adv_estimator,
                gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam,
                num_repeat=cfg.actor_rollout_ref.rollout.n,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                config=cfg.algorithm,
            )
            output = self._update_actor(batch)
            metrics.update(reduce_metrics(output.meta_info["metrics"]))
            return {k: float(v) for k, v in metrics.items() if _is_number(v)}

    return LightningPPOTrainer


def _is_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def check_cluster() -> None:
    """verl's workers need GPUs: refuse at once, with the reason, on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        raise VerlUnavailable(
            "verl trains on GPUs only (its FSDP workers and vLLM replicas have no CPU platform, "
            "verl-project/verl#3266); `lightning-grpc train --backend verl --dry-run` checks the config "
            "here, and the default backend trains on this machine"
        )


def run_verl(config: ExperimentConfig, *, progress: bool = True) -> Any:
    """Train the experiment with verl on a GPU cluster (Ray): see docs/verl.md for the recipe.

    verl resumes from its own latest checkpoint under ``<output_dir>/verl`` (``resume_mode = auto``).
    """
    cfg = verl_config(config)
    check_cluster()
    from .loop import run_experiment

    return run_experiment(config, progress=progress, backend=VerlBackend(cfg))


class VerlBackend:
    """The update backend (:class:`~lightning_grpc.training.loop.UpdateBackend`) verl provides.

    :meth:`start`: Ray, verl's workers and vLLM replicas, woken with the actor's weights. The replicas
    become the proxy's backends. :meth:`update`: the replicas sleep while verl trains on the batch, then
    take the new weights (the policy version is verl's global step) and serve again.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.trainer: Any = None
        self._served_model = ""

    @property
    def checkpoint_dir(self) -> Path:
        return Path(str(self.cfg.trainer.default_local_dir))

    async def proxy_backends(self, model_name: str, http: Any) -> list[Any]:
        """The vLLM replicas as backends for ``model_name`` (under the name vLLM serves the model by), at
        the current policy version."""
        addresses = self.trainer.replica_addresses()
        if not self._served_model:
            base = addresses[0] if addresses[0].startswith("http") else f"http://{addresses[0]}"
            async with http.get(f"{base}/v1/models") as resp:
                self._served_model = (await resp.json())["data"][0]["id"]
        return replica_backends(
            addresses,
            model_name=model_name,
            served_model=self._served_model,
            policy_version=self.policy_version,
        )

    def start(self) -> list[str]:
        """Start verl's workers; returns the vLLM replicas' addresses."""
        import ray
        from verl.single_controller.ray import ResourcePoolManager
        from verl.trainer.ppo.utils import Role, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.engine_workers import ActorRolloutRefWorker

        cfg = self.cfg
        if not ray.is_initialized():
            start_ray(ray, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
        role = Role.ActorRolloutRef if need_reference_policy(cfg) else Role.ActorRollout
        mapping = {role: ray.remote(ActorRolloutRefWorker)}
        pools = ResourcePoolManager(
            resource_pool_spec={"global_pool": [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes},
            mapping={role: "global_pool"},
        )
        model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
        placeholder = _PlaceholderDataset(cfg.trainer.total_training_steps * cfg.data.train_batch_size)
        self.trainer = trainer_class()(
            config=cfg,
            tokenizer=model.tokenizer,
            role_worker_mapping=mapping,
            resource_pool_manager=pools,
            processor=model.processor,
            train_dataset=placeholder,
            val_dataset=placeholder,
        )
        self.trainer.init_workers()
        self.trainer.global_steps = 0
        self.trainer._load_checkpoint()
        self.trainer.sync_weights(self.trainer.global_steps)
        addresses: list[str] = self.trainer.replica_addresses()
        return addresses

    @property
    def policy_version(self) -> int:
        return int(self.trainer.global_steps) if self.trainer is not None else 0

    def update(self, batch: TrainingBatch, step: int) -> dict[str, float]:
        self.trainer.sleep_replicas()
        data = data_proto(batch, temperature=float(self.cfg.actor_rollout_ref.rollout.temperature))
        metrics: dict[str, float] = self.trainer.train_on(data, step)
        if self.cfg.trainer.save_freq > 0 and step % self.cfg.trainer.save_freq == 0:
            self.trainer._save_checkpoint()
        self.trainer.sync_weights(step)
        return metrics


class _PlaceholderDataset:
    """verl's constructor builds dataloaders; prompts come from our task files, so these hold nothing."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        import torch

        return {"dummy_tensor": torch.zeros(1, dtype=torch.uint8)}
