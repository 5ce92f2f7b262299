"""Commands that look at a running store.

lightning-grpc rollouts [--status running --status failed] [--limit N] [--group G]
lightning-grpc rollout ROLLOUT_ID
lightning-grpc spans ROLLOUT_ID [--attempt latest|ATTEMPT_ID] [--follow]
lightning-grpc workers | resources | stats

Every command takes ``--store HOST:PORT`` (default ``$LIGHTNING_GRPC_STORE`` or 127.0.0.1:4747),
``--token`` (default ``$LIGHTNING_GRPC_TOKEN``) and ``--json`` (one JSON object a line instead of a
table). Errors of the store (an unknown id, a wrong token) reach ``main``, which prints them on one line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import enum
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from lightning_grpc import environment, semconv
from lightning_grpc import types as t
from lightning_grpc.algorithm import Algorithm
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.triplets.conversation import LlmCall, format_llm_calls, llm_calls, tool_calls_summary

DEFAULT_STORE = "127.0.0.1:4747"
ROLLOUT_STATUS_NAMES = [str(s) for s in t.RolloutStatus if s is not t.RolloutStatus.UNSPECIFIED]
RESOURCE_KINDS: dict[type, str] = {
    t.LLM: "llm",
    t.ProxyLLM: "proxy_llm",
    t.PromptTemplate: "prompt_template",
    t.JsonResource: "json",
}
#: Span attributes that repeat ids the line already shows: printed last.
ID_ATTRIBUTES = frozenset(
    {
        semconv.ROLLOUT_ID,
        semconv.ATTEMPT_ID,
        semconv.SPAN_SEQUENCE_ID,
        semconv.LEGACY_ROLLOUT_ID,
        semconv.LEGACY_ATTEMPT_ID,
    }
)
#: Resource fields never printed in clear.
SECRET_FIELDS = frozenset({"api_key"})

Command = Callable[[StoreClient, argparse.Namespace], Awaitable[int | None]]


# ---------------------------------------------------------------- parsers
def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = common_options()

    p = sub.add_parser("rollouts", parents=[common], help="list rollouts, newest first")
    p.add_argument(
        "--status",
        action="append",
        choices=ROLLOUT_STATUS_NAMES,
        default=[],
        help="only rollouts in this status (repeat for several)",
    )
    p.add_argument("--limit", type=_non_negative_int, default=50, help="at most N rollouts (0: all)")
    p.add_argument("--group", default="", help="only rollouts of this group id")
    p.set_defaults(func=with_store_client(show_rollouts))

    p = sub.add_parser("rollout", parents=[common], help="one rollout: fields, config, input, attempts")
    p.add_argument("rollout_id", metavar="ROLLOUT_ID")
    p.set_defaults(func=with_store_client(show_rollout))

    p = sub.add_parser("spans", parents=[common], help="a rollout's spans, one line each")
    p.add_argument("rollout_id", metavar="ROLLOUT_ID")
    p.add_argument("--attempt", default=None, help="'latest' or an attempt id (default: every attempt)")
    p.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing new spans until the rollout ends (or Ctrl-C)",
    )
    p.set_defaults(func=with_store_client(show_spans))

    p = sub.add_parser("workers", parents=[common], help="list workers")
    p.set_defaults(func=with_store_client(show_workers))

    p = sub.add_parser("resources", parents=[common], help="list resources sets")
    p.set_defaults(func=with_store_client(show_resources))

    p = sub.add_parser("stats", parents=[common], help="store statistics")
    p.set_defaults(func=with_store_client(show_stats))


def add_store_option(p: argparse.ArgumentParser, what: str = "the store server") -> None:
    """``--store HOST:PORT``, from $LIGHTNING_GRPC_STORE when set (every command that talks to a store)."""
    p.add_argument(
        "--store",
        default=environment.read(environment.STORE) or DEFAULT_STORE,
        metavar="HOST:PORT",
        help=f"{what}; several, comma-separated, for a store with standbys (default: ${environment.STORE} or "
        f"{DEFAULT_STORE})",
    )


def common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_store_option(common)
    common.add_argument(
        "--token",
        default=os.environ.get(environment.TOKEN),
        help=f"bearer token (default: ${environment.TOKEN})",
    )
    common.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds each call may take")
    return common


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def with_store_client(command: Command) -> Callable[[argparse.Namespace], int]:
    """An argparse ``func`` that runs ``command`` with a client of ``--store``."""

    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(_with_client(command, args))
        except KeyboardInterrupt:
            if getattr(args, "follow", False):
                return 0  # Ctrl-C is how a follow ends
            raise
        except BrokenPipeError:
            # The reader went away (``| head``): stop quietly, and keep Python from complaining at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0

    return run


async def _with_client(command: Command, args: argparse.Namespace) -> int:
    config = ClientConfig(target=args.store, token=args.token or None, timeout=args.timeout)
    async with StoreClient(config) as client:
        return await command(client, args) or 0


# ---------------------------------------------------------------- commands
async def show_rollouts(client: StoreClient, args: argparse.Namespace) -> None:
    rollouts, total = await _newest_rollouts(client, args.status, args.group, args.limit)
    rewards = await rewards_of(client, rollouts)
    if args.json:
        _print_json_lines({**jsonable(r), "reward": rewards[r.rollout_id]} for r in rollouts)
        return
    print(format_table(ROLLOUT_HEADERS, (rollout_row(r, rewards[r.rollout_id]) for r in rollouts)))
    if len(rollouts) < total:
        print(f"({len(rollouts)} of {total} rollouts shown; see more with --limit)", file=sys.stderr)


async def _newest_rollouts(
    client: StoreClient, statuses: Sequence[str], group: str, limit: int
) -> tuple[list[t.Rollout], int]:
    rollouts: list[t.Rollout] = []
    token = ""
    while True:
        want = 1000 if limit == 0 else min(1000, limit - len(rollouts))
        page = await client.list_rollouts(
            status_in=statuses, group_id=group, descending=True, page_size=want, page_token=token
        )
        rollouts.extend(page.items)
        token = page.next_page_token
        if not token or (limit and len(rollouts) >= limit):
            return rollouts, max(page.total_size, len(rollouts))


async def show_rollout(client: StoreClient, args: argparse.Namespace) -> None:
    rollout = await client.get_rollout(args.rollout_id)
    attempts = await client.query_attempts(args.rollout_id)
    reward = (await rewards_of(client, [rollout]))[rollout.rollout_id]
    calls = await latest_llm_calls(client, rollout)
    if args.json:
        record = {**jsonable(rollout), "reward": reward, "attempts": jsonable(attempts)}
        _print_json_lines([{**record, "llm_calls": jsonable(calls)}])
        return
    print(format_fields(rollout_fields(rollout, reward)))
    print("input:")
    print(_indent(json.dumps(jsonable(rollout.input), indent=2, ensure_ascii=False)))
    print()
    print("attempts:")
    print(_indent(format_table(ATTEMPT_HEADERS, (attempt_row(a) for a in attempts))))
    failed = [a for a in attempts if isinstance(a.metadata.get(semconv.ATTEMPT_ERROR), dict)]
    if failed:
        error = failed[-1].metadata[semconv.ATTEMPT_ERROR]
        print()
        print(
            f"error of attempt {failed[-1].sequence_number}: {error.get('type', '')}: {error.get('message', '')}"
        )
        print(_indent(str(error.get("traceback", "")).rstrip()))
    if calls and rollout.latest_attempt:
        print()
        print(f"llm calls of attempt {rollout.latest_attempt.sequence_number}:")
        print(_indent(format_llm_calls(calls)))


async def latest_llm_calls(client: StoreClient, rollout: t.Rollout) -> list[LlmCall]:
    """The LLM calls of a rollout's latest attempt, in order (none before its first attempt)."""
    if rollout.latest_attempt is None:
        return []
    attempt_id = rollout.latest_attempt.attempt_id
    return llm_calls(await client.query_spans(rollout.rollout_id, attempt_id, name=semconv.SPAN_LLM_CALL))


