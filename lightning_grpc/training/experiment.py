"""One training experiment, described by one file (TOML or YAML) and checked before anything starts.

    [experiment]              name, output_dir, seed, steps, mode ("sync" | "async"), async_groups,
                              max_staleness
    [agent]                   agent ("module:name"), or command (a runner in any language, as an argument
                              list run from the config file's folder), train_tasks / val_tasks (JSONL
                              files, paths relative to the config file), processes (0: runners started
                              elsewhere serve the store named in [services]), concurrency
    [model]                   path (a Hugging Face model directory), init (build the tiny local model there
                              when missing; init_hidden_size and init_heads its shape), served_name
    [data]                    group_size, batch_size (groups per step), max_prompt_length,
                              max_response_length, aggregation, failure_policy, fill_reward
    [sampling]                temperature, top_p, max_tokens (what the agents' LLM calls use)
    [optim]                   lr, weight_decay, max_grad_norm, ppo_epochs, mini_batch_rollouts, old_log_probs
    [ppo]                     clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, use_kl_loss,
                              kl_loss_coef, kl_loss_type, entropy_coeff, norm_adv_by_std_in_grpo
    [validation]              every (steps), samples (per val task), target (stop once the validation reward
                              reaches it), solved_at
    [checkpoint]              every (steps), keep
    [engine]                  kind ("embedded" | "vllm"): what serves the policy; for vLLM: python (the
                              interpreter that has vLLM), max_model_len, kv_cache_gib, args (more server
                              arguments); services.engine names one already running instead
    [learner]                 ranks (torch.distributed ranks of the learner: Ray actors in a placement group
                              when more than 1), dist_backend ("gloo" | "nccl"; "": nccl with CUDA, else gloo),
                              ray_address ("": a Ray started by the run)
    [services]                store, proxy, proxy_grpc, engine: addresses of running ones (else started
                              here), threads (torch threads of the trainer and of the engine)
    [verl]                    the cluster backend (``train --backend verl``): n_gpus_per_node, nnodes,
                              micro_batch_size_per_gpu, tensor_parallel_size, gpu_memory_utilization, and
                              overrides (verl config keys as "dotted.key=value" strings)

An unknown key or a value of the wrong kind is an error that names it (``optim.lrr``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from .learner import OptimConfig
from .ppo import PPOConfig


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the key."""


@dataclass(frozen=True)
class ExperimentSection:
    name: str = "experiment"
    output_dir: str = "runs/experiment"
    seed: int = 0
    steps: int = 100
    #: "sync": generate, then update, then the next step; "async": groups keep running across updates.
    mode: str = "sync"
    #: Async mode: groups kept in flight (submitted, not yet taken).
    async_groups: int = 0
    #: Async mode: calls sampled more than this many policy versions ago are dropped.
    max_staleness: int = 1


@dataclass(frozen=True)
class AgentSection:
    agent: str = ""
    #: A runner written in another language, started instead of the Python runner: its argument list, run
    #: from the config file's folder with the store's address (and credential) in its environment.
    command: tuple[str, ...] = ()
    train_tasks: str = ""
    val_tasks: str = ""
    processes: int = 1
    concurrency: int = 64


@dataclass(frozen=True)
class ModelSection:
    path: str = ""
    init: bool = False
    served_name: str = "policy"
    #: The width of the tiny model ``init`` builds (``init-model --hidden-size``).
    init_hidden_size: int = 64
    #: Its attention heads (``init-model --heads``): vLLM's CPU attention needs a head size of at least 32,
    #: so 2 heads at the default width.
    init_heads: int = 4


@dataclass(frozen=True)
class DataSection:
    group_size: int = 8
    batch_size: int = 16
    max_prompt_length: int = 0
    max_response_length: int = 0
    aggregation: str = "transition"
    failure_policy: str = "drop_rollout"
    fill_reward: float = 0.0


@dataclass(frozen=True)
class SamplingSection:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16


@dataclass(frozen=True)
class ValidationSection:
    every: int = 10
    samples: int = 4
    target: float | None = None
    solved_at: float = 1.0


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 0
    keep: int = 2


@dataclass(frozen=True)
class ServicesSection:
    store: str = ""
    proxy: str = ""
    proxy_grpc: str = ""
    engine: str = ""
    trainer_threads: int = 1
    engine_threads: int = 1


ENGINE_KINDS = ("embedded", "vllm")


