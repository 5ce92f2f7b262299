"""Commands that look at the Trainer of a running server.

lightning-grpc triplets ROLLOUT_ID [--aggregation trajectory] [--tokenizer PATH]
lightning-grpc trainer status
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_grpc._extras import extra_imports
from lightning_grpc.batching import RunInterruption, TrainerStatus
from lightning_grpc.cli.inspect_commands import (
    common_options,
    format_fields,
    format_table,
    format_time,
    jsonable,
)
from lightning_grpc.client import ClientConfig, RolloutTripletReport, TrainerClient


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = common_options()
    p = sub.add_parser(
        "triplets", parents=[common], help="what training makes of a rollout: triplets, rows, drops"
    )
    p.add_argument("rollout_id", metavar="ROLLOUT_ID")
    p.add_argument("--aggregation", choices=["transition", "trajectory"], default="transition")
    p.add_argument("--reward-match", choices=["final", "first_occurrence", "first_sibling"], default="final")
    p.add_argument("--agent-match", default="", help="only calls under agents matching this regex")
    p.add_argument("--tokenizer", metavar="PATH", help="a local tokenizer to decode the token ids with")
    p.set_defaults(func=with_trainer_client(show_triplets))

    trainer = sub.add_parser("trainer", help="the trainer of a running server")
    trainer_sub = trainer.add_subparsers(dest="trainer_command", required=True)
    p = trainer_sub.add_parser("status", parents=[common], help="groups pending/ready/consumed, drops, steps")
    p.set_defaults(func=with_trainer_client(show_status))


def with_trainer_client(command: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        return asyncio.run(_with_client(command, args))

    return run


async def _with_client(command: Any, args: argparse.Namespace) -> int:
    config = ClientConfig(target=args.store, token=args.token or None, timeout=args.timeout)
    async with TrainerClient(config) as client:
        return int(await command(client, args) or 0)


async def show_triplets(client: TrainerClient, args: argparse.Namespace) -> None:
    report = await client.triplets(
        args.rollout_id,
        aggregation=args.aggregation,
        reward_match=args.reward_match,
        agent_match=args.agent_match,
    )
    if args.json:
        print(json.dumps(jsonable(report), ensure_ascii=False))
        return
    print(triplets_text(report, _decoder(args.tokenizer)))


def _decoder(path: str | None) -> Any:
    if not path:
        return None
    with extra_imports("engine"):
        from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return lambda ids: tokenizer.decode(list(ids))


def triplets_text(report: RolloutTripletReport, decode: Any = None) -> str:
    head = format_fields(
        [
            ("rollout", report.rollout_id),
            ("attempt", report.attempt_id),
            ("status", str(report.status)),
            ("reward", report.reward),
            ("llm calls", report.calls),
            ("triplets", len(report.triplets)),
            ("rows", len(report.rows)),
        ]
    )
    triplets = format_table(
        ["call", "prompt", "response", "logprobs", "reward", "version", "agent", "finish", "span"],
        [
            [
                tr.call_index,
                len(tr.prompt_ids),
                len(tr.response_ids),
                "yes" if tr.logprobs is not None else "no",
                tr.reward,
                tr.policy_version,
                tr.agent_name,
                tr.finish_reason,
                tr.span_id,
            ]
            for tr in report.triplets
        ],
    )
    parts = [head, "", triplets]
    if report.rows:
        rows = format_table(
            ["turn", "prompt", "response", "trainable", "versions"],
            [
                [
                    r["turn_index"],
                    r["prompt_tokens"],
                    r["response_tokens"],
                    r["trainable_tokens"],
                    r["policy_versions"],
                ]
                for r in report.rows
            ],
        )
        parts += ["", "rows:", rows]
    fallback = report.aggregation_fallback
    if fallback is not None:
        parts += ["", f"trajectory fell back to one row per call ({fallback.reason}): {fallback.detail}"]
    if report.drops:
        drops = format_table(
            ["not trained", "call", "span", "detail"],
            [
                [d.reason, d.call_index if d.call_index >= 0 else None, d.span_id, d.detail]
                for d in report.drops
            ],
        )
        parts += ["", drops]
    if decode is not None:
        for tr in report.triplets:
            parts += [
                "",
                f"call {tr.call_index} prompt:",
                decode(tr.prompt_ids),
                f"call {tr.call_index} response:",
                decode(tr.response_ids),
            ]
    return "\n".join(parts)


#: How many of a run's interruptions ``trainer status`` lists (the latest ones); the count is of all.
SHOWN_INTERRUPTIONS = 5


async def show_status(client: TrainerClient, args: argparse.Namespace) -> None:
    status = await client.status()
    interruptions = await run_interruptions(client, status)
    if args.json:
        print(json.dumps({**jsonable(status), "interruptions": jsonable(interruptions)}, ensure_ascii=False))
        return
    print(status_text(status, interruptions))


async def run_interruptions(client: TrainerClient, status: TrainerStatus) -> list[RunInterruption]:
    """Every interruption reported by the run of the last step, oldest first (from its stored events)."""
    if status.last_event is None:
        return []
    return [
        interruption
        async for event in client.watch_training(status.last_event.run_id)
        for interruption in event.interruptions
    ]


def status_text(status: TrainerStatus, interruptions: Sequence[RunInterruption] = ()) -> str:
    last = status.last_event
    head = format_fields(
        [
            ("policy version", status.policy_version),
            ("batches", status.batches),
            ("rows", status.rows),
            ("last step", f"{last.step} (run {last.run_id})" if last else None),
        ]
    )
    groups = format_table(
        ["mode", "pending", "ready", "carried over", "consumed"],
        [[str(g.mode) or "-", g.pending, g.ready, g.carried_over, g.consumed] for g in status.groups],
    )
    parts = [head, "", groups]
    stalled = no_signal_line(last.metrics if last else {})
    if stalled:
        parts += ["", stalled]
    if status.drops:
        parts += ["", format_table(["left out or changed", "count"], sorted(status.drops.items()))]
    if status.fallbacks:
        parts += [
            "",
            format_table(
                ["trajectory fell back to per-call rows", "rollouts"], sorted(status.fallbacks.items())
            ),
        ]
    if interruptions:
        parts += ["", interruptions_text(interruptions)]
    return "\n".join(parts)


def interruptions_text(interruptions: Sequence[RunInterruption], shown: int = SHOWN_INTERRUPTIONS) -> str:
    """The run's interruption count, then its latest ones, one line each: when, the step, the process,
    the cause, the recovery and how long it took."""
    latest = interruptions[-shown:]
    which = f", the last {len(latest)}" if len(latest) < len(interruptions) else ""
    lines = [f"interruptions: {len(interruptions)} (recovered{which})"]
    for i in latest:
        when = format_time(i.time) or "-"
        cause = i.cause or "unknown cause"
        recovery = i.recovery or "recovered"
        lines.append(
            f"  {when}  step {i.step}  {i.process}: {cause}; {recovery} ({i.recovery_seconds:.1f} s)"
        )
    return "\n".join(lines)


def no_signal_line(metrics: Mapping[str, float]) -> str:
    """The run's no-learning-signal conditions at its last step (``stalled_<condition>`` = 1), as one line;
    "" when there is none. The watcher sets them once a condition held ``stall_window`` steps in a row."""
    prefix = "stalled_"
    names = [
        name.removeprefix(prefix) for name, value in metrics.items() if name.startswith(prefix) and value
    ]
    if not names:
        return ""
    window = metrics.get("stall_window")
    since = f" (for the last {window:.0f} steps or more)" if window else ""
    return f"no learning signal: {', '.join(sorted(names))}{since}"
