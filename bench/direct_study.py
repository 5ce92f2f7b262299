"""The defaults study at many seeds, fast: the demo's task played by direct generation (:mod:`bench.direct`).

:mod:`bench.defaults_study` runs the whole system (``lightning-grpc train``), a few minutes a run; this
runs the same GRPO update on the demo's locks (examples/combination_lock: the moving-on variant, answers cut
at 2 tokens) with the model generating in-process, about 40 s a run on one core, so that a setting can be
tried over 8 seeds in minutes. It is synchronous and has no dynamic sampling (``--skip-flat-groups`` leaves
flat groups out without drawing others): a setting it finds is then checked on the whole system.

    .venv/bin/python bench/direct_study.py --settings demo,group16 --seeds 0-7 --out bench/results/direct_study.md

Each run is ``python -m bench.direct`` in its own process (``--parallel`` at a time, one torch thread each),
the model built with the run's seed as ``[model] init`` builds it; a run stops at validation reward 0.8.
Stalled: the target never reached and the last validations (20 steps) all within 0.1 of 0.5, the reward of
answering "3" to both digits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "examples" / "combination_lock"
TARGET = 0.8
STALL_STEPS, STALL_LEVEL, STALL_TOLERANCE = 20, 0.5, 0.1

#: name -> (bench.direct options, description). The demo's knobs: lr 3e-3, 16 groups x 8, temperature 1.
SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "demo": ({}, "the demo's knobs (lr 3e-3, 16 groups x 8 rollouts, temperature 1, clip 0.2)"),
    "entropy0.01": ({"entropy-coeff": 0.01}, "ppo.entropy_coeff = 0.01"),
    "entropy0.03": ({"entropy-coeff": 0.03}, "ppo.entropy_coeff = 0.03"),
    "group16": ({"group-size": 16}, "data.group_size = 16 (twice the rollouts a step)"),
    "lr2e-3": ({"lr": 2e-3}, "optim.lr = 2e-3"),
    "temperature1.3": ({"temperature": 1.3}, "sampling.temperature = 1.3"),
    "group16+lr2e-3": ({"group-size": 16, "lr": 2e-3}, "data.group_size = 16 and optim.lr = 2e-3"),
    "lr1e-3": ({"lr": 1e-3}, "optim.lr = 1e-3"),
}


@dataclass
class Result:
    setting: str
    seed: int
    steps: int = 0
    target_step: int | None = None
    final: float | None = None
    stalled: bool = False
    seconds: float = 0.0
    curve: str = ""
    error: str = ""


def seeds_of(text: str) -> list[int]:
    """``0-7`` or ``0,3,5``."""
    if "-" in text:
        low, high = text.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",") if s.strip()]


def model_for(seed: int, work: Path) -> Path:
    from lightning_grpc.engine.tiny import build_tiny_model

    path = work / f"model-s{seed}"
    if not (path / "config.json").exists():
        build_tiny_model(path, seed=seed)
    return path


def run_one(setting: str, seed: int, steps: int, work: Path) -> Result:
    options, _ = SETTINGS[setting]
    out = work / f"{setting}-s{seed}.json"
    command = [
        sys.executable, "-m", "bench.direct", "--model", str(model_for(seed, work)), "--seed", str(seed),
        "--steps", str(steps), "--stop-at", str(TARGET), "--max-tokens", "2",
        "--train-tasks", str(DEMO_DIR / "train.jsonl"), "--val-tasks", str(DEMO_DIR / "val.jsonl"),
        "--json", str(out),
        *(item for key, value in options.items() for item in (f"--{key}", str(value))),
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    result = Result(setting, seed, seconds=time.monotonic() - started)
    if done.returncode != 0:
        result.error = (done.stdout + done.stderr).strip().splitlines()[-1:][0] if done.stderr else "failed"
        return result
    history = json.loads(out.read_text())
    evals = [(int(e["step"]), float(e["reward"])) for e in history["evals"]]
    result.steps = len(history["steps"])
    result.final = evals[-1][1] if evals else None
    result.target_step = next((s for s, v in evals if v >= TARGET), None)
    tail = [v for s, v in evals if s > result.steps - STALL_STEPS]
    result.stalled = result.target_step is None and all(abs(v - STALL_LEVEL) <= STALL_TOLERANCE for v in tail)
    result.curve = " ".join(f"{s}:{v:.2f}" for s, v in evals)
    return result


def render(results: list[Result], args: argparse.Namespace, started: str) -> str:
    lines = [
        "# Direct-loop study: which knobs learn the demo's lock in every seed",
        "",
        f"- Date: {started}",
        f"- Command: `python bench/direct_study.py {' '.join(sys.argv[1:])}`",
        f"- Machine: {platform.machine()}, {args.parallel} runs at a time, one torch thread each",
        f"- Every run: the demo's locks (examples/combination_lock), max_tokens 2, at most {args.steps} steps, "
        f"validation every 5 steps (8 held-out locks x 8 samples), stops at {TARGET}; the model built with "
        "the seed",
        "",
        "| setting | reached 0.8 / runs | stalled at 0.5 | median steps to 0.8 | seeds that stalled |",
        "|---|---|---|---|---|",
    ]
    for setting in args.settings:
        mine = [r for r in results if r.setting == setting]
        if not mine:
            continue
        hits = sorted(r.target_step for r in mine if r.target_step is not None)
        median = hits[len(hits) // 2] if hits else None
        stalled = [str(r.seed) for r in mine if r.stalled]
        lines.append(
            f"| {setting} | {len(hits)} / {len(mine)} | {len(stalled)} | {median or '-'} | "
            f"{', '.join(stalled) or '-'} |"
        )
    lines += ["", "Settings:", ""]
    lines += [f"- `{s}`: {SETTINGS[s][1]}" for s in args.settings]
    lines += ["", "Runs (step:validation reward):", ""]
    for r in results:
        state = r.error or (
            f"reached at {r.target_step}" if r.target_step else "stalled" if r.stalled else "-"
        )
        lines.append(f"- {r.setting} s{r.seed} ({state}, {r.seconds:.0f} s): {r.curve}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="demo", help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--seeds", default="0-7", help="'0-7' or '0,3,5' (default 0-7)")
    parser.add_argument("--steps", type=int, default=80, help="most steps a run takes (default 80)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/direct_study"), help="models and histories")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "direct_study.md")
    args = parser.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    seeds = seeds_of(args.seeds)
    args.work.mkdir(parents=True, exist_ok=True)
    for seed in seeds:  # built once, before the runs share them
        model_for(seed, args.work)
    started = f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    jobs = [(setting, seed) for setting in args.settings for seed in seeds]
    results: list[Result] = []
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(run_one, s, seed, args.steps, args.work): (s, seed) for s, seed in jobs}
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            results.append(r)
            print(f"{r.setting} seed {r.seed}: target step {r.target_step}, final {r.final}, stalled {r.stalled}",
                  flush=True)  # fmt: skip
            results.sort(key=lambda x: (args.settings.index(x.setting), x.seed))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(render(results, args, started))
    print(args.out.read_text())
    return 0 if all(not r.error for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
