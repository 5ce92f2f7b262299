"""One training experiment, described by one file (TOML or YAML) and checked before anything starts.

The file's tables are the sections below ([experiment], [agent], [model], [data], [sampling], [optim],
[ppo], [validation], [checkpoint], [services], [engine], [learner], [verl]); every key, with its type,
default and meaning, is listed by ``lightning-grpc train --help-config`` (generated from the dataclasses
here, so it is never out of date). Relative paths are taken from the config file's folder.

An unknown key or a value of the wrong kind is an error that names it (``optim.lrr``); a key that moved
names its new place. Each section checks its own keys (``check()``); :func:`check_experiment` adds the
rules that span sections.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
import re
import sys
import textwrap
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from lightning_grpc import environment
from lightning_grpc._extras import import_extra
from lightning_grpc.batching.options import Aggregation, FailurePolicy

from .learner import OptimConfig
from .ppo import PPOConfig
from .signal import CONDITIONS as STALL_CONDITIONS


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the key."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


class _Section:
    """A table of the experiment file that checks its own keys."""

    #: The table's name in the file (``[name]``), used in error messages.
    section: ClassVar[str]

    def rules(self) -> list[tuple[str, bool, str]]:
        """(key, holds, what it must be) for each rule of this section alone."""
        return []

    def check(self) -> None:
        """Refuse what cannot run, naming ``section.key``."""
        for key, holds, rule in self.rules():
            if not holds:
                raise ConfigError(f"{self.section}.{key} {rule}")


RunMode = Literal["sync", "async"]
EngineKind = Literal["embedded", "vllm"]
DistBackend = Literal["", "gloo", "nccl"]
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)


@dataclass(frozen=True)
class ExperimentSection(_Section):
    """The run as a whole: its name, where it writes, how long, and how generation and updates overlap."""

    section: ClassVar[str] = "experiment"

    name: str = field(default="experiment", metadata=_help("The run's name (in request ids and logs)."))
    output_dir: str = field(
        default="runs/experiment",
        metadata=_help("Where metrics, checkpoints and the trained model go (relative: to the file)."),
    )
    seed: int = field(default=0, metadata=_help("Seed of the learner, the task order and the tiny model."))
    steps: int = field(default=100, metadata=_help("Training steps (one update each)."))
    mode: RunMode = field(
        default="sync",
        metadata=_help(
            '"sync": generate, then update, then the next step; "async": groups keep running across updates.'
        ),
    )
    async_groups: int = field(
        default=0,
        metadata=_help(
            "Async mode: groups kept in flight (submitted, not yet taken); at least data.batch_size."
        ),
    )
    max_staleness: int = field(
        default=1,
        metadata=_help("Async mode: calls sampled more than this many policy versions ago are dropped."),
    )
    stall_window: int = field(
        default=10,
        metadata=_help(
            "Warn (once, with the figures and what to change) when the run has had no learning signal for "
            "this many steps in a row: most GRPO groups with zero reward variance, every rollout the same "
            "reward, nearly every response cut at sampling.max_tokens, every call dropped as stale; each "
            "condition is recorded as the metric stalled_<condition> (0: no watch)."
        ),
    )
    stall_zero_variance_fraction: float = field(
        default=0.9,
        metadata=_help(
            "The share of a step's GRPO groups with zero reward variance from which it has no signal."
        ),
    )
    stall_conditions: tuple[str, ...] = field(
        default=STALL_CONDITIONS,
        metadata=_help(
            "The conditions stall_window watches: zero_variance, equal_rewards, max_tokens, all_stale (a task "
            "that cuts its answers at max_tokens on purpose leaves max_tokens out)."
        ),
    )
    stop_when_stalled: bool = field(
        default=False,
        metadata=_help(
            "Stop the run (keeping the final checkpoint) once such a condition held stall_window steps."
        ),
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            (
                "name",
                re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", self.name) is not None,
                "must be 1-64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit (it names the "
                f"run's rollouts, batches and resources in the store), got {self.name!r}",
            ),
            ("steps", self.steps >= 1, "must be at least 1"),
            ("max_staleness", self.max_staleness >= 0, "must be at least 0"),
            ("stall_window", self.stall_window >= 0, "must be at least 0 (0: no watch)"),
            (
                "stall_conditions",
                set(self.stall_conditions) <= set(STALL_CONDITIONS),
                f"must name conditions among {', '.join(STALL_CONDITIONS)}",
            ),
            (
                "stall_zero_variance_fraction",
                0.0 < self.stall_zero_variance_fraction <= 1.0,
                "must be in (0, 1]",
            ),
        ]


@dataclass(frozen=True)
class AgentSection(_Section):
    """The agent that produces rollouts, the tasks it is given, and the runners that run it."""

    section: ClassVar[str] = "agent"

    agent: str = field(
        default="",
        metadata=_help('The Python agent, as "module:name" (or agent.command instead: one of the two).'),
    )
    command: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "A runner written in another language, started instead of the Python runner: its argument "
            "list, run from the config file's folder with the store's address (and credential) in its "
            "environment."
        ),
    )
    train_tasks: str = field(
        default="", metadata=_help("JSONL file of training tasks (one JSON value a line).")
    )
    val_tasks: str = field(
        default="", metadata=_help('JSONL file of validation tasks ("": no validation set).')
    )
    processes: int = field(
        default=1,
        metadata=_help("Runner processes started (0: runners started elsewhere serve services.store)."),
    )
    concurrency: int = field(default=64, metadata=_help("Rollouts each runner process runs at once."))
    rollout_timeout: float = field(
        default=300.0, metadata=_help("Seconds an attempt may run before the store ends it (TIMEOUT).")
    )
    unresponsive_timeout: float = field(
        default=60.0,
        metadata=_help(
            "Seconds without a span or heartbeat after which the store ends an attempt (UNRESPONSIVE): how "
            "soon the rollouts of a runner that died are tried again."
        ),
    )
    max_attempts: int = field(
        default=3,
        metadata=_help(
            "Attempts a rollout gets, the first included: one that ends FAILED, TIMEOUT or UNRESPONSIVE "
            "(its runner or the engine died under it) is tried again until then; its calls stay with "
            "their attempt and only the last attempt is trained."
        ),
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("rollout_timeout", self.rollout_timeout > 0, "must be more than 0 seconds"),
            ("unresponsive_timeout", self.unresponsive_timeout > 0, "must be more than 0 seconds"),
            ("max_attempts", self.max_attempts >= 1, "must be at least 1"),
            (
                "agent",
                (bool(self.agent) and ":" in self.agent) != bool(self.command),
                "must name the agent as module:name, or agent.command a runner to start (one of the two)",
            ),
            ("train_tasks", bool(self.train_tasks), "must name a JSONL file of training tasks"),
            ("processes", self.processes >= 0, "must be at least 0 (0: runners run elsewhere)"),
            ("concurrency", self.concurrency >= 1, "must be at least 1"),
        ]


@dataclass(frozen=True)
class ModelSection(_Section):
    """The policy model: a Hugging Face model directory, or a tiny one built there."""

    section: ClassVar[str] = "model"

    path: str = field(default="", metadata=_help("The Hugging Face model directory the run starts from."))
    init: bool = field(
        default=False, metadata=_help("Build the tiny local model at model.path when it is missing.")
    )
    served_name: str = field(default="policy", metadata=_help("The model name the agents' LLM calls use."))
    init_hidden_size: int = field(
        default=64,
        metadata=_help("The width of the tiny model model.init builds (init-model --hidden-size)."),
    )
    init_heads: int = field(
        default=4,
        metadata=_help(
            "Its attention heads (init-model --heads): vLLM's CPU attention needs a head size of at "
            "least 32, so 2 heads at the default width."
        ),
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("path", bool(self.path), "must name a model directory"),
            (
                "init_heads",
                self.init_heads >= 1 and self.init_hidden_size % self.init_heads == 0,
                "must divide model.init_hidden_size",
            ),
        ]


@dataclass(frozen=True)
class DataSection(_Section):
    """How the trainer cuts each step's batch out of the finished rollouts."""

    section: ClassVar[str] = "data"

    group_size: int = field(default=8, metadata=_help("Rollouts per task in a GRPO group."))
    batch_size: int = field(default=16, metadata=_help("Groups per training step."))
    max_prompt_length: int = field(default=0, metadata=_help("Longest prompt in a batch row (0: no limit)."))
    max_response_length: int = field(
        default=0, metadata=_help("Longest response in a batch row (0: no limit).")
    )
    aggregation: Aggregation = field(
        default=Aggregation.TRANSITION,
        metadata=_help(
            "A batch row per LLM call (transition) or per agent's chain of calls (trajectory: observations masked"
            " out; a rollout whose prompts do not extend its earlier turns token for token falls back to per-call"
            " rows, counted as trajectory_fallback_<reason>)."
        ),
    )
    failure_policy: FailurePolicy = field(
        default=FailurePolicy.DROP_ROLLOUT,
        metadata=_help(
            "A rollout that failed or has no reward: drop its group, drop it, or fill it with data.fill_reward."
        ),
    )
    fill_reward: float = field(default=0.0, metadata=_help('The reward failure_policy = "fill" gives.'))
    filter_groups: bool = field(
        default=False,
        metadata=_help(
            "Dynamic sampling (DAPO; verl: algorithm.filter_groups.enable): set aside the GRPO groups whose"
            " rollouts all earned the same final reward (zero advantage, no gradient) and draw more groups until"
            " the step has data.batch_size groups with a reward spread; metrics filtered_groups and gen_batches."
            " Async mode: applies to the batch being taken (groups in flight are topped up)."
        ),
    )
    max_num_gen_batches: int = field(
        default=4,
        metadata=_help(
            "With filter_groups: the most generation rounds of a step, the first included (verl:"
            " algorithm.filter_groups.max_num_gen_batches); each further round draws the groups still missing."
            " At the cap the step trains on the groups it has and says so (metric filter_groups_capped, one"
            " warning a run) where verl raises. At least 1: verl's 0 (no cap) is refused, as a task whose"
            " rewards never differ would generate forever."
        ),
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("group_size", self.group_size >= 1, "must be at least 1"),
            ("batch_size", self.batch_size >= 1, "must be at least 1"),
            (
                "max_num_gen_batches",
                self.max_num_gen_batches >= 1,
                "must be at least 1 (generation rounds per step, the first included; 0 = no cap is not allowed)",
            ),
            (
                "filter_groups",
                not self.filter_groups or self.group_size >= 2,
                "needs data.group_size of at least 2 (a group of one rollout has no reward spread to filter by)",
            ),
        ]