@dataclass(frozen=True)
class EngineSection:
    """What serves the policy to the agents (through the proxy) and takes each update's weights."""

    #: "embedded": the project's CPU engine (the default); "vllm": a vLLM server, the same code as on GPUs.
    kind: str = "embedded"
    #: vLLM: the Python interpreter that has vLLM installed ("": $LIGHTNING_GRPC_VLLM_PYTHON, else the
    #: project's .venv-vllm, else this interpreter).
    python: str = ""
    #: vLLM: the longest prompt plus response it schedules (--max-model-len).
    max_model_len: int = 1024
    #: vLLM on CPU: GiB of memory for its KV cache (VLLM_CPU_KVCACHE_SPACE).
    kv_cache_gib: float = 1.0
    #: vLLM: more server arguments, as a list of strings.
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class LearnerSection:
    """How the update is computed: one process, or several torch.distributed ranks sharding the model."""

    #: Ranks of the learner: 1 runs in the trainer's process; more run as Ray actors in a placement group,
    #: the model sharded by FSDP2 and each rank taking whole groups of the batch.
    ranks: int = 1
    #: torch.distributed backend: "gloo" (CPU), "nccl" (CUDA); "": nccl when CUDA is there, else gloo.
    dist_backend: str = ""
    #: The Ray cluster the ranks are placed on ("": a local Ray the run starts and stops).
    ray_address: str = ""


