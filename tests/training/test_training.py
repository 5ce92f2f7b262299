"""The learning loop through the whole system: engine, server (Store, Trainer, proxy), runners and the
learner, each a real process; the combination-lock agent calls the tiny model through the proxy with the
official ``openai`` client. Short runs with fixed seeds."""

from __future__ import annotations

import asyncio
import csv
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc.cli.train_commands import report
from lightning_grpc.client import StoreClient
from lightning_grpc.engine import EngineProcess
from lightning_grpc.examples.combination_lock import AGENT_REF, train_tasks, val_tasks, write_jsonl
from lightning_grpc.processes import Background
from lightning_grpc.training.experiment import (
    ConfigError,
    check_agent_module,
    experiment_from_dict,
    load_experiment,
)
from lightning_grpc.training.loop import TrainingRun, run_experiment
from lightning_grpc.training.metrics import undocumented
from lightning_grpc.types import RolloutMode, RolloutStatus
from tests.conftest import ROOT
from tests.engine_fixtures import CLI, QUIET_ENV
from tests.helpers import start_services

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


def assert_documented(history: list[dict[str, str]]) -> None:
    """Every column the run wrote to metrics.csv says what it is in METRICS (docs/metrics.md's table)."""
    missing = undocumented({name for row in history for name in row})
    assert not missing, (
        f"metrics.csv columns missing from METRICS in lightning_grpc/training/metrics.py: {missing}"
        " (add each, or its family, then run make docs-reference)"
    )


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "two-fsdp-ranks"])
def test_a_short_run_improves_the_reward_over_the_untrained_model(
    tmp_path: Path, tiny_model: Path, ranks: int
) -> None:
    """The learner in the trainer's process, and as two FSDP ranks placed by Ray (gloo): the reward rises
    (measured with two ranks: 0.22 over the first three steps, 0.72 over the last five, in 80 s)."""
    if ranks > 1:
        pytest.importorskip("ray")
    config = experiment(
        tmp_path,
        tiny_model,
        experiment={"steps": 30},
        data={"group_size": 8, "batch_size": 16},
        agent={"concurrency": 128},
        validation={"every": 10, "samples": 2},
        learner={"ranks": ranks},
    )
    result = run_experiment(config, progress=False)
    history = rows(config.output_dir / "metrics.csv")
    assert_documented(history)  # validation, and with two ranks each rank's figures
    first = sum(float(r["reward_mean"]) for r in history[:3]) / 3  # untrained: the first steps
    last = sum(float(r["reward_mean"]) for r in history[-5:]) / 5
    assert last >= first + 0.2, (first, last)
    assert (
        result.checkpoint == config.output_dir / "final"
        and (result.checkpoint / "model.safetensors").exists()
    )
    assert (config.output_dir / "reward.png").stat().st_size > 1000
    # what the services said is on file beside the run's other output
    logs = config.output_dir / "logs"
    assert "event=server_started" in (logs / "server.log").read_text()
    assert "event=runner_started" in (logs / "runners-0.log").read_text()
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
    assert_documented(history)  # drop_stale_policy among them
    assert sum(float(r["carried_over_groups"]) for r in history) > 0
    assert sum(float(r.get("drop_stale_policy") or 0) for r in history) > 0