@dataclass(frozen=True)
class SamplingSection(_Section):
    """What the agents' LLM calls use; the learner computes log-probs at the same temperature."""

    section: ClassVar[str] = "sampling"

    temperature: float = field(
        default=1.0,
        metadata=_help(
            "Sampling temperature the agents are given (llm.sampling_parameters); the learner computes each "
            "row's log-probs at the temperature the proxy recorded for its calls (this one when none was), and "
            "the run warns once when they differ."
        ),
    )
    top_p: float = field(default=1.0, metadata=_help("Nucleus sampling: the probability mass kept."))
    max_tokens: int = field(default=16, metadata=_help("Longest response of one LLM call."))

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("temperature", self.temperature > 0, "must be greater than 0"),
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
        ]


@dataclass(frozen=True)
class ValidationSection(_Section):
    """Validation on agent.val_tasks, sampled as in training."""

    section: ClassVar[str] = "validation"

    every: int = field(default=10, metadata=_help("Validate every this many steps (0: no validation)."))
    samples: int = field(default=4, metadata=_help("Rollouts per validation task."))
    target: float | None = field(
        default=None, metadata=_help("Stop once the validation reward reaches it (unset: never).")
    )
    solved_at: float = field(
        default=1.0, metadata=_help("A rollout with at least this reward counts as solved.")
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("every", self.every >= 0, "must be at least 0 (0: no validation)"),
            ("samples", self.samples >= 1, "must be at least 1"),
        ]