@dataclass(frozen=True)
class VerlSection:
    """What only ``lightning-grpc train --backend verl`` uses: the cluster, and verl's own knobs by name."""

    n_gpus_per_node: int = 1
    nnodes: int = 1
    #: Rows per GPU per forward/backward pass (verl: ppo_micro_batch_size_per_gpu and the log-prob ones).
    micro_batch_size_per_gpu: int = 4
    #: vLLM tensor parallelism per rollout replica.
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    #: Any other key of verl's trainer config, as "dotted.key=value" (applied last).
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExperimentConfig:
    experiment: ExperimentSection = field(default_factory=ExperimentSection)
    agent: AgentSection = field(default_factory=AgentSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    validation: ValidationSection = field(default_factory=ValidationSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    services: ServicesSection = field(default_factory=ServicesSection)
    engine: EngineSection = field(default_factory=EngineSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    verl: VerlSection = field(default_factory=VerlSection)
    #: The directory relative paths are taken from (the config file's).
    base_dir: str = "."

    def path(self, value: str) -> Path:
        """A path of the config, relative to the config file's directory."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else Path(os.path.normpath(Path(self.base_dir) / p))

    @property
    def output_dir(self) -> Path:
        return self.path(self.experiment.output_dir)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("base_dir")
        return out


_SECTIONS = {f.name: f for f in dataclasses.fields(ExperimentConfig) if f.name != "base_dir"}


def load_experiment(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ExperimentConfig:
    """The experiment a TOML or YAML file describes, with ``overrides`` ("section.key" -> value) applied."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    else:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold tables of settings")
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        raw.setdefault(section, {})[key] = value
    return experiment_from_dict(raw, base_dir=path.parent)


def experiment_from_dict(raw: Mapping[str, Any], base_dir: str | Path = ".") -> ExperimentConfig:
    sections: dict[str, Any] = {}
    raw = dict(raw)
    sampling, optim = raw.get("sampling"), raw.get("optim")
    if (
        isinstance(sampling, Mapping)
        and "temperature" in sampling
        and not (isinstance(optim, Mapping) and "temperature" in optim)
    ):  # log-probs are computed at the sampling temperature unless told otherwise
        raw["optim"] = {
            **(optim if isinstance(optim, Mapping) else {}),
            "temperature": sampling["temperature"],
        }
    for name, value in raw.items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown section [{name}] (known: {', '.join(_SECTIONS)})")
        if not isinstance(value, Mapping):
            raise ConfigError(f"[{name}] must be a table of settings")
        kind = _SECTIONS[name].default_factory()  # type: ignore[misc, operator]
        sections[name] = _section(name, type(kind), value)
    config = ExperimentConfig(**sections, base_dir=str(base_dir))
    check_experiment(config)
    return config


def _section(name: str, kind: type, values: Mapping[str, Any]) -> Any:
    hints = get_type_hints(kind)
    known = {f.name for f in dataclasses.fields(kind)}
    checked = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        checked[key] = _typed(f"{name}.{key}", hints[key], value)
    try:
        return kind(**checked)
    except ValueError as exc:  # the section's own checks name the key
        raise ConfigError(f"{name}.{exc}") from None


def _typed(where: str, hint: Any, value: Any) -> Any:
    text = str(hint)
    if value is None and "None" in text:
        return None
    if hint is bool or text == "bool":
        if isinstance(value, bool):
            return value
    elif "float" in text and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif (hint is int or text == "int") and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif "tuple[str" in text:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif "tuple" in text:
        if isinstance(value, list | tuple):
            return tuple(float(v) for v in value)
    elif (hint is str or "str" in text or "Literal" in text) and isinstance(value, str):
        return value
    raise ConfigError(
        f"{where} has the wrong kind of value: {json.dumps(value, default=str)} (wanted {text})"
    )


def check_experiment(c: ExperimentConfig) -> None:
    """Refuse what cannot run, naming the key."""
    rules = [
        (
            "agent.agent",
            (bool(c.agent.agent) and ":" in c.agent.agent) != bool(c.agent.command),
            "must name the agent as module:name, or agent.command a runner to start (one of the two)",
        ),
        ("agent.train_tasks", bool(c.agent.train_tasks), "must name a JSONL file of training tasks"),
        ("model.path", bool(c.model.path), "must name a model directory"),
        ("experiment.steps", c.experiment.steps >= 1, "must be at least 1"),
        ("experiment.mode", c.experiment.mode in ("sync", "async"), "must be 'sync' or 'async'"),
        ("experiment.max_staleness", c.experiment.max_staleness >= 0, "must be at least 0"),
        ("data.group_size", c.data.group_size >= 1, "must be at least 1"),
        ("data.batch_size", c.data.batch_size >= 1, "must be at least 1"),
        (
            "data.aggregation",
            c.data.aggregation in ("transition", "trajectory"),
            "must be transition or trajectory",
        ),
        (
            "data.failure_policy",
            c.data.failure_policy in ("drop_group", "drop_rollout", "fill"),
            "must be drop_group, drop_rollout or fill",
        ),
        ("sampling.temperature", c.sampling.temperature > 0, "must be greater than 0"),
        ("sampling.max_tokens", c.sampling.max_tokens >= 1, "must be at least 1"),
        ("validation.every", c.validation.every >= 0, "must be at least 0 (0: no validation)"),
        ("validation.samples", c.validation.samples >= 1, "must be at least 1"),
        ("agent.processes", c.agent.processes >= 0, "must be at least 0 (0: runners run elsewhere)"),
        (
            "agent.processes",
            c.agent.processes >= 1 or bool(c.services.store),
            "may be 0 only when services.store names a running store that the runners serve",
        ),
        ("agent.concurrency", c.agent.concurrency >= 1, "must be at least 1"),
        ("checkpoint.every", c.checkpoint.every >= 0, "must be at least 0"),
        (
            "model.init_heads",
            c.model.init_heads >= 1 and c.model.init_hidden_size % c.model.init_heads == 0,
            "must divide model.init_hidden_size",
        ),
        ("engine.kind", c.engine.kind in ENGINE_KINDS, f"must be one of {', '.join(ENGINE_KINDS)}"),
        ("engine.max_model_len", c.engine.max_model_len >= 16, "must be at least 16"),
        ("engine.kv_cache_gib", c.engine.kv_cache_gib > 0, "must be greater than 0"),
        ("learner.ranks", c.learner.ranks >= 1, "must be at least 1"),
        (
            "learner.dist_backend",
            c.learner.dist_backend in ("", "gloo", "nccl"),
            "must be gloo, nccl or empty (nccl with CUDA, else gloo)",
        ),
        ("verl.n_gpus_per_node", c.verl.n_gpus_per_node >= 1, "must be at least 1"),
        ("verl.nnodes", c.verl.nnodes >= 1, "must be at least 1"),
        ("verl.micro_batch_size_per_gpu", c.verl.micro_batch_size_per_gpu >= 1, "must be at least 1"),
        ("verl.tensor_parallel_size", c.verl.tensor_parallel_size >= 1, "must be at least 1"),
        (
            "verl.gpu_memory_utilization",
            0.0 < c.verl.gpu_memory_utilization <= 1.0,
            "must be in (0, 1]",
        ),
        (
            "verl.overrides",
            all("=" in o and not o.startswith("=") for o in c.verl.overrides),
            'must be "dotted.key=value" strings',
        ),
        (
            "optim.temperature",
            c.optim.temperature == c.sampling.temperature,
            "must equal sampling.temperature (log-probs are computed at the sampling temperature)",
        ),
    ]
    for key, holds, rule in rules:
        if not holds:
            raise ConfigError(f"{key} {rule}")
    if c.experiment.mode == "async" and c.experiment.async_groups < c.data.batch_size:
        raise ConfigError("experiment.async_groups must be at least data.batch_size in async mode")
    for key in ("train_tasks", "val_tasks"):
        value = getattr(c.agent, key)
        if value and not c.path(value).is_file():
            raise ConfigError(f"agent.{key}: no file {c.path(value)}")


def read_tasks(path: Path) -> list[Any]:
    """Tasks of a JSONL file (one JSON value a line; blank lines skipped)."""
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number} is not JSON: {exc.msg}") from None
    if not tasks:
        raise ConfigError(f"{path} holds no task")
    return tasks
