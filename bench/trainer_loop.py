"""The training loop against direct generation, same model, same sampling, same task, same run.

    python bench/trainer_loop.py --steps 10 [--out result.json]
    python bench/trainer_loop.py --config examples/combination_lock/vllm.toml --hidden-size 128 --steps 6 \
        --only-its-mode                     # vLLM and the FSDP ranks against direct generation

Ours: the demo's loop (``examples/combination_lock/config.toml``) through the whole system: the engine,
the server (Store, Trainer, proxy), a runner fleet playing the agent with the official OpenAI client, and
the learner, in the demo's mode (async: the next groups are generated during the update) and, as a
second figure, in the other mode. The peer: ``bench.direct``, the same episodes generated in-process with the
same model and sampling rules and trained by the same learner. Both start from the same freshly built tiny
model and run the same number of steps of ``batch_size`` groups x ``group_size`` rollouts, without
validation, and with one round of generation a step (ours with dynamic sampling off, as the peer has none). Reported: rollouts per second of each loop (the peer's over generation and update only), their
ratio, and the data path (the batch request to padded arrays in the trainer, once every group has ended)
as a share of a training step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file: bench.direct is imported from the checkout
    sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "examples" / "combination_lock" / "config.toml"


def ours(
    model: Path, steps: int, out: Path, mode: str | None = None, config_path: Path = CONFIG
) -> dict[str, Any]:
    from lightning_grpc.training.experiment import load_experiment
    from lightning_grpc.training.loop import run_experiment

    config = load_experiment(
        config_path,
        {
            "experiment.steps": steps,
            "experiment.output_dir": str(out),
            "model.path": str(model),
            "model.init": False,
            "validation.every": 0,
            "checkpoint.every": 0,
            # one round of generation a step, as the peer does: dynamic sampling's extra rounds (when every
            # sample of a group scored alike) would be counted as time without their rollouts
            "data.filter_groups": False,
            **({"experiment.mode": mode} if mode else {}),
        },
    )
    config = _without_validation(config)
    started = time.perf_counter()
    result = run_experiment(config, progress=False)
    wall = time.perf_counter() - started
    rows = result.history
    steady = rows[1:] or rows  # the first step warms everything up
    step_s = [float(r["step_seconds"]) for r in steady]
    data_s = [float(r["data_path_seconds"]) for r in steady]
    rollouts = config.data.batch_size * config.data.group_size
    return {
        "config": str(config_path.relative_to(ROOT) if config_path.is_relative_to(ROOT) else config_path),
        "engine": config.engine.kind,
        "learner_ranks": config.learner.ranks,
        "weight_sync_seconds_median": statistics.median(float(r["weight_sync_seconds"]) for r in steady),
        "mode": config.experiment.mode,
        "steps": len(rows),
        "rollouts_per_step": rollouts,
        "rollouts_per_second": rollouts * len(steady) / sum(step_s),
        "step_seconds_median": statistics.median(step_s),
        "generation_seconds_median": statistics.median(float(r["generation_seconds"]) for r in steady),
        "update_seconds_median": statistics.median(float(r["update_seconds"]) for r in steady),
        "data_path_seconds_median": statistics.median(data_s),
        "data_path_share": sum(data_s) / sum(step_s),
        "cpu_seconds_per_step": {
            name[len("cpu_") : -len("_seconds")]: statistics.median(float(r.get(name, 0.0)) for r in steady)
            for name in rows[-1]
            if name.startswith("cpu_")
        },
        "wall_seconds_with_setup": wall,
        "reward_first_last": [float(rows[0]["reward_mean"]), float(rows[-1]["reward_mean"])],
    }


def _without_validation(config: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, agent=dataclasses.replace(config.agent, val_tasks=""))


def peer(model: Path, steps: int, config_path: Path = CONFIG) -> dict[str, Any]:
    from bench.direct import DirectConfig, run_direct
    from lightning_grpc.batching.options import Aggregation
    from lightning_grpc.examples.combination_lock import read_jsonl
    from lightning_grpc.training.experiment import load_experiment

    config = load_experiment(config_path)
    direct = DirectConfig(
        model_path=str(model),
        seed=config.experiment.seed,
        steps=steps,
        tasks_per_step=config.data.batch_size,
        group_size=config.data.group_size,
        aggregation="trajectory" if config.data.aggregation == Aggregation.TRAJECTORY else "transition",
        lr=config.optim.lr,
        loss_agg_mode=config.ppo.loss_agg_mode,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        max_tokens=config.sampling.max_tokens,
        eval_every=0,
        threads=config.services.trainer_threads,
        train_tasks=read_jsonl(config.path(config.agent.train_tasks)),
        val_tasks=read_jsonl(config.path(config.agent.val_tasks)),  # evaluated before and after only
        verbose=False,
    )
    history = run_direct(direct)
    steady = history.steps[1:] or history.steps
    step_s = [float(s["step_seconds"]) for s in steady]
    rollouts = config.data.batch_size * config.data.group_size
    return {
        "steps": len(history.steps),
        "rollouts_per_second": rollouts * len(steady) / sum(step_s),
        "step_seconds_median": statistics.median(step_s),
        "generation_seconds_median": statistics.median(float(s["generate_seconds"]) for s in steady),
        "update_seconds_median": statistics.median(float(s["update_seconds"]) for s in steady),
        "reward_first_last": [float(history.steps[0]["reward"]), float(history.steps[-1]["reward"])],
    }


def run(
    steps: int, config_path: Path = CONFIG, hidden_size: int = 0, other_mode: bool = True
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lightning-bench-trainer-") as tmp:
        model = Path(tmp) / "model"
        width = ["--hidden-size", str(hidden_size)] if hidden_size else []
        subprocess.run(
            [sys.executable, "-m", "lightning_grpc.cli.main", "init-model", str(model), *width],
            check=True,
            capture_output=True,
        )
        loop = ours(model, steps, Path(tmp) / "run", config_path=config_path)
        other = "sync" if loop["mode"] == "async" else "async"
        loop_other = (
            ours(model, steps, Path(tmp) / f"run-{other}", mode=other, config_path=config_path)
            if other_mode
            else None
        )
        direct = peer(model, steps, config_path)
    result: dict[str, Any] = {
        "workload": "trainer_loop",
        "steps": steps,
        "ours": loop,
        "direct": direct,
        "rollouts_per_second_ratio": loop["rollouts_per_second"] / direct["rollouts_per_second"],
    }
    if loop_other is not None:
        result[f"ours_{other}"] = loop_other
        result[f"rollouts_per_second_ratio_{other}"] = (
            loop_other["rollouts_per_second"] / direct["rollouts_per_second"]
        )
    # the data path apart from generation is measured in sync mode, where the batch is asked for once
    # every group has ended (in async mode the request also waits for the groups still running)
    sync = loop if loop["mode"] == "sync" else loop_other
    if sync is not None:
        result["data_path_share"] = sync["data_path_share"]
        result["data_path_measured_in"] = "sync"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the experiment file of our loop")
    parser.add_argument(
        "--hidden-size", type=int, default=0, help="the model's width (0: init-model's default)"
    )
    parser.add_argument(
        "--only-its-mode", action="store_true", help="skip our loop in the config's other mode"
    )
    args = parser.parse_args()
    result = run(args.steps, args.config.resolve(), args.hidden_size, other_mode=not args.only_its_mode)
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