@dataclass(frozen=True)
class CheckpointSection(_Section):
    """Checkpoints under experiment.output_dir, for ``train --resume``."""

    section: ClassVar[str] = "checkpoint"

    every: int = field(
        default=10,
        metadata=_help(
            "Save a checkpoint every this many steps (0: only on an interrupt and at the end). A run "
            "interrupted (Ctrl-C) also saves one; a run killed outright redoes the steps since the last one "
            "from their stored batches."
        ),
    )
    keep: int = field(default=2, metadata=_help("Checkpoints kept (older ones are removed)."))

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("every", self.every >= 0, "must be at least 0"),
            ("keep", self.keep >= 1, "must be at least 1"),
        ]


@dataclass(frozen=True)
class ServicesSection(_Section):
    """Services already running (else started by the run), and the threads of those it starts."""

    section: ClassVar[str] = "services"

    store: str = field(default="", metadata=_help('Address of a running store ("": one is started).'))
    proxy: str = field(default="", metadata=_help('Address of a running proxy\'s HTTP side ("": started).'))
    proxy_grpc: str = field(
        default="", metadata=_help("Address of that proxy's gRPC service (\"\": services.store's).")
    )
    engine: str = field(
        default="", metadata=_help('Address of a running engine ("": engine.kind says what is started).')
    )
    trainer_threads: int = field(default=1, metadata=_help("torch threads of the trainer's process."))
    engine_threads: int = field(default=1, metadata=_help("torch threads of the engine the run starts."))
    store_path: str = field(
        default="store.db",
        metadata=_help(
            'The SQLite file of the store the run starts, relative to experiment.output_dir ("": in '
            "memory, lost with the process). On file, a store that dies is restarted with every rollout and "
            "batch, and a resumed run takes the batches it had already drawn instead of drawing new ones."
        ),
    )
    store_postgres: str = field(
        default="",
        metadata=_help(
            "A PostgreSQL database (a postgresql:// URL) for the store the run starts, instead of "
            "store_path's SQLite file (the [postgres] extra). A fresh run needs it empty of rollouts; a "
            "resumed run finds its rollouts and batches there."
        ),
    )
    restarts: int = field(
        default=5,
        metadata=_help(
            "Restarts of each child the run started (store server, engine, runners) before the run gives up "
            "with that child's own last lines (0: a child that dies ends the run)."
        ),
    )
    restart_backoff: float = field(
        default=1.0,
        metadata=_help("Seconds before the first restart of a dead child; doubled each time, at most 30."),
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("restarts", self.restarts >= 0, "must be at least 0"),
            ("restart_backoff", self.restart_backoff >= 0, "must be at least 0 seconds"),
        ]


