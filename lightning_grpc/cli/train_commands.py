"""``lightning-grpc train CONFIG``: a whole training experiment from one TOML or YAML file.

lightning-grpc train examples/combination_lock/config.toml
lightning-grpc train config.toml --resume runs/lock/checkpoints/step-000050 --set experiment.steps=400
lightning-grpc train config.toml --backend verl --dry-run     # the config verl would run, checked by verl
lightning-grpc train --help-config                            # every section and key of the file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_grpc import logs


class HelpConfigAction(argparse.Action):
    """``--help-config``: print every section and key of an experiment file, then exit (as --help does)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        from lightning_grpc.training.experiment import describe_config

        print(describe_config(), end="")
        parser.exit()


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="run a training experiment described by a TOML or YAML file")
    p.add_argument("config", type=Path, help="the experiment file (its keys: --help-config)")
    p.add_argument(
        "--help-config",
        action=HelpConfigAction,
        help="list every section and key of the experiment file, with its type, default and meaning, and exit",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="CHECKPOINT",
        help="continue from this checkpoint directory (default: the newest one in the output directory, if any)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start over at step 1: the output directory's checkpoints and store are removed first",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a setting (VALUE is read as JSON, else as text); repeatable",
    )
    p.add_argument(
        "--backend",
        choices=("local", "verl"),
        default="local",
        help="local: the experiment's learner (in this process, or [learner] ranks FSDP ranks placed by Ray) "
        "and the engine its [engine] names (the embedded engine, or vLLM); "
        "verl: verl's FSDP actor and vLLM replicas on a GPU cluster (the `verl` extra)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with --backend verl: print verl's config for the experiment, checked by verl, and stop",
    )
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=run_train)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"error: --set wants SECTION.KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def run_train(args: argparse.Namespace) -> int:
    from lightning_grpc.training.engines import EngineError
    from lightning_grpc.training.experiment import ConfigError, check_agent_module, load_experiment
    from lightning_grpc.training.loop import RunFailed, RunInterrupted, run_experiment

    logs.configure_logging(args.log_level)
    try:
        config = load_experiment(args.config, parse_overrides(args.set))
        check_agent_module(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.backend == "verl":
        return run_train_with_verl(args, config)
    if args.dry_run:
        print("error: --dry-run goes with --backend verl", file=sys.stderr)
        return 2
    resume = choose_start(args, config)
    if isinstance(resume, int):
        return resume
    try:
        result = run_experiment(config, resume=resume, progress=not args.no_progress)
    except EngineError as exc:  # an engine that cannot serve the run: what to change, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunInterrupted as stop:
        print(f"to resume, run the same command again: {resume_command(args)}", file=sys.stderr)
        return stop.exit_code
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        print(f"what finished is kept; to resume: {resume_command(args)}", file=sys.stderr)
        return 1
    print(report(result, config.validation.target))
    return 0


def choose_start(args: argparse.Namespace, config: Any) -> Path | int | None:
    """The checkpoint the run resumes from (None: step 1), or an exit code after an error.

    Without ``--resume`` the newest whole checkpoint of the output directory is taken, so a run that was
    killed or interrupted goes on when its command is run again; ``--fresh`` starts over instead.
    """
    from lightning_grpc.training import recovery

    if args.fresh and args.resume is not None:
        print("error: --fresh and --resume exclude each other", file=sys.stderr)
        return 2
    if args.fresh:
        recovery.clear_for_fresh_start(config.output_dir, config.store_file, checkpoints=True)
        return None
    if args.resume is not None:
        if not recovery.is_checkpoint(args.resume):
            print(
                f"error: --resume {args.resume} is not a checkpoint (no trainer_state.pt or sharded/ in it)",
                file=sys.stderr,
            )
            return 2
        return Path(args.resume)
    if recovery.run_finished(config.output_dir):
        print(
            f"the run in {config.output_dir} finished: starting over "
            "(--resume CHECKPOINT continues from one of its checkpoints)",
            file=sys.stderr,
        )
        recovery.clear_for_fresh_start(config.output_dir, config.store_file, checkpoints=True)
        return None
    latest = recovery.latest_checkpoint(config.output_dir)
    if latest is not None:
        print(
            f"resuming from {latest} (the newest checkpoint in the output directory; --fresh starts over)",
            file=sys.stderr,
        )
    return latest


def resume_command(args: argparse.Namespace) -> str:
    """The command line that goes on where the run stopped (the same one, without --resume/--fresh)."""
    kept = [a for a in sys.argv[1:] if a != "--fresh"]
    if "--resume" in kept:
        at = kept.index("--resume")
        del kept[at : at + 2]
    kept = [a for a in kept if not a.startswith("--resume=")]
    return " ".join(["lightning-grpc", *kept]) if kept else f"lightning-grpc train {args.config}"


def run_train_with_verl(args: argparse.Namespace, config: Any) -> int:
    from lightning_grpc.training.experiment import ConfigError
    from lightning_grpc.training.verl_backend import VerlUnavailable, run_verl, verl_config

    if args.resume is not None:
        print("error: with --backend verl the run resumes from verl's own checkpoints", file=sys.stderr)
        return 2
    try:
        cfg = verl_config(config)
        if args.dry_run:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            return 0
        result = run_verl(config, progress=not args.no_progress)
    except (ConfigError, VerlUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(result, config.validation.target))
    return 0


def report(result: Any, target: float | None) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    resumed = getattr(result, "resumed_from", None)
    this = f" of this invocation (resumed after step {resumed})" if resumed is not None else ""
    lines = [
        "",
        f"stopped after {result.steps} steps{this}: {result.stopped_because} ({result.seconds:.0f}s)",
        f"validation reward: {'before' if resumed is None else f'at step {resumed}'} {fmt(result.val_before)}, "
        f"after {fmt(result.val_after)}" + (f" (target {target:g})" if target is not None else ""),
        f"trained checkpoint: {result.checkpoint}",
    ]
    interruptions = getattr(result, "interruptions", [])
    if interruptions:
        lines.append(f"interruptions recovered ({len(interruptions)}, listed in interruptions.jsonl):")
        lines += [f"  step {i.step}: {i.process} {i.cause}; {i.recovery}" for i in interruptions[-5:]]
    split = {k: v for k, v in result.time_split.items() if v}
    if split:
        lines.append("where the time went (seconds, summed over this invocation's steps):")
        lines += [f"  {name[: -len('_seconds')]}: {value:.1f}" for name, value in sorted(split.items())]
    for when in ("before", "after"):
        if result.transcripts.get(when):
            label = (
                f"{when} training" if resumed is None or when == "after" else f"at the resumed step {resumed}"
            )
            lines += [f"a validation rollout {label}:", result.transcripts[when]]
    return "\n".join(lines)
