"""Commands that change a running store's rollouts: queue work, cancel it, delete what has ended.

lightning-grpc enqueue '{"question": "2+2"}' --group-size 8 --mode train
lightning-grpc enqueue --file tasks.jsonl --resources res-… --max-attempts 2
lightning-grpc cancel ro-… ro-… --reason "bad prompt"
lightning-grpc retry ro-… --reason "worker hung"   # end a stuck attempt, queue a new one
lightning-grpc delete ro-…            # finished rollouts only
lightning-grpc delete --older-than 1d # every rollout that ended more than a day ago

Each input is a JSON value (the rollout's input as the agent receives it): given inline, or one per
line of a JSONL file (``-`` reads standard input). Mistakes in the inputs are one line naming where.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lightning_grpc import types as t
from lightning_grpc.algorithm import Algorithm
from lightning_grpc.client import StoreClient

from .inspect_commands import common_options, format_table, format_time, jsonable, with_store_client

MODES = ("train", "val", "test")
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class InputError(Exception):
    """An input that is not JSON (the message names the file and line, or the argument)."""


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = common_options()

    p = sub.add_parser(
        "enqueue",
        parents=[common],
        help="queue rollouts: inputs as inline JSON or a JSONL file, GRPO groups with --group-size",
    )
    p.add_argument(
        "inputs", nargs="*", metavar="INPUT", help='a rollout\'s input as JSON, e.g. \'{"q": "2+2"}\''
    )
    p.add_argument("--file", "-f", metavar="PATH", help="one JSON input per line ('-': standard input)")
    p.add_argument(
        "--group-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="rollouts per input; siblings share a group id (GRPO)",
    )
    p.add_argument("--mode", choices=MODES, default=None, help="the rollouts' mode (default: none)")
    p.add_argument(
        "--resources",
        default="",
        metavar="RESOURCES_ID",
        help="the resources set the agents get (default: the latest when each rollout starts)",
    )
    p.add_argument("--max-attempts", type=_positive_int, default=1, metavar="N", help="attempts per rollout")
    p.add_argument(
        "--rollout-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end an attempt after this long",
    )
    p.set_defaults(func=with_store_client(enqueue))

    p = sub.add_parser(
        "cancel", parents=[common], help="cancel rollouts (their running attempts are told to stop)"
    )
    p.add_argument("rollout_ids", nargs="+", metavar="ROLLOUT_ID")
    p.add_argument("--reason", default="", help="kept as the rollouts' status message")
    p.set_defaults(func=with_store_client(cancel))

    p = sub.add_parser(
        "retry", parents=[common], help="end rollouts' stuck attempts and queue them for new ones"
    )
    p.add_argument("rollout_ids", nargs="+", metavar="ROLLOUT_ID")
    p.add_argument("--reason", default="", help="kept as the ended attempts' status message")
    p.set_defaults(func=with_store_client(retry))

    p = sub.add_parser(
        "delete", parents=[common], help="delete finished rollouts with their attempts and spans"
    )
    p.add_argument(
        "rollout_ids", nargs="*", metavar="ROLLOUT_ID", help="rollouts to delete (all must have ended)"
    )
    p.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="AGE",
        help="also every rollout that ended more than AGE ago (e.g. 90s, 30m, 12h, 7d)",
    )
    p.set_defaults(func=with_store_client(delete))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def parse_duration(text: str) -> float:
    """'90s', '30m', '12h', '7d' or a number of seconds -> seconds."""
    s = text.strip().lower()
    unit = s[-1:] if s[-1:] in DURATION_UNITS else "s"
    number = s[:-1] if s[-1:] in DURATION_UNITS else s
    try:
        seconds = float(number) * DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90s, 30m, 12h or 7d") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return seconds


# ---------------------------------------------------------------- inputs
def read_inputs(inline: list[str], file: str | None) -> list[Any]:
    """The inputs given inline, then those of the JSONL file, in order."""
    inputs = [_parse(text, f"INPUT {i + 1}") for i, text in enumerate(inline)]
    if file is not None:
        if file == "-":
            lines, name = sys.stdin.read().splitlines(), "standard input"
        else:
            try:
                lines, name = Path(file).read_text(encoding="utf-8").splitlines(), file
            except OSError as exc:
                raise InputError(f"cannot read {file}: {exc.strerror or exc}") from None
        inputs += [_parse(line, f"{name} line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    return inputs


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where} is not JSON ({exc.msg} at column {exc.colno}): {text[:60]!r}") from None


# ---------------------------------------------------------------- commands
async def enqueue(client: StoreClient, args: argparse.Namespace) -> int:
    try:
        inputs = read_inputs(args.inputs, args.file)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not inputs:
        print("error: nothing to enqueue: give inputs as JSON arguments or with --file", file=sys.stderr)
        return 2
    config = t.RolloutConfig(max_attempts=args.max_attempts, timeout=args.rollout_timeout)
    async with Algorithm(client) as algorithm:
        rollouts = await algorithm.enqueue(
            inputs, resources_id=args.resources, mode=args.mode, group_size=args.group_size, config=config
        )
    if args.json:
        for r in rollouts:
            print(json.dumps(jsonable(r), ensure_ascii=False))
    else:
        rows = [
            [r.rollout_id, r.group_id, r.mode, r.resources_id, json.dumps(r.input)[:40]] for r in rollouts
        ]
        print(format_table(("ID", "GROUP", "MODE", "RESOURCES", "INPUT"), rows))
        groups = len({r.group_id for r in rollouts}) if args.group_size > 1 else 0
        in_groups = f" in {groups} groups of {args.group_size}" if groups else ""
        print(f"({len(rollouts)} rollouts queued{in_groups})", file=sys.stderr)
    return 0


async def cancel(client: StoreClient, args: argparse.Namespace) -> int:
    cancelled = [await client.cancel_rollout(rollout_id, args.reason) for rollout_id in args.rollout_ids]
    if args.json:
        for r in cancelled:
            print(json.dumps(jsonable(r), ensure_ascii=False))
    else:
        print(
            format_table(
                ("ID", "STATUS", "ENDED"),
                [[r.rollout_id, r.status, format_time(r.end_time)] for r in cancelled],
            )
        )
    return 0


async def retry(client: StoreClient, args: argparse.Namespace) -> int:
    retried = [await client.retry_rollout(rollout_id, args.reason) for rollout_id in args.rollout_ids]
    if args.json:
        for r in retried:
            print(json.dumps(jsonable(r), ensure_ascii=False))
    else:
        rows = [[r.rollout_id, r.status, r.attempt_count] for r in retried]
        print(format_table(("ID", "STATUS", "ATTEMPTS"), rows))
    return 0


async def delete(client: StoreClient, args: argparse.Namespace) -> int:
    if not args.rollout_ids and args.older_than is None:
        print("error: name the rollouts to delete, or give --older-than", file=sys.stderr)
        return 2
    finished_before = None if args.older_than is None else time.time() - args.older_than
    result = await client.delete_rollouts(args.rollout_ids, finished_before=finished_before)
    counts = {
        "deleted_rollouts": result.deleted_rollouts,
        "deleted_attempts": result.deleted_attempts,
        "deleted_spans": result.deleted_spans,
    }
    if args.json:
        print(json.dumps(counts))
    else:
        print(
            f"deleted {result.deleted_rollouts} rollouts, {result.deleted_attempts} attempts "
            f"and {result.deleted_spans} spans"
        )
    return 0