async def show_spans(client: StoreClient, args: argparse.Namespace) -> None:
    seen = 0
    async for batch in client.tail_spans(args.rollout_id, args.attempt, follow=args.follow):
        for span in batch:
            print(
                json.dumps(jsonable(span), ensure_ascii=False) if args.json else span_line(span),
                flush=args.follow,
            )
        seen += len(batch)
    if not seen and not args.follow and not args.json:
        print("(no spans)", file=sys.stderr)


async def show_workers(client: StoreClient, args: argparse.Namespace) -> None:
    workers = await client.query_workers()
    if args.json:
        _print_json_lines(workers)
        return
    print(format_table(WORKER_HEADERS, (worker_row(w) for w in workers)))


async def show_resources(client: StoreClient, args: argparse.Namespace) -> None:
    updates = await client.query_resources()
    latest = await client.get_latest_resources()
    latest_id = latest.resources_id if latest else ""
    if args.json:
        _print_json_lines({**resources_json(u), "latest": u.resources_id == latest_id} for u in updates)
        return
    print(format_table(RESOURCES_HEADERS, (resources_row(u, latest_id) for u in updates)))


async def show_stats(client: StoreClient, args: argparse.Namespace) -> None:
    stats = await client.statistics()
    if args.json:
        _print_json_lines([stats])
        return
    print(format_fields(stats_fields(stats)))


