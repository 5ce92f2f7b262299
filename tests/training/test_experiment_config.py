"""The experiment file's sections: typed dataclasses with help, generated --help-config, one place per setting."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc.batching.options import Aggregation, FailurePolicy
from lightning_grpc.training.experiment import (
    DERIVED,
    SECTIONS,
    ConfigError,
    experiment_from_dict,
    file_keys,
    load_experiment,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.toml"))


def minimal(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n')
    raw: dict[str, Any] = {"agent": {"agent": "m:a", "train_tasks": "t.jsonl"}, "model": {"path": "m"}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def test_every_section_is_a_frozen_dataclass_whose_every_field_has_help() -> None:
    assert "base_dir" not in SECTIONS and len(SECTIONS) == 13
    for name, kind in SECTIONS.items():
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
        for f in dataclasses.fields(kind):
            text = f.metadata.get("help", "")
            assert isinstance(text, str) and len(text) > 10, f"{name}.{f.name} has no help"


def test_help_config_lists_every_key_with_its_type_default_and_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lightning_grpc.cli.main", "train", "--help-config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    listed: dict[str, dict[str, str]] = {}
    section = ""
    for line in done.stdout.splitlines():
        if header := re.fullmatch(r"\[(\w+)\]", line):
            section = header.group(1)
            listed[section] = {}
        elif section and (key := re.match(r"  (\w+): (.+) = (.+)$", line)):
            listed[section][key.group(1)] = line
    assert list(listed) == list(SECTIONS)
    for name, kind in SECTIONS.items():
        assert list(listed[name]) == [f.name for f in file_keys(kind)], name
        for f in file_keys(kind):  # each key's help follows it
            assert " ".join(f.metadata["help"].split()[:4]) in " ".join(done.stdout.split()), (
                f"{name}.{f.name}"
            )
    assert listed["experiment"]["mode"] == '  mode: "sync" | "async" = "sync"'
    assert listed["data"]["aggregation"] == '  aggregation: "transition" | "trajectory" = "transition"'
    assert listed["agent"]["command"] == "  command: list of str = []"
    assert listed["validation"]["target"] == "  target: float | unset = unset"
    # a derived setting is not a key of its own: the file sets it where it lives
    assert "temperature" not in listed["optim"] and "temperature" in listed["sampling"]
    assert "optim.temperature: set as sampling.temperature" in done.stdout


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("experiment.mode", "parallel", '"sync", "async"'),
        ("data.aggregation", "per_call", '"transition", "trajectory"'),
        ("data.failure_policy", "ignore", '"drop_group", "drop_rollout", "fill"'),
        ("engine.kind", "sglang", '"embedded", "vllm"'),
        ("learner.dist_backend", "mpi", '"", "gloo", "nccl"'),
        ("optim.old_log_probs", "cached", '"recompute", "rollout"'),
        ("ppo.kl_loss_type", "k9", '"kl", "k1"'),
        ("experiment.mode", 1, '"sync", "async"'),
    ],
)
def test_a_bad_choice_names_the_key_and_the_allowed_values(
    tmp_path: Path, key: str, value: Any, allowed: str
) -> None:
    section, _, name = key.partition(".")
    with pytest.raises(ConfigError) as info:
        experiment_from_dict(minimal(tmp_path, **{section: {name: value}}), base_dir=tmp_path)
    message = str(info.value)
    assert message.startswith(f"{key} must be one of {allowed}"), message
    assert json.dumps(value) in message


def test_choices_are_read_into_enums_and_literals(tmp_path: Path) -> None:
    config = experiment_from_dict(
        minimal(
            tmp_path,
            data={"aggregation": "trajectory", "failure_policy": "fill"},
            engine={"kind": "vllm"},
            experiment={"mode": "async", "async_groups": 16},
        ),
        base_dir=tmp_path,
    )
    assert config.data.aggregation is Aggregation.TRAJECTORY
    assert config.data.failure_policy is FailurePolicy.FILL
    assert config.engine.kind == "vllm" and config.experiment.mode == "async"
    # written back as a file gives them
    plain = config.to_dict()
    assert plain["data"]["aggregation"] == "trajectory" and plain["data"]["failure_policy"] == "fill"
    json.dumps(plain)


def test_values_of_the_wrong_kind_name_the_key_and_the_wanted_type(tmp_path: Path) -> None:
    cases = {
        ("optim", "betas"): ([0.9], "optim.betas", "[float, float]"),
        ("agent", "command"): (["node", 3], "agent.command", "list of str"),
        ("model", "init"): (1, "model.init", "bool"),
        ("validation", "target"): ("high", "validation.target", "float | unset"),
        ("data", "group_size"): (2.5, "data.group_size", "int"),
    }
    for (section, key), (value, named, wanted) in cases.items():
        with pytest.raises(ConfigError) as info:
            experiment_from_dict(minimal(tmp_path, **{section: {key: value}}), base_dir=tmp_path)
        assert named in str(info.value) and f"(wanted {wanted})" in str(info.value), info.value
    config = experiment_from_dict(
        minimal(tmp_path, optim={"betas": [1, 0.5]}, validation={"target": 1}), base_dir=tmp_path
    )
    assert config.optim.betas == (1.0, 0.5) and config.validation.target == 1.0


def test_each_section_checks_its_own_keys_and_the_central_check_the_rest(tmp_path: Path) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("experiment", {"steps": 0}, "experiment.steps must be at least 1"),
        ("data", {"batch_size": 0}, "data.batch_size must be at least 1"),
        ("sampling", {"temperature": 0.0}, "sampling.temperature must be greater than 0"),
        ("model", {"init_heads": 3}, "model.init_heads must divide model.init_hidden_size"),
        ("verl", {"overrides": ["=x"]}, 'verl.overrides must be "dotted.key=value" strings'),
        ("optim", {"lr": 0}, "optim.lr must be a positive number"),
        ("ppo", {"clip_ratio_c": 1.0}, "ppo.clip_ratio_c must be > 1"),
    ]
    for section, values, named in cases:
        with pytest.raises(ConfigError, match=re.escape(named)):
            experiment_from_dict(minimal(tmp_path, **{section: values}), base_dir=tmp_path)
    # rules across sections
    with pytest.raises(ConfigError, match=r"experiment\.async_groups must be at least data\.batch_size"):
        experiment_from_dict(minimal(tmp_path, experiment={"mode": "async"}), base_dir=tmp_path)


def test_the_sampling_temperature_lives_in_one_place(tmp_path: Path) -> None:
    assert DERIVED == {"optim.temperature": "sampling.temperature"}
    config = experiment_from_dict(minimal(tmp_path, sampling={"temperature": 0.7}), base_dir=tmp_path)
    assert config.optim.temperature == 0.7  # the learner's log-probs use the sampling temperature
    assert experiment_from_dict(minimal(tmp_path), base_dir=tmp_path).optim.temperature == 1.0
    with pytest.raises(ConfigError) as info:
        experiment_from_dict(minimal(tmp_path, optim={"temperature": 0.7}), base_dir=tmp_path)
    assert str(info.value).startswith("optim.temperature moved to sampling.temperature")
    path = tmp_path / "c.toml"
    path.write_text('[agent]\nagent = "m:a"\ntrain_tasks = "t.jsonl"\n[model]\npath = "m"\n')
    with pytest.raises(ConfigError, match=r"optim\.temperature moved to sampling\.temperature"):
        load_experiment(path, {"optim.temperature": 1.0})


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_every_example_config_loads(path: Path) -> None:
    config = load_experiment(path)
    assert config.optim.temperature == config.sampling.temperature
    assert config.agent.agent or config.agent.command


def test_there_are_example_configs() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("name", ["lr1e-3+clip", "-lock", "", "a" * 65, "two words"])
def test_a_run_name_the_store_cannot_use_in_ids_is_refused_by_name(name: str, tmp_path: Path) -> None:
    """The name goes into every group, batch and resources id: one the store refuses is a config error."""
    (tmp_path / "t.jsonl").write_text("{}\n")
    (tmp_path / "model").mkdir()
    raw = {
        "experiment": {"name": name},
        "agent": {"agent": "m:agent", "train_tasks": "t.jsonl"},
        "model": {"path": "model"},
    }
    with pytest.raises(ConfigError, match=r"experiment\.name must be 1-64 letters"):
        experiment_from_dict(raw, base_dir=tmp_path)
    fine = {**raw, "experiment": {"name": "lr1e-3_clip.v2"}}
    assert experiment_from_dict(fine, base_dir=tmp_path).experiment.name == "lr1e-3_clip.v2"
