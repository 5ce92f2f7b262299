"""The learning loop through the whole system: engine, server (Store, Trainer, proxy), runners and the
learner, each a real process; the combination-lock agent calls the tiny model through the proxy with the
official ``openai`` client. Short runs with fixed seeds."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc.cli.train_commands import report
from lightning_grpc.examples.combination_lock import train_tasks, val_tasks, write_jsonl
from lightning_grpc.trainer.experiment import ConfigError, experiment_from_dict, load_experiment
from lightning_grpc.trainer.loop import run_experiment

pytestmark = pytest.mark.timeout(600)


def experiment(tmp_path: Path, model: Path, **sections: dict[str, Any]) -> Any:
    write_jsonl(train_tasks(), tmp_path / "train.jsonl")
    write_jsonl(val_tasks()[:4], tmp_path / "val.jsonl")
    raw: dict[str, Any] = {
        "experiment": {"name": "t", "output_dir": "out", "seed": 0, "steps": 4},
        "agent": {
            "agent": "lightning_grpc.examples.combination_lock:agent",
            "train_tasks": "train.jsonl",
            "val_tasks": "val.jsonl",
            "concurrency": 64,
        },
        "model": {"path": str(model)},
        "data": {"group_size": 4, "batch_size": 8},
        "sampling": {"temperature": 1.0, "max_tokens": 2},
        "optim": {"lr": 5e-3},
        "ppo": {"loss_agg_mode": "per-rollout-mean"},
        "validation": {"every": 0, "samples": 2},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return experiment_from_dict(raw, base_dir=tmp_path)


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_short_run_improves_the_reward_over_the_untrained_model(tmp_path: Path, tiny_model: Path) -> None:
    config = experiment(
        tmp_path,
        tiny_model,
        experiment={"steps": 30},
        data={"group_size": 8, "batch_size": 16},
        agent={"concurrency": 128},
        validation={"every": 10, "samples": 2},
    )
    result = run_experiment(config, progress=False)
    history = rows(config.output_dir / "metrics.csv")
    first = sum(float(r["reward_mean"]) for r in history[:3]) / 3  # untrained: the first steps
    last = sum(float(r["reward_mean"]) for r in history[-5:]) / 5
    assert last >= first + 0.2, (first, last)
    assert (
        result.checkpoint == config.output_dir / "final"
        and (result.checkpoint / "model.safetensors").exists()
    )
    assert (config.output_dir / "reward.png").stat().st_size > 1000
    # the engine served each new policy: later calls recorded later versions
    assert [int(float(r["policy_version"])) for r in history] == list(range(1, 31))
    text = report(result, None)
    assert "validation reward: before" in text and "trained checkpoint" in text and "assistant:" in text


def test_resume_from_a_checkpoint_continues_the_same_run(tmp_path: Path, tiny_model: Path) -> None:
    config = experiment(tmp_path, tiny_model, checkpoint={"every": 2, "keep": 5})
    run_experiment(config, progress=False)
    whole = rows(config.output_dir / "metrics.csv")
    again = experiment(
        tmp_path, tiny_model, checkpoint={"every": 2, "keep": 5}, experiment={"output_dir": "again"}
    )
    run_experiment(again, resume=config.output_dir / "checkpoints" / "step-000002", progress=False)
    resumed = rows(again.output_dir / "metrics.csv")
    assert [r["step"] for r in resumed] == ["3", "4"]
    for name in ("reward_mean", "pg_loss", "grad_norm", "policy_version"):
        assert [r[name] for r in resumed] == [r[name] for r in whole[2:]], name


def test_async_mode_carries_groups_over_and_drops_stale_calls(tmp_path: Path, tiny_model: Path) -> None:
    config = experiment(
        tmp_path,
        tiny_model,
        experiment={"steps": 4, "mode": "async", "async_groups": 16, "max_staleness": 0},
    )
    run_experiment(config, progress=False)
    history = rows(config.output_dir / "metrics.csv")
    assert sum(float(r["carried_over_groups"]) for r in history) > 0
    assert sum(float(r.get("drop_stale_policy") or 0) for r in history) > 0


def test_the_config_file_is_checked_and_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n')
    bad = {
        "[optim]\nlrr = 1": "optim.lrr",
        "[optim]\nlr = -1": "optim.lr",
        "[data]\ngroup_size = 'x'": "data.group_size",
        "[nonsense]\na = 1": "[nonsense]",
        "[agent]\nagent = 'nocolon'": "agent.agent",
    }
    base = '[agent]\nagent = "m:a"\ntrain_tasks = "t.jsonl"\n[model]\npath = "m"\n'
    for text, named in bad.items():
        path = tmp_path / "c.toml"
        path.write_text(text + "\n" if text.startswith("[agent]") else base + text + "\n")
        with pytest.raises(ConfigError) as info:
            load_experiment(path)
        assert named in str(info.value), (text, info.value)
    (tmp_path / "c.yaml").write_text(
        json.dumps({"agent": {"agent": "m:a", "train_tasks": "t.jsonl"}, "model": {"path": "m"}})
    )
    assert load_experiment(tmp_path / "c.yaml").agent.agent == "m:a"
