"""The reference pages generated from the code (docs/configuration.md, docs/metrics.md) are what the code
gives now, and the metrics table says what every metric is: those an update writes with every option on, the
no-signal watch's here; those of whole runs in test_training.py."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from lightning_grpc.training import ppo
from lightning_grpc.training.experiment import SECTIONS, _default, _toml_value, file_keys
from lightning_grpc.training.learner import Learner, OptimConfig, UpdateInput
from lightning_grpc.training.metrics import METRICS, documented, undocumented
from lightning_grpc.training.signal import CONDITIONS, SignalWatcher

ROOT = Path(__file__).resolve().parents[2]


def gen_docs() -> ModuleType:
    """scripts/gen_docs.py, the generator `make docs-reference` runs."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_what_the_code_gives() -> None:
    generator = gen_docs()
    for path, text in generator.pages().items():
        name = path.relative_to(ROOT).as_posix()
        assert path.is_file(), f"{name} is missing: run {generator.COMMAND}"
        written = path.read_text()
        if written != text:
            diff = "".join(
                list(
                    difflib.unified_diff(
                        written.splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        f"{name} (written)",
                        f"{name} (from the code)",
                    )
                )[:40]
            )
            pytest.fail(f"{name} differs from what the code gives: run {generator.COMMAND}\n{diff}")


def test_the_configuration_reference_has_every_key_with_its_default() -> None:
    generator = gen_docs()
    page = generator.pages()[ROOT / "docs" / "configuration.md"]
    for name, kind in SECTIONS.items():
        section = page.split(f"\n## `[{name}]`\n", 1)[1].split("\n## ", 1)[0]
        for f in file_keys(kind):
            default = _toml_value(_default(f)).replace("|", "\\|")
            assert f"| `{f.name}` | " in section and f"| `{default}` |" in section, f"{name}.{f.name}"
    # the demo's file beside the defaults: the code's learning rate, then the demo's
    with (ROOT / "examples" / "combination_lock" / "config.toml").open("rb") as f:
        demo_lr = tomllib.load(f)["optim"]["lr"]
    assert f"| `lr` | `float` | `0.0003` | `{demo_lr}` |" in page


def test_a_metric_name_is_matched_exactly_or_by_its_family() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names)), "a metric is in the table twice"
    for name, entry in {
        "pg_clipfrac": "pg_clipfrac",
        "drop_stale_policy": "drop_<reason>",
        "trajectory_fallback_prompt_not_extension": "trajectory_fallback_<reason>",
        "cpu_engine-gate_seconds": "cpu_<process>_seconds",
        "update_rank1_seconds": "update_rank<N>_seconds",
        "update_seconds": "update_seconds",
        "rank0_tokens": "rank<N>_tokens",
        "tokens": "tokens",
        "stalled_zero_variance": "stalled_<condition>",
        "actor/pg_clipfrac": "<group>/<name>",
    }.items():
        found = documented(name)
        assert found is not None and found.name == entry, (name, found)
    assert undocumented(["reward_mean", "no_such_metric", "drop_"]) == ["drop_", "no_such_metric"]


def batch(recorded_shift: float | None = None) -> UpdateInput:
    """Two GRPO groups of two one-row rollouts (rewards 1/0 and 0/1: each group has a spread), 3 prompt and
    3 response tokens; ``recorded_shift``: the rows carry the proxy's log-probs, this far above -8."""
    rng = np.random.default_rng(0)
    rows, prompt, response = 4, 3, 3
    ids = rng.integers(1, 50, (rows, prompt + response))
    arrays: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": np.ones((rows, prompt + response), np.int64),
        "position_ids": np.tile(np.arange(prompt + response), (rows, 1)),
        "responses": ids[:, prompt:],
        "response_mask": np.ones((rows, response), np.int64),
        "rollout_index": np.arange(rows),
        "rollout_rewards": np.array([1.0, 0.0, 0.0, 1.0], np.float32),
        "has_rollout_log_probs": np.full(rows, recorded_shift is not None),
    }
    if recorded_shift is not None:
        arrays["rollout_log_probs"] = np.full((rows, response), -8.0 + recorded_shift, np.float32)
    return UpdateInput(arrays, np.array(["g0", "g0", "g1", "g1"], dtype=object))


def test_every_metric_an_update_writes_is_in_the_table_and_pg_clipfrac_is_what_the_table_says(
    tiny_model: Path,
) -> None:
    """With the defaults (one optimiser step, recomputed old log-probs) the ratio is 1: pg_clipfrac, its lower
    bound and ppo_kl are exactly 0. Against the proxy's recorded log-probs (old_log_probs = "rollout"), or
    from the second optimiser step on, the ratio leaves 1 and the clip acts."""
    plain = Learner(tiny_model, device="cpu").update(batch())
    assert plain["pg_clipfrac"] == plain["pg_clipfrac_lower"] == plain["ppo_kl"] == 0.0, plain
    every_option = Learner(
        tiny_model,
        device="cpu",
        ppo_config=ppo.PPOConfig(use_kl_loss=True, entropy_coeff=0.01),
        optim=OptimConfig(old_log_probs="rollout"),
    ).update(batch(recorded_shift=-4.0))  # recorded far below the learner's: r far above 1 + clip_ratio_high
    assert {"kl", "kl_loss", "kl_coef", "entropy_loss", "log_prob_gap_mean"} <= set(every_option)
    assert every_option["pg_clipfrac"] > 0, every_option
    assert undocumented(plain) == [] and undocumented(every_option) == []
    epochs = Learner(tiny_model, device="cpu", optim=OptimConfig(lr=0.05, ppo_epochs=4)).update(batch())
    assert math.isfinite(epochs["pg_clipfrac"]) and epochs["pg_clipfrac"] > 0, epochs


def test_the_no_signal_watch_writes_metrics_the_table_has() -> None:
    watcher = SignalWatcher(2, conditions=CONDITIONS)
    watcher.observe(1, {"zero_variance_groups": 2.0, "groups": 2.0})
    assert set(watcher.metrics()) == {"stall_window", *(f"stalled_{c}" for c in CONDITIONS)}
    assert undocumented(watcher.metrics()) == []


def test_every_section_of_the_config_has_its_own_heading() -> None:
    """The page's anchors (the links of its contents) are the section names."""
    page = gen_docs().pages()[ROOT / "docs" / "configuration.md"]
    for name in SECTIONS:
        assert f"[`[{name}]`](#{name})" in page and f"\n## `[{name}]`\n" in page
    assert [f.name for f in dataclasses.fields(OptimConfig) if f.name not in page] == []