def test_a_run_trains_through_services_already_running(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[services] names a running store+proxy and engine, and agent.processes = 0 leaves the agents to a
    runner started by the user: the run starts nothing, and trains through them (with the engine's admin
    key, which the user gives it in $LIGHTNING_GRPC_ENGINE_ADMIN_KEY)."""
    engine = EngineProcess(
        tiny_model, served_model_name="policy", extra_args=["--threads", "1"], env=QUIET_ENV
    ).start()
    monkeypatch.setenv("LIGHTNING_GRPC_ENGINE_ADMIN_KEY", engine.admin_key)
    started: list[Background] = []
    try:
        services = start_services(engine.base_url, QUIET_ENV, started)
        store, proxy = services.store, services.proxy
        config = experiment(
            tmp_path,
            tiny_model,
            experiment={"steps": 2},
            agent={"processes": 0},
            services={"store": store, "proxy": proxy, "engine": engine.url},
        )
        run_experiment(config, progress=False)
        history = rows(config.output_dir / "metrics.csv")
        assert [r["step"] for r in history] == ["1", "2"]
        # CPU time is measured for every process the run started: none but the trainer itself
        assert sorted(k for k in history[0] if k.startswith("cpu_")) == ["cpu_trainer_seconds"]

        # the store the user started holds the run's rollouts, played by the user's runner
        async def stored() -> list[Any]:
            async with StoreClient(store) as client:
                return await client.query_rollouts()

        rollouts = asyncio.run(stored())
        train = [r for r in rollouts if r.mode == RolloutMode.TRAIN]
        assert len(train) == 2 * 8 * 4 and all(r.status == RolloutStatus.SUCCEEDED for r in train)
        assert len(rollouts) - len(train) == 2 * 4 * 2  # validation before and after: 4 tasks x 2 samples
        assert {r.latest_attempt.worker_id for r in rollouts if r.latest_attempt}.isdisjoint({""})
        # the engine the user started serves the trained policy
        with urllib.request.urlopen(f"{engine.url}/v1/models", timeout=10) as resp:
            assert resp.headers["x-policy-version"] == "2"
        assert all(process.alive() for process in started)
    finally:
        for process in reversed(started):
            process.stop(timeout=20)
        engine.stop()


def test_processes_0_needs_a_running_store(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match=r"agent\.processes may be 0 only when services\.store"):
        experiment(tmp_path, tiny_model, agent={"processes": 0})


def test_the_config_file_is_checked_and_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n')
    bad = {
        "[optim]\nlrr = 1": "optim.lrr",
        "[optim]\nlr = -1": "optim.lr",
        "[data]\ngroup_size = 'x'": "data.group_size",
        "[nonsense]\na = 1": "[nonsense]",
        "[agent]\nagent = 'nocolon'": "agent.agent",
        "[agent]\nagent = 'm:a'\ncommand = ['node', 'r.js']\ntrain_tasks = 't.jsonl'\n[model]\npath = 'm'": "agent.agent",
        "[agent]\ncommand = 'node r.js'\ntrain_tasks = 't.jsonl'\n[model]\npath = 'm'": "agent.command",
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
    (tmp_path / "c.toml").write_text(
        '[agent]\ncommand = ["node", "runner.js"]\ntrain_tasks = "t.jsonl"\n[model]\npath = "m"\n'
    )
    assert load_experiment(tmp_path / "c.toml").agent.command == ("node", "runner.js")


def test_an_agent_command_that_cannot_start_is_named(tmp_path: Path, tiny_model: Path) -> None:
    """agent.command runs a runner in any language; one that is not there fails the run at once, naming it
    (the TypeScript runner's training run is clients/typescript/test/training.test.ts)."""
    config = experiment(
        tmp_path, tiny_model, agent={"agent": "", "command": ["no-such-runner-binary", "--x"]}
    )
    with pytest.raises(RuntimeError, match="cannot start 'no-such-runner-binary'"):
        run_experiment(config, progress=False)
    # one that starts and exits before it serves: the run stops, with the command's last words
    quits = [sys.executable, "-c", "import sys; print('no agent here'); sys.exit(3)"]
    config = experiment(tmp_path, tiny_model, agent={"agent": "", "command": quits})
    with pytest.raises(RuntimeError, match=r"(?s)agent\.command .*exited before.*no agent here"):
        run_experiment(config, progress=False)


SPREAD_AGENT = '''
from lightning_grpc.examples.combination_lock import call_seed
from lightning_grpc.runner.llm import openai_client


async def agent(task, llm, rollout):
    """One call to the policy, seeded by the rollout (a resumed run samples the same tokens); the reward is
    the rollout's place in its group (its id ends in -r<index>)."""
    await openai_client(llm).chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": "Say anything."}],
        max_tokens=2,
        seed=call_seed(rollout.rollout_id, 0),
    )
    return float(rollout.rollout_id.rsplit("-r", 1)[1]) / 4
'''


def test_learner_ranks_train_as_fsdp_ranks_placed_by_ray_and_resume(tmp_path: Path, tiny_model: Path) -> None:
    """``[learner] ranks = 2``: the update runs on two FSDP ranks (Ray actors in a placement group, gloo);
    the engine serves each step's weights, checkpoints are sharded, and a run resumed from one continues
    exactly as the uninterrupted run did (every rank's weights, optimiser and step restored)."""
    pytest.importorskip("ray")
    # every group has a reward spread (a lock's first steps may have none): each update moves the weights
    (tmp_path / "spread_agent.py").write_text(SPREAD_AGENT)
    sections: dict[str, Any] = {
        "learner": {"ranks": 2},
        "checkpoint": {"every": 2, "keep": 5},
        "validation": {"every": 0, "samples": 1},
        "agent": {"agent": f"{tmp_path / 'spread_agent.py'}:agent", "val_tasks": ""},
    }
    config = experiment(tmp_path, tiny_model, **sections)
    result = run_experiment(config, progress=False)
    whole = rows(config.output_dir / "metrics.csv")
    assert [int(float(r["policy_version"])) for r in whole] == [1, 2, 3, 4]
    for r in whole:  # each rank's share of the update
        assert float(r["update_rank0_seconds"]) > 0 and float(r["update_rank1_seconds"]) > 0
        assert float(r["rank0_tokens"]) > 0 and float(r["rank1_tokens"]) > 0
    step_2 = config.output_dir / "checkpoints" / "step-000002"
    assert (step_2 / "sharded" / ".metadata").exists() and (step_2 / "model.safetensors").exists()
    # the trained weights moved away from the model the run started from
    from safetensors.torch import load_file

    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(result.checkpoint / "model.safetensors"))
    assert max(float((before[k] - after[k]).abs().max()) for k in before) > 1e-3

    again = experiment(tmp_path, tiny_model, **sections, experiment={"output_dir": "again"})
    run_experiment(again, resume=step_2, progress=False)
    resumed = rows(again.output_dir / "metrics.csv")
    assert [r["step"] for r in resumed] == ["3", "4"]
    for name in ("reward_mean", "pg_loss", "grad_norm", "policy_version", "rank0_tokens"):
        assert [r[name] for r in resumed] == [r[name] for r in whole[2:]], name


def test_a_vllm_named_by_address_that_cannot_serve_the_run_is_refused_saying_why(
    tmp_path: Path, tiny_model: Path, engine: Any
) -> None:
    """``[engine] kind = "vllm"`` with ``services.engine`` naming a server: the run checks it before it
    trains and stops with what to change (the checks a real vLLM passes are in tests/vllm)."""
    from lightning_grpc.training.engines import EngineError, VllmEngine

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    cases = {
        closed: r"vLLM at http://127\.0\.0\.1:\d+ \(services\.engine\) does not answer",
        # the embedded engine answers /health and /v1 but serves "tiny", and has no vLLM control routes
        engine.api_base: r"serves \['tiny'\], not model\.served_name = 'policy': start it with "
        r"--served-model-name policy",
    }
    for url, message in cases.items():
        with pytest.raises(EngineError, match=message):
            VllmEngine(url=url.removesuffix("/v1"), served_name="policy").start(tiny_model, 0)
    with pytest.raises(EngineError, match=r"no control routes .* VLLM_SERVER_DEV_MODE=1"):
        VllmEngine(url=engine.api_base.removesuffix("/v1"), served_name="tiny").start(tiny_model, 0)
    # through the command line: exit code 2 and the reason, no traceback
    config = tmp_path / "named.toml"
    config.write_text(
        f'[agent]\nagent = "{AGENT_REF}"\ntrain_tasks = "train.jsonl"\n'
        f'[model]\npath = "{tiny_model}"\nserved_name = "tiny"\n'
        f'[engine]\nkind = "vllm"\n[services]\nengine = "{engine.api_base}"\n'
    )
    write_jsonl(train_tasks(), tmp_path / "train.jsonl")
    done = subprocess.run(
        [*CLI, "train", str(config), "--no-progress", "--set", f"experiment.output_dir={tmp_path / 'out'}"],
        env=QUIET_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: vLLM at" in done.stderr and "VLLM_SERVER_DEV_MODE=1" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_an_agent_the_runners_cannot_import_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in agent.agent: one line naming the module and where it was looked for, exit 2, at once
    (no store, engine or runner started first, no runner's traceback to read)."""
    (tmp_path / "train.jsonl").write_text('{"x": 1}\n')
    config = tmp_path / "typo.toml"
    config.write_text('[agent]\nagent = "my_agnt:agent"\ntrain_tasks = "train.jsonl"\n[model]\npath = "m"\n')
    started = time.monotonic()
    done = subprocess.run(
        [*CLI, "train", str(config), "--no-progress"],
        cwd=tmp_path,
        env=QUIET_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "agent.agent 'my_agnt:agent': no module 'my_agnt' in" in done.stderr, done.stderr
    assert str(tmp_path) in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists() and time.monotonic() - started < 60
    # the same module, present in the folder the command runs in: found
    (tmp_path / "my_agnt.py").write_text("def agent(task, llm):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    check_agent_module(load_experiment(config))
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match="no module 'my_agnt'"):
        check_agent_module(load_experiment(config))


CONSTANT_AGENT = '''
from lightning_grpc.runner.llm import openai_client


async def agent(task, llm):
    """One call to the policy, and the same reward whatever it answered: GRPO has nothing to learn from."""
    await openai_client(llm).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "Say anything."}], max_tokens=2
    )
    return 0.5
'''


def test_a_run_whose_reward_is_constant_warns_and_stops_when_stalled(
    tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every group flat from the first step: after stall_window = 2 steps the run says it has no learning
    signal (printed, logged, stalled_zero_variance = 1 in metrics.csv) and stop_when_stalled ends it."""
    (tmp_path / "constant_agent.py").write_text(CONSTANT_AGENT)
    config = experiment(
        tmp_path,
        tiny_model,
        experiment={"steps": 6, "stall_window": 2, "stop_when_stalled": True},
        agent={"agent": f"{tmp_path / 'constant_agent.py'}:agent", "val_tasks": ""},
        data={"group_size": 2, "batch_size": 2},
    )
    said: list[str] = []
    with caplog.at_level("WARNING", logger="lightning_grpc.training"):
        result = asyncio.run(TrainingRun(config, progress=False, say=said.append).run())
    assert result.steps == 2 and "zero_variance" in result.stopped_because, result.stopped_because
    warnings = [line for line in said if line.startswith("warning: no learning signal (zero_variance)")]
    assert len(warnings) == 1, said
    assert (
        "zero reward variance in 4 of 4 GRPO groups (100%) over the last 2 steps (steps 1-2)" in warnings[0]
    )
    assert "reward_mean 0.500" in warnings[0]
    logged = [r.getMessage() for r in caplog.records if "event=training_no_signal" in r.getMessage()]
    assert any("condition=zero_variance" in m for m in logged), logged
    history = rows(config.output_dir / "metrics.csv")
    assert_documented(history)  # stalled_<condition> among them
    assert [float(r["stalled_zero_variance"]) for r in history] == [0.0, 1.0]
    assert all(0.0 <= float(r["truncated_responses"]) <= 1.0 for r in history)  # what max_tokens reads


OWN_TEMPERATURE_AGENT = '''
from lightning_grpc.runner.llm import openai_client


async def agent(task, llm):
    """Sets its own temperature, as agents often do, instead of llm.sampling_parameters."""
    await openai_client(llm).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "Say anything."}], max_tokens=2, temperature=0.7
    )
    return 0.5
'''


def test_an_agent_with_its_own_temperature_is_trained_at_it_and_the_run_says_so(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The proxy records each call's temperature; the batch carries it per row, the learner uses it, and the
    run warns once that the calls were not sampled at sampling.temperature."""
    (tmp_path / "own_temperature_agent.py").write_text(OWN_TEMPERATURE_AGENT)
    config = experiment(
        tmp_path,
        tiny_model,
        experiment={"steps": 2, "stall_window": 0},
        agent={"agent": f"{tmp_path / 'own_temperature_agent.py'}:agent", "val_tasks": ""},
        data={"group_size": 2, "batch_size": 2},
    )
    said: list[str] = []
    asyncio.run(TrainingRun(config, progress=False, say=said.append).run())
    warnings = [line for line in said if "temperature 0.7" in line and "sampling.temperature = 1" in line]
    assert len(warnings) == 1, said
    history = rows(config.output_dir / "metrics.csv")
    assert [float(r["temperature_mismatch_rows"]) for r in history] == [4.0, 4.0]
    assert all(
        float(r["temperature_min"]) == pytest.approx(0.7) == float(r["temperature_max"]) for r in history
    )