# ---------------------------------------------------------------- rows and fields
ROLLOUT_HEADERS = (
    "ID",
    "STATUS",
    "REWARD",
    "MODE",
    "ATTEMPTS",
    "LAST_ATTEMPT",
    "WORKER",
    "CREATED",
    "DURATION",
)
ATTEMPT_HEADERS = ("#", "ID", "STATUS", "WORKER", "STARTED", "DURATION", "HEARTBEAT", "MESSAGE")
WORKER_HEADERS = ("ID", "STATUS", "ROLLOUT", "ATTEMPT", "HEARTBEAT", "DEQUEUED", "STATS")
RESOURCES_HEADERS = ("ID", "VERSION", "LATEST", "UPDATED", "RESOURCES")


async def rewards_of(client: StoreClient, rollouts: Sequence[t.Rollout]) -> dict[str, float | None]:
    """Each rollout's reward: the last one its latest attempt recorded (None if it did not succeed)."""
    async with Algorithm(client) as algorithm:
        results = await algorithm.results(rollouts)
    return {r.rollout.rollout_id: r.reward for r in results}


def format_reward(reward: float | None) -> str | None:
    return None if reward is None else f"{reward:.4g}"


def rollout_row(r: t.Rollout, reward: float | None = None) -> list[object]:
    latest = r.latest_attempt
    return [
        r.rollout_id,
        r.status,
        format_reward(reward),
        r.mode,
        r.attempt_count,
        latest.status if latest else None,
        latest.worker_id if latest else None,
        format_time(r.create_time),
        format_duration(r.start_time, r.end_time),
    ]


def rollout_fields(r: t.Rollout, reward: float | None = None) -> list[tuple[str, object]]:
    c = r.config
    return [
        ("rollout", r.rollout_id),
        ("status", r.status),
        ("reward", format_reward(reward)),
        ("message", r.status_message),
        ("mode", r.mode),
        ("group", r.group_id),
        ("resources", r.resources_id),
        ("created", format_time(r.create_time)),
        ("started", format_time(r.start_time)),
        ("ended", format_time(r.end_time)),
        ("duration", format_duration(r.start_time, r.end_time)),
        ("attempts", r.attempt_count),
        ("metadata", json.dumps(jsonable(r.metadata)) if r.metadata else None),
        ("timeout", format_seconds(c.timeout) if c.timeout is not None else "none"),
        (
            "unresponsive timeout",
            format_seconds(c.unresponsive_timeout) if c.unresponsive_timeout is not None else "none",
        ),
        ("max attempts", c.max_attempts),
        ("retry on", ", ".join(str(s) for s in c.retry_on) or "none"),
    ]


def attempt_row(a: t.Attempt) -> list[object]:
    return [
        a.sequence_number,
        a.attempt_id,
        a.status,
        a.worker_id,
        format_time(a.start_time),
        format_duration(a.start_time, a.end_time),
        format_time(a.last_heartbeat_time),
        a.status_message,
    ]


def worker_row(w: t.Worker) -> list[object]:
    return [
        w.worker_id,
        w.status,
        w.current_rollout_id,
        w.current_attempt_id,
        format_time(w.last_heartbeat_time),
        format_time(w.last_dequeue_time),
        summarize(w.heartbeat_stats),
    ]


def resources_row(u: t.ResourcesUpdate, latest_id: str) -> list[object]:
    inside = ", ".join(f"{name}:{resource_kind(r)}" for name, r in sorted(u.resources.items()))
    return [
        u.resources_id,
        u.version,
        "*" if u.resources_id == latest_id else "",
        format_time(u.update_time),
        inside,
    ]