@dataclass(frozen=True)
class EngineSection(_Section):
    """What serves the policy to the agents (through the proxy) and takes each update's weights."""

    section: ClassVar[str] = "engine"

    kind: EngineKind = field(
        default="embedded",
        metadata=_help(
            '"embedded": the project\'s CPU engine; "vllm": a vLLM server, the same code as on GPUs.'
        ),
    )
    python: str = field(
        default="",
        metadata=_help(
            f'vLLM: the Python interpreter that has vLLM installed ("": ${environment.VLLM_PYTHON}, '
            "else the project's .venv-vllm, else this interpreter)."
        ),
    )
    max_model_len: int = field(
        default=1024, metadata=_help("vLLM: the longest prompt plus response it schedules (--max-model-len).")
    )
    kv_cache_gib: float = field(
        default=1.0, metadata=_help("vLLM on CPU: GiB of memory for its KV cache (VLLM_CPU_KVCACHE_SPACE).")
    )
    args: tuple[str, ...] = field(default=(), metadata=_help("vLLM: more server arguments."))

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("max_model_len", self.max_model_len >= 16, "must be at least 16"),
            ("kv_cache_gib", self.kv_cache_gib > 0, "must be greater than 0"),
        ]


@dataclass(frozen=True)
class LearnerSection(_Section):
    """How the update is computed: one process, or several torch.distributed ranks sharding the model."""

    section: ClassVar[str] = "learner"

    ranks: int = field(
        default=1,
        metadata=_help(
            "Ranks of the learner: 1 runs in the trainer's process; more run as Ray actors in a placement "
            "group, the model sharded by FSDP2 and each rank taking whole groups of the batch."
        ),
    )
    dist_backend: DistBackend = field(
        default="",
        metadata=_help(
            'torch.distributed backend: "gloo" (CPU), "nccl" (CUDA); "": nccl with CUDA, else gloo.'
        ),
    )
    ray_address: str = field(
        default="",
        metadata=_help('The Ray cluster the ranks are placed on ("": a local Ray the run starts).'),
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [("ranks", self.ranks >= 1, "must be at least 1")]


@dataclass(frozen=True)
class VerlSection(_Section):
    """What only ``lightning-grpc train --backend verl`` uses: the cluster, and verl's own knobs by name."""

    section: ClassVar[str] = "verl"

    n_gpus_per_node: int = field(default=1, metadata=_help("GPUs per node of the cluster."))
    nnodes: int = field(default=1, metadata=_help("Nodes of the cluster."))
    micro_batch_size_per_gpu: int = field(
        default=4,
        metadata=_help(
            "Rows per GPU per forward/backward pass (verl: ppo_micro_batch_size_per_gpu and the log-prob ones)."
        ),
    )
    tensor_parallel_size: int = field(
        default=1, metadata=_help("vLLM tensor parallelism per rollout replica.")
    )
    gpu_memory_utilization: float = field(
        default=0.5, metadata=_help("Share of each GPU's memory vLLM may take, in (0, 1].")
    )
    overrides: tuple[str, ...] = field(
        default=(),
        metadata=_help('Any other key of verl\'s trainer config, as "dotted.key=value" (applied last).'),
    )

    def rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("n_gpus_per_node", self.n_gpus_per_node >= 1, "must be at least 1"),
            ("nnodes", self.nnodes >= 1, "must be at least 1"),
            ("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu >= 1, "must be at least 1"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, "must be at least 1"),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "must be in (0, 1]"),
            (
                "overrides",
                all("=" in o and not o.startswith("=") for o in self.overrides),
                'must be "dotted.key=value" strings',
            ),
        ]


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

    @property
    def store_file(self) -> Path | None:
        """The SQLite file of the store the run starts (None: in memory, or a store the run does not start)."""
        if self.services.store or self.services.store_postgres or not self.services.store_path:
            return None
        return self.output_dir / self.services.store_path

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (enum members by their lower-case names, as a file gives them)."""
        out = _plain(dataclasses.asdict(self))
        out.pop("base_dir")
        return out  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


#: Each table of the file and the dataclass that holds it.
SECTIONS: dict[str, type] = {
    name: hint for name, hint in get_type_hints(ExperimentConfig).items() if name != "base_dir"
}

#: Settings kept in one place and copied where else they are used: "section.key" -> where it is set.
#: A file that still gives the copy is told where the setting lives now.
DERIVED: dict[str, str] = {
    # log-probs are computed at the temperature the engine sampled at
    "optim.temperature": "sampling.temperature",
}


def file_keys(kind: type) -> list[dataclasses.Field[Any]]:
    """The fields of a section a file may set (not those derived from another section's)."""
    section = next(name for name, hint in SECTIONS.items() if hint is kind)
    return [f for f in dataclasses.fields(kind) if f"{section}.{f.name}" not in DERIVED]


def load_experiment(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ExperimentConfig:
    """The experiment a TOML or YAML file describes, with ``overrides`` ("section.key" -> value) applied."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        yaml = import_extra("yaml", "train")
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
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}] (known: {', '.join(SECTIONS)})")
        if not isinstance(value, Mapping):
            raise ConfigError(f"[{name}] must be a table of settings")
        sections[name] = _section(name, SECTIONS[name], value)
    for copy, source in DERIVED.items():  # the one place a setting lives, copied where it is also used
        section, _, key = copy.partition(".")
        from_section, _, from_key = source.partition(".")
        value = getattr(sections.get(from_section) or SECTIONS[from_section](), from_key)
        try:
            sections[section] = dataclasses.replace(
                sections.get(section) or SECTIONS[section](), **{key: value}
            )
        except ValueError:  # a value the source section refuses, naming its own key (check_experiment)
            pass
    config = ExperimentConfig(**sections, base_dir=str(base_dir))
    check_experiment(config)
    return config


def _section(name: str, kind: type, values: Mapping[str, Any]) -> Any:
    hints = get_type_hints(kind)
    known = {f.name for f in file_keys(kind)}
    checked = {}
    for key, value in values.items():
        if f"{name}.{key}" in DERIVED:
            raise ConfigError(
                f"{name}.{key} moved to {DERIVED[f'{name}.{key}']}: set it there (one setting, one place)"
            )
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        checked[key] = _typed(f"{name}.{key}", hints[key], value)
    try:
        return kind(**checked)
    except ConfigError:
        raise
    except ValueError as exc:  # the section's own checks name the key
        raise ConfigError(f"{name}.{exc}") from None


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def type_name(hint: Any) -> str:
    """How a field's type reads in a file: ``int``, ``"sync" | "async"``, ``list of str``, ``float | unset``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if _is_enum(hint):
        return " | ".join(json.dumps(m.name.lower()) for m in hint)
    if origin is Union or origin is types.UnionType:
        return " | ".join("unset" if a is type(None) else type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return f"[{', '.join(type_name(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint))


def _allowed(hint: Any) -> list[Any]:
    """The values a Literal or an enum allows, as a file spells them."""
    if _is_enum(hint):
        return [m.name.lower() for m in hint]
    return list(get_args(hint))


def _typed(where: str, hint: Any, value: Any) -> Any:
    """``value`` as the type ``hint`` wants (read with get_origin / get_args), or a ConfigError naming it."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        for member in args:
            if member is not type(None):
                try:
                    return _typed(where, member, value)
                except ConfigError:
                    pass
    elif origin is Literal or _is_enum(hint):
        if _is_enum(hint) and isinstance(value, hint):
            return value
        allowed = _allowed(hint)
        for choice in allowed:
            if type(value) is type(choice) and value == choice:
                return hint[value.upper()] if _is_enum(hint) else value
        raise ConfigError(
            f"{where} must be one of {', '.join(json.dumps(a) for a in allowed)} "
            f"(got {json.dumps(value, default=str)})"
        )
    elif origin is tuple:
        variadic = len(args) == 2 and args[1] is Ellipsis
        if isinstance(value, list | tuple) and (variadic or len(value) == len(args)):
            kinds = [args[0]] * len(value) if variadic else list(args)
            try:
                return tuple(_typed(where, kind, v) for kind, v in zip(kinds, value, strict=True))
            except ConfigError:
                pass
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is str and isinstance(value, str):
        return value
    raise ConfigError(
        f"{where} has the wrong kind of value: {json.dumps(value, default=str)} (wanted {type_name(hint)})"
    )


def check_experiment(c: ExperimentConfig) -> None:
    """Refuse what cannot run, naming the key: each section's own checks, then the rules across sections."""
    for f in dataclasses.fields(c):
        section = getattr(c, f.name)
        if isinstance(section, _Section):
            section.check()
    rules = [
        (
            "agent.processes",
            c.agent.processes >= 1 or bool(c.services.store),
            "may be 0 only when services.store names a running store that the runners serve",
        ),
        (
            "experiment.async_groups",
            c.experiment.mode != "async" or c.experiment.async_groups >= c.data.batch_size,
            "must be at least data.batch_size in async mode",
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
    for key in ("train_tasks", "val_tasks"):
        value = getattr(c.agent, key)
        if value and not c.path(value).is_file():
            raise ConfigError(f"agent.{key}: no file {c.path(value)}")


def check_agent_module(c: ExperimentConfig) -> None:
    """Refuse an agent whose module the runners will not find, before anything starts.

    The runners import ``agent.agent`` as ``python -m`` would, from the folder the command runs in (and
    ``PYTHONPATH``); a file path (``path/file.py:name``) is relative to that folder too. The module is
    only looked up here, not run.
    """
    if not c.agent.agent or c.agent.processes == 0:
        return
    module, _, _ = c.agent.agent.partition(":")
    here = Path.cwd()
    found = (here / module).is_file() if module.endswith(".py") else _module_found(module, here)
    if not found:
        raise ConfigError(
            f"agent.agent {c.agent.agent!r}: no module {module!r} in {here} or on PYTHONPATH (the runners import"
            " the agent from the folder the command runs in; task files and output_dir are relative to the"
            " experiment file)"
        )


def _module_found(module: str, here: Path) -> bool:
    added = str(here) not in sys.path
    if added:
        sys.path.insert(0, str(here))
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or an empty name
        return False
    finally:
        if added:
            sys.path.remove(str(here))


def _toml_value(value: Any) -> str:
    """A default as a file would write it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return json.dumps(value.name.lower())
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"field {f.name!r} has no default")
    return f.default_factory()


def describe_config(width: int = 100) -> str:
    """Every section and key of an experiment file with its type, default and help, from the dataclasses."""
    lines = [
        "The keys of an experiment file (TOML tables, or YAML mappings of the same names); relative paths",
        "are taken from the file's folder. Override one with --set SECTION.KEY=VALUE.",
    ]
    for name, kind in SECTIONS.items():
        doc = (kind.__doc__ or "").strip().split("\n\n")[0]
        lines += ["", f"[{name}]"]
        if doc:
            lines += textwrap.wrap(
                " ".join(doc.split()), width, initial_indent="  # ", subsequent_indent="  # "
            )
        hints = get_type_hints(kind)
        for f in file_keys(kind):
            lines.append(f"  {f.name}: {type_name(hints[f.name])} = {_toml_value(_default(f))}")
            lines += textwrap.wrap(
                f.metadata.get("help", ""), width, initial_indent=" " * 6, subsequent_indent=" " * 6
            )
    moved = [f"  {copy}: set as {source}" for copy, source in DERIVED.items()]
    return "\n".join([*lines, "", "Set in one place and used elsewhere too:", *moved]) + "\n"


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


def config_reference_markdown(example: Path | None = None, example_name: str = "") -> str:
    """docs/configuration.md: what :func:`describe_config` lists (every section and key with its type, default
    and help, from the dataclasses), as Markdown tables. ``example``: an experiment file (TOML) whose values
    are shown beside the defaults, named ``example_name`` (its path from the repository root)."""
    shown: dict[str, Any] = tomllib.loads(example.read_text()) if example is not None else {}

    def cell(text: str) -> str:  # a table cell: one line, no column break, no HTML tag
        return " ".join(text.split()).replace("|", "\\|").replace("<", "\\<")

    def code(text: str) -> str:
        return f"`{text}`".replace("|", "\\|")

    def wrapped(text: str, indent: str = "") -> list[str]:  # a paragraph (or list item), 110 wide
        text = " ".join(text.replace("``", "`").split())
        return textwrap.wrap(
            text, 110, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )

    demo = f" [{example_name}](../{example_name})" if example_name else " the example file"
    lines = [
        "# Configuration reference: the experiment file",
        "",
        "<!-- Generated from the dataclasses of lightning_grpc/training/experiment.py by",
        "`make docs-reference` (scripts/gen_docs.py): edit their help there, not this page. -->",
        "",
        *wrapped(
            "`lightning-grpc train CONFIG` runs the experiment one file describes: TOML tables, or YAML"
            " mappings of the same names. Every section and key is below with its type, its default (the"
            " code's: what a key the file leaves out gets) and its meaning; `lightning-grpc train"
            " --help-config` prints the same, from the same dataclasses. Relative paths are taken from the"
            " file's folder; `--set SECTION.KEY=VALUE` overrides a key (VALUE read as JSON, else as text)."
            " An unknown key, or a value of the wrong kind, stops the run before anything starts, naming it."
            + (
                f" The column Demo is what{demo} (`make demo`) sets, blank where it keeps the default: values"
                " chosen for its tiny model and two-digit answers."
                if example is not None
                else ""
            )
            + " What a run records each step is in the [metrics reference](metrics.md)."
        ),
        "",
        *wrapped("Sections: " + ", ".join(f"[`[{name}]`](#{name})" for name in SECTIONS) + "."),
    ]
    columns = ["Key", "Type", "Default", *(["Demo"] if example is not None else []), "Meaning"]
    for name, kind in SECTIONS.items():
        doc = (kind.__doc__ or "").strip().split("\n\n")[0]
        lines += ["", f"## `[{name}]`", "", *wrapped(doc), "", f"| {' | '.join(columns)} |"]
        lines.append("| --- " * len(columns) + "|")
        hints = get_type_hints(kind)
        for f in file_keys(kind):
            row = [code(f.name), code(type_name(hints[f.name])), code(_toml_value(_default(f)))]
            if example is not None:
                value = shown.get(name, {}).get(f.name)
                value = tuple(value) if isinstance(value, list) else value
                row.append("" if value is None else code(_toml_value(value)))
            lines.append("| " + " | ".join([*row, cell(f.metadata.get("help", ""))]) + " |")
    lines += ["", "## Set in one place, used elsewhere", ""]
    for copy, source in DERIVED.items():
        lines += wrapped(
            f"- `{copy}` is set as `{source}` (a file that sets `{copy}` is refused, and told so).", "  "
        )
    return "\n".join(lines) + "\n"