def stats_fields(s: t.Statistics) -> list[tuple[str, object]]:
    by_status = ", ".join(f"{name} {count}" for name, count in sorted(s.rollouts_by_status.items()))
    return [
        ("backend", s.backend),
        ("uptime", format_seconds(s.uptime)),
        ("rollouts", s.total_rollouts),
        ("by status", by_status or None),
        ("queue length", s.queue_length),
        ("attempts", s.total_attempts),
        ("spans", s.total_spans),
        ("resources", s.total_resources),
        ("workers", s.total_workers),
        ("memory", format_bytes(s.memory_bytes))
        if s.backend == "memory"
        else ("on disk", format_bytes(s.storage_bytes)),
    ]


def span_line(s: t.Span) -> str:
    duration_ms = (
        max(0, s.end_time_unix_nano - s.start_time_unix_nano) / 1e6 if s.end_time_unix_nano else None
    )
    duration = f"{duration_ms:.1f}ms" if duration_ms is not None else "-"
    attributes = readable_first(s.attributes)
    tools = tool_calls_summary(s) if s.name == semconv.SPAN_LLM_CALL else ""
    if tools:
        attributes = {"tool_calls": tools, **attributes}
    return f"{s.sequence_id:>6}  {s.attempt_id:<15}  {s.name:<20}  {duration:>10}  {summarize(attributes)}".rstrip()


def readable_first(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A span's attributes for one line: its operation name and reward first, the ids it repeats last."""
    reward = semconv.read_reward(attributes)
    reward_keys = {k for k in attributes if k == semconv.REWARD_PRIMARY or k.startswith(semconv.SPAN_REWARD)}
    reward_keys |= {k for k in attributes if k.startswith("agentlightning.reward")}
    ids = {k: v for k, v in attributes.items() if k in ID_ATTRIBUTES}
    out: dict[str, Any] = {}
    if semconv.OPERATION_NAME in attributes:
        out[semconv.OPERATION_NAME] = attributes[semconv.OPERATION_NAME]
    if reward:
        out["reward"] = semconv.read_primary_reward(attributes)
        primary_name = attributes.get(semconv.REWARD_PRIMARY, semconv.PRIMARY)
        out.update((f"reward.{name}", value) for name, value in reward.items() if name != primary_name)
    out.update((k, v) for k, v in attributes.items() if k not in ids and k not in reward_keys)
    out.update(ids)
    return out


def resource_kind(resource: object) -> str:
    return RESOURCE_KINDS.get(type(resource), type(resource).__name__.lower())


def resources_json(u: t.ResourcesUpdate) -> dict[str, Any]:
    out = jsonable(u)
    out["resources"] = {
        name: {"kind": resource_kind(r), **_masked(jsonable(r))} for name, r in u.resources.items()
    }
    return out  # type: ignore[no-any-return]


def _masked(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: ("***" if k in SECRET_FIELDS and v else v) for k, v in fields.items()}


# ---------------------------------------------------------------- formatting
def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns left-aligned to their widest cell, two spaces apart; empty cells show as '-'."""
    lines = [[str(h) for h in headers], *([cell_text(c) for c in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def format_fields(fields: Sequence[tuple[str, object]]) -> str:
    """``name:  value`` lines with the values aligned."""
    width = max((len(name) for name, _ in fields), default=0) + 1
    return "\n".join(f"{name + ':':<{width}}  {cell_text(value)}" for name, value in fields)


def cell_text(value: object) -> str:
    text = "-" if value is None or value == "" else str(value)
    return text.replace("\n", " ")


def format_time(ts: float | None) -> str | None:
    if not ts:
        return None
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def format_duration(start: float | None, end: float | None) -> str | None:
    """How long something took, or has been going on (then with a trailing '+')."""
    if not start:
        return None
    if end:
        return format_seconds(end - start)
    return format_seconds(time.time() - start) + "+"


def format_seconds(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


def summarize(values: Mapping[str, Any], width: int = 80, value_width: int = 24) -> str:
    """``key=value`` pairs, each value and the whole line cut short to fit."""
    parts = []
    for key, value in values.items():
        text = value if isinstance(value, str) else json.dumps(jsonable(value), ensure_ascii=False)
        parts.append(f"{key}={_shorten(text.replace(chr(10), ' '), value_width)}")
    return _shorten(" ".join(parts), width)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# ---------------------------------------------------------------- JSON
def jsonable(value: Any) -> Any:
    """Plain JSON values of the client's objects: enums by name, bytes in base64."""
    if isinstance(value, enum.Enum):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    return value


def _print_json_lines(items: Iterable[Any]) -> None:
    for item in items:
        print(json.dumps(item if isinstance(item, dict) else jsonable(item), ensure_ascii=False))
