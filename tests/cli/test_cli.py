"""The inspection commands of ``lightning-grpc``, run as real processes against live servers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_grpc import semconv
from lightning_grpc.cli.inspect_commands import format_table, span_line
from lightning_grpc.client import StoreClient, SyncStoreClient
from lightning_grpc.types import LLM, PromptTemplate, Span
from tests.conftest import ROOT, ServerProcess

CLI = [sys.executable, "-m", "lightning_grpc.cli.main"]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")}
#: Runs the command after it with SIGINT at its default, as a terminal's foreground command has it: a test run
#: started in the background by a non-interactive shell ignores SIGINT, and its children inherit that. (Not a
#: preexec_fn: Python code run in a child forked from this process, whose gRPC threads are busy, can fail
#: before the exec.)
WITH_CTRL_C = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, cwd=ROOT, env={**CLEAN_ENV, **(env or {})}, timeout=60
    )


def make_span(name: str, attributes: dict[str, object], duration_ms: int = 5) -> Span:
    start = time.time_ns()
    return Span(
        trace_id=os.urandom(16).hex(),
        span_id=os.urandom(8).hex(),
        name=name,
        start_time_unix_nano=start,
        end_time_unix_nano=start + duration_ms * 1_000_000,
        attributes=attributes,
    )


@dataclass
class Seeded:
    """A store process holding one rollout of each interesting kind."""

    address: str
    resources_id: str
    succeeded: str
    succeeded_attempt: str
    failed: str
    running: str
    queued: tuple[str, str]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, "--store", self.address)

    def ok(self, *args: str) -> str:
        done = self.cli(*args)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        return done.stdout


def seed(client: SyncStoreClient, address: str) -> Seeded:
    resources = client.add_resources(
        {
            "prompt": PromptTemplate("Solve: {question}"),
            "llm": LLM("http://127.0.0.1:9/v1", "tiny-model", api_key="sk-very-secret"),
        }
    )
    spec = {"resources_id": resources.resources_id, "mode": "train", "group_id": "grp-a"}

    good = client.enqueue_rollout({"question": "1+1", "answer": 2}, **spec)
    rollout = client.dequeue_rollout(worker_id="worker-1", wait=1)
    assert rollout.rollout_id == good.rollout_id
    attempt_id = rollout.latest_attempt.attempt_id
    client.add_spans(
        [make_span("agent", {"prompt": "Solve: 1+1"}, 12), make_span("reward", {"lightning.reward": 0.75})],
        rollout_id=good.rollout_id,
        attempt_id=attempt_id,
    )
    client.complete_attempt(good.rollout_id, attempt_id, "succeeded")

    bad = client.enqueue_rollout({"question": "1/0"}, **spec)
    rollout = client.dequeue_rollout(worker_id="worker-2", wait=1)
    client.complete_attempt(bad.rollout_id, rollout.latest_attempt.attempt_id, "failed", "division by zero")

    busy = client.enqueue_rollout({"question": "2+2"}, **spec)
    rollout = client.dequeue_rollout(worker_id="worker-3", wait=1)
    client.heartbeat_attempt(busy.rollout_id, rollout.latest_attempt.attempt_id)
    client.update_worker("worker-3", {"gpu_util": 0.5})

    queued = [client.enqueue_rollout({"question": q}, mode="val", group_id="grp-b") for q in ("3+3", "4+4")]
    return Seeded(
        address=address,
        resources_id=resources.resources_id,
        succeeded=good.rollout_id,
        succeeded_attempt=attempt_id,
        failed=bad.rollout_id,
        running=busy.rollout_id,
        queued=(queued[0].rollout_id, queued[1].rollout_id),
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    db = tmp_path_factory.mktemp("cli") / "store.db"
    process = ServerProcess("--port", "0", "--db", str(db), "--grace", "1", env=CLEAN_ENV).start()
    try:
        with SyncStoreClient(process.address) as client:
            seeded = seed(client, process.address)
        yield seeded
    finally:
        process.kill()


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of a table by their first cell (the header row is keyed by its first header)."""
    return {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


# ---------------------------------------------------------------- rollouts
def test_rollouts_table_shows_every_rollout_with_status_and_worker(store: Seeded) -> None:
    rows = table_rows(store.ok("rollouts"))
    assert rows["ID"] == [
        "ID",
        "STATUS",
        "REWARD",
        "MODE",
        "ATTEMPTS",
        "LAST_ATTEMPT",
        "WORKER",
        "CREATED",
        "DURATION",
    ]
    assert rows[store.succeeded][1:7] == ["succeeded", "0.75", "train", "1", "succeeded", "worker-1"]
    assert rows[store.failed][1:7] == ["failed", "-", "train", "1", "failed", "worker-2"]  # no reward, not 0
    assert rows[store.running][1:7] == ["running", "-", "train", "1", "running", "worker-3"]
    for rid in store.queued:
        assert rows[rid][1:7] == ["queuing", "-", "val", "0", "-", "-"]


def test_rollouts_table_columns_are_aligned(store: Seeded) -> None:
    lines = store.ok("rollouts").splitlines()
    status_column = lines[0].index("STATUS")
    assert all(line[status_column - 2 : status_column] == "  " for line in lines)
    assert all(line[status_column] != " " for line in lines)


def test_rollouts_newest_first(store: Seeded) -> None:
    ids = [line.split()[0] for line in store.ok("rollouts").splitlines()[1:]]
    assert ids == [*reversed(store.queued), store.running, store.failed, store.succeeded]


def test_rollouts_filter_by_status_and_group(store: Seeded) -> None:
    rows = table_rows(store.ok("rollouts", "--status", "running", "--status", "failed"))
    assert set(rows) == {"ID", store.running, store.failed}
    rows = table_rows(store.ok("rollouts", "--group", "grp-b"))
    assert set(rows) == {"ID", *store.queued}


def test_rollouts_limit_says_how_many_are_left_out(store: Seeded) -> None:
    done = store.cli("rollouts", "--limit", "2")
    assert done.returncode == 0
    assert set(table_rows(done.stdout)) == {"ID", *store.queued}
    assert "2 of 5 rollouts" in done.stderr


def test_rollouts_json_lines(store: Seeded) -> None:
    records = [json.loads(line) for line in store.ok("rollouts", "--json").splitlines()]
    by_id = {r["rollout_id"]: r for r in records}
    assert set(by_id) == {store.succeeded, store.failed, store.running, *store.queued}
    assert by_id[store.failed]["status"] == "failed"
    assert by_id[store.failed]["latest_attempt"]["status_message"] == "division by zero"
    assert by_id[store.succeeded]["input"] == {"question": "1+1", "answer": 2}
    assert by_id[store.queued[0]]["mode"] == "val"


def test_rollouts_rejects_an_unknown_status(store: Seeded) -> None:
    done = store.cli("rollouts", "--status", "sleeping")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- rollout
def test_rollout_shows_fields_input_and_attempts(store: Seeded) -> None:
    out = store.ok("rollout", store.failed)
    fields = dict(line.split(":", 1) for line in out.split("\ninput:")[0].splitlines())
    assert fields["rollout"].strip() == store.failed
    assert fields["status"].strip() == "failed"
    assert fields["message"].strip() == "division by zero"
    assert fields["group"].strip() == "grp-a"
    assert fields["resources"].strip() == store.resources_id
    assert fields["max attempts"].strip() == "1"
    assert fields["reward"].strip() == "-"
    succeeded = store.ok("rollout", store.succeeded).split("\ninput:")[0].splitlines()
    assert dict(line.split(":", 1) for line in succeeded)["reward"].strip() == "0.75"
    input_text = out.split("\ninput:\n")[1].split("\n\nattempts:")[0]
    assert json.loads(input_text) == {"question": "1/0"}
    attempts = table_rows(out.split("\nattempts:\n")[1])
    assert attempts["#"][:4] == ["#", "ID", "STATUS", "WORKER"]
    assert attempts["1"][2:4] == ["failed", "worker-2"]
    assert out.rstrip().endswith("division by zero")


def test_rollout_json(store: Seeded) -> None:
    lines = store.ok("rollout", store.succeeded, "--json").splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["rollout_id"] == store.succeeded
    assert record["status"] == "succeeded"
    assert record["reward"] == 0.75
    assert record["config"]["max_attempts"] == 1
    assert [a["attempt_id"] for a in record["attempts"]] == [store.succeeded_attempt]
    assert record["attempts"][0]["worker_id"] == "worker-1"


# ---------------------------------------------------------------- spans
def test_spans_one_line_each(store: Seeded) -> None:
    lines = store.ok("spans", store.succeeded).splitlines()
    assert len(lines) == 2
    agent, reward = (line.split() for line in lines)
    assert agent[:3] == ["1", store.succeeded_attempt, "agent"]
    assert agent[3] == "12.0ms"
    assert "prompt=Solve: 1+1" in lines[0]
    assert reward[:3] == ["2", store.succeeded_attempt, "reward"]
    assert lines[1].endswith("reward=0.75")


def test_a_span_line_shows_the_reward_first_and_the_ids_it_repeats_last() -> None:
    attributes = {
        "lightning.rollout_id": "ro-" + "a" * 16,
        "lightning.attempt_id": "at-" + "b" * 12,
        "step": 3,
        **semconv.reward_attributes({"acc": 1.0, "speed": 0.5}, primary="acc"),
    }
    line = span_line(make_span("grade", attributes))
    summary = line.split("ms  ", 1)[1]
    assert summary.startswith("reward=1.0 reward.speed=0.5 step=3 ")
    assert summary.index("step=3") < summary.index("lightning.rollout_id=")
    assert "lightning.reward.value" not in summary


def test_spans_of_latest_or_named_attempt(store: Seeded) -> None:
    for attempt in ("latest", store.succeeded_attempt):
        records = [
            json.loads(x)
            for x in store.ok("spans", store.succeeded, "--attempt", attempt, "--json").split("\n")
            if x
        ]
        assert [r["name"] for r in records] == ["agent", "reward"]
        assert records[1]["attributes"] == {"lightning.reward": 0.75}
        assert {r["attempt_id"] for r in records} == {store.succeeded_attempt}


def test_spans_of_a_rollout_without_spans(store: Seeded) -> None:
    done = store.cli("spans", store.queued[0])
    assert done.returncode == 0
    assert done.stdout == ""
    assert "no spans" in done.stderr


# ---------------------------------------------------------------- workers, resources, stats
def test_workers_table_and_json(store: Seeded) -> None:
    rows = table_rows(store.ok("workers"))
    assert rows["ID"][:4] == ["ID", "STATUS", "ROLLOUT", "ATTEMPT"]
    assert {"worker-1", "worker-2", "worker-3"} <= set(rows)
    assert rows["worker-3"][1:3] == ["busy", store.running]
    assert rows["worker-3"][-1] == "gpu_util=0.5"
    records = {w["worker_id"]: w for w in map(json.loads, store.ok("workers", "--json").splitlines())}
    assert records["worker-3"]["heartbeat_stats"] == {"gpu_util": 0.5}
    assert records["worker-3"]["current_rollout_id"] == store.running


def test_resources_table_and_json_hide_api_keys(store: Seeded) -> None:
    out = store.ok("resources")
    rows = table_rows(out)
    assert rows["ID"] == ["ID", "VERSION", "LATEST", "UPDATED", "RESOURCES"]
    assert rows[store.resources_id][1:3] == ["1", "*"]
    assert out.rstrip().endswith("llm:llm, prompt:prompt_template")
    json_out = store.ok("resources", "--json")
    (record,) = map(json.loads, json_out.splitlines())
    assert record["resources_id"] == store.resources_id
    assert record["latest"] is True
    assert record["resources"]["prompt"] == {
        "kind": "prompt_template",
        "template": "Solve: {question}",
        "engine": "f-string",
    }
    assert record["resources"]["llm"]["kind"] == "llm"
    assert record["resources"]["llm"]["api_key"] == "***"
    assert "sk-very-secret" not in json_out + out


def test_stats_text_and_json(store: Seeded) -> None:
    fields = {
        k.strip(): v.strip() for k, v in (line.split(":", 1) for line in store.ok("stats").splitlines())
    }
    assert fields["backend"] == "sqlite"
    assert fields["rollouts"] == "5"
    assert fields["by status"] == "failed 1, queuing 2, running 1, succeeded 1"
    assert fields["spans"] == "2"
    assert "memory" not in fields  # a SQLite store says what it holds on disk instead
    assert fields["on disk"].endswith(("KiB", "MiB")) and float(fields["on disk"][:-3]) > 0
    (record,) = map(json.loads, store.ok("stats", "--json").splitlines())
    assert record["storage_bytes"] > 4096 and record["memory_bytes"] == 0
    assert record["total_rollouts"] == 5
    assert record["rollouts_by_status"] == {"succeeded": 1, "failed": 1, "running": 1, "queuing": 2}
    assert record["queue_length"] == 2


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("rollout", "ro-does-not-exist"), "ROLLOUT_NOT_FOUND"),
        (("rollout", "ro-does-not-exist", "--json"), "ROLLOUT_NOT_FOUND"),
        (("spans", "ro-does-not-exist"), "ROLLOUT_NOT_FOUND"),
        (("spans", "ro-does-not-exist", "--follow"), "ROLLOUT_NOT_FOUND"),
    ],
)
def test_unknown_rollout_is_a_one_line_error(store: Seeded, args: tuple[str, ...], reason: str) -> None:
    line = one_line_error(store.cli(*args))
    assert line.startswith(f"error: {reason}: ")
    assert "ro-does-not-exist" in line


def test_unknown_attempt_is_a_one_line_error(store: Seeded) -> None:
    line = one_line_error(store.cli("spans", store.succeeded, "--attempt", "at-does-not-exist"))
    assert "NOT_FOUND" in line and "at-does-not-exist" in line


def test_unreachable_store_is_a_one_line_error() -> None:
    line = one_line_error(run_cli("stats", "--store", "127.0.0.1:1"))
    assert line.startswith("error: UNAVAILABLE: ")


def test_store_and_token_come_from_the_environment() -> None:
    process = ServerProcess("--port", "0", "--memory", "--token", "s3cret", env=CLEAN_ENV).start()
    try:
        env = {"LIGHTNING_GRPC_STORE": process.address}
        line = one_line_error(run_cli("stats", env=env))
        assert "token" in line
        done = run_cli("stats", "--json", env={**env, "LIGHTNING_GRPC_TOKEN": "s3cret"})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["backend"] == "memory"
    finally:
        process.kill()


# ---------------------------------------------------------------- follow
async def test_spans_follow_of_an_ended_rollout_prints_its_spans_and_exits(client: StoreClient) -> None:
    rollout = await client.enqueue_rollout({"question": "already done"})
    started = await client.dequeue_rollout(worker_id="worker-e", wait=1)
    assert started is not None and started.latest_attempt is not None
    attempt_id = started.latest_attempt.attempt_id
    await client.add_spans(
        [make_span("only", {"step": 1})], rollout_id=rollout.rollout_id, attempt_id=attempt_id
    )
    await client.complete_attempt(rollout.rollout_id, attempt_id, "succeeded")
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "spans",
        rollout.rollout_id,
        "--follow",
        "--store",
        client.config.target,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=CLEAN_ENV,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    assert [line.split()[2] for line in out.splitlines()] == [b"only"]


async def test_spans_follow_prints_new_spans_until_interrupted(client: StoreClient) -> None:
    rollout = await client.enqueue_rollout({"question": "follow me"})
    started = await client.dequeue_rollout(worker_id="worker-f", wait=1)
    assert started is not None and started.latest_attempt is not None
    ids = {"rollout_id": rollout.rollout_id, "attempt_id": started.latest_attempt.attempt_id}
    await client.add_spans([make_span("first", {"step": 1})], **ids)

    proc = await asyncio.create_subprocess_exec(
        *WITH_CTRL_C,
        *CLI,
        "spans",
        rollout.rollout_id,
        "--follow",
        "--attempt",
        "latest",
        "--store",
        client.config.target,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=CLEAN_ENV,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not first:  # the command ended: say why
            raise AssertionError(f"spans --follow ended ({await proc.wait()}): {await proc.stderr.read()!r}")
        assert first.split()[2] == b"first", first
        await client.add_spans([make_span("second", {"step": 2})], **ids)
        second = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert second.split()[:3] == [b"2", ids["attempt_id"].encode(), b"second"]
        assert b"step=2" in second
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert b"Traceback" not in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ---------------------------------------------------------------- an agent's tool calls
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("press", "reset")
]
PROMPT = [
    {"role": "system", "content": "Open the lock with the tools."},
    {"role": "user", "content": "The lock has 3 digits."},
]
PRESS = {"id": "call_1", "type": "function", "function": {"name": "press", "arguments": '{"digit": 3}'}}


def llm_call_span(
    messages: list[dict[str, object]], message: dict[str, object], finish: str, usage: tuple[int, int]
) -> Span:
    """A ``lightning.llm.call`` span as the proxy records it (request and response as JSON)."""
    request = {"model": "policy", "messages": messages, "tools": TOOLS, "tool_choice": "auto"}
    response = {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}
    return make_span(
        semconv.SPAN_LLM_CALL,
        {
            semconv.LLM_MODEL: "policy",
            semconv.LLM_REQUEST: json.dumps(request),
            semconv.LLM_RESPONSE: json.dumps(response),
            semconv.LLM_FINISH_REASON: finish,
            semconv.LLM_USAGE_PROMPT_TOKENS: usage[0],
            semconv.LLM_USAGE_COMPLETION_TOKENS: usage[1],
        },
    )


def tool_conversation() -> list[Span]:
    """Two calls: the model presses 3, the tool answers, the model says the lock is open."""
    first = llm_call_span(
        PROMPT, {"role": "assistant", "content": None, "tool_calls": [PRESS]}, "tool_calls", (42, 9)
    )
    first.attributes[semconv.LLM_DIALECT] = (
        semconv.DIALECT_CHAT_COMPLETIONS
    )  # the second call names no dialect
    answered = [
        *PROMPT,
        {"role": "assistant", "content": None, "tool_calls": [PRESS]},
        {"role": "tool", "tool_call_id": "call_1", "content": "click: 1 of 3 digits right"},
    ]
    second = llm_call_span(answered, {"role": "assistant", "content": "The lock is open."}, "stop", (61, 5))
    second.start_time_unix_nano = first.end_time_unix_nano + 1_000_000
    second.end_time_unix_nano = second.start_time_unix_nano + 5_000_000
    return [second, first]  # stored out of order: the view orders by start time


async def cli_out(client: StoreClient, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *CLI, *args, "--store", client.config.target,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=CLEAN_ENV,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err
    return out.decode()


async def test_rollout_shows_the_tool_calls_and_results_of_its_llm_calls(client: StoreClient) -> None:
    rollout = await client.enqueue_rollout({"lock": [3, 1, 4]})
    started = await client.dequeue_rollout(worker_id="worker-t", wait=1)
    assert started is not None and started.latest_attempt is not None
    ids = {"rollout_id": rollout.rollout_id, "attempt_id": started.latest_attempt.attempt_id}
    await client.add_spans(tool_conversation(), **ids)
    await client.complete_attempt(rollout.rollout_id, ids["attempt_id"], "succeeded")

    out = await cli_out(client, "rollout", rollout.rollout_id)
    assert out.split("\ninput:")[0].startswith("rollout:")  # the fields, input and attempts stay
    calls = out.split("\nllm calls of attempt 1:\n")[1].splitlines()
    assert calls == [
        "  #1  chat_completions  finish tool_calls  tokens 42 in / 9 out  model policy",
        "    tools: press, reset  (tool_choice auto)",
        "    user: The lock has 3 digits.",
        '    -> press({"digit": 3})  [call_1]',
        "  #2  -  finish stop  tokens 61 in / 5 out  model policy",
        "    tools: press, reset  (tool_choice auto)",
        "    <- press [call_1]: click: 1 of 3 digits right",
        "    assistant: The lock is open.",
    ]

    record = json.loads(await cli_out(client, "rollout", rollout.rollout_id, "--json"))
    first, second = record["llm_calls"]
    assert first["tool_calls"] == [{"call_id": "call_1", "name": "press", "arguments": '{"digit": 3}'}]
    assert (first["dialect"], first["finish_reason"], first["prompt_tokens"]) == (
        "chat_completions",
        "tool_calls",
        42,
    )
    assert first["tools"] == ["press", "reset"]
    assert second["tool_results"] == [
        {"call_id": "call_1", "name": "press", "content": "click: 1 of 3 digits right"}
    ]
    assert (second["dialect"], second["reply"], second["tool_calls"]) == ("", "The lock is open.", [])
    assert (first["user"], second["user"]) == (["The lock has 3 digits."], [])

    lines = (await cli_out(client, "spans", rollout.rollout_id)).splitlines()
    assert [line.split()[2] for line in lines] == [semconv.SPAN_LLM_CALL] * 2
    # in the order stored: the second call (no tool call), then the first
    assert "tool_calls=" not in lines[0]
    assert lines[1].split("ms  ", 1)[1].startswith('tool_calls=press({"digit": 3}) ')


# ---------------------------------------------------------------- formatting
def test_format_table_aligns_and_fills_empty_cells() -> None:
    text = format_table(("A", "LONG HEADER", "C"), [["x", None, 1], ["wider cell", "", "two\nlines"]])
    assert text.splitlines() == [
        "A           LONG HEADER  C",
        "x           -            1",
        "wider cell  -            two lines",
    ]


# ================================================================= help and mistakes
def command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_grpc.cli.main", *args], capture_output=True, text=True, timeout=60
    )


def test_version_and_a_help_that_names_every_part() -> None:
    version = command("--version")
    assert version.returncode == 0 and version.stdout.startswith("lightning-grpc ")
    top = command("--help").stdout
    for part in ("Store", "TrainerService", "proxy", "engine", "agents", "train"):
        assert part in top
    for name in ("serve", "runner", "proxy", "engine", "init-model", "train", "rollouts", "triplets"):
        assert name in top


def test_help_shows_defaults_and_no_internal_names() -> None:
    for sub in ("proxy", "serve", "runner", "init-model"):
        text = command(sub, "--help").stdout
        assert "PROXY_" not in text, sub  # metavars say what to give, not the internal dest
    runner = command("runner", "--help").stdout
    assert "--store HOST:PORT" in runner and "$LIGHTNING_GRPC_STORE" in runner
    assert "(default: 1)" in runner  # --concurrency
    init = command("init-model", "--help").stdout
    assert "(default: 2048)" in init and "--force" in init


def test_help_of_no_flags_is_truthful_and_shows_no_default_from_the_environment() -> None:
    secret = "tok-from-the-environment"
    env = {"LIGHTNING_GRPC_TOKEN": secret, "LIGHTNING_GRPC_BACKEND_API_KEY": secret}
    done = run_cli("serve", "--help", env=env)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps the help at the terminal's width
    # a flag's dest default (reflection=True, dashboard=True) shown under --no-X read as "off by default"
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "--no-reflection do not serve gRPC reflection; without this flag it is served" in text
    assert "--no-dashboard do not serve the dashboard; without this flag it is served" in text
    for args in (("serve",), ("runner",), ("proxy",), ("credential", "runner"), ("rollouts",)):
        text = run_cli(*args, "--help", env=env).stdout
        assert secret not in text, args  # the help names the variable instead: (default: $NAME)
        assert "(default: True)" not in text, args
        assert "default: $LIGHTNING_GRPC_TOKEN" in " ".join(text.split()), args


def test_a_subcommands_mistake_shows_that_subcommands_usage() -> None:
    done = command("rollouts", "--bogus")
    assert done.returncode == 2
    assert "usage: lightning-grpc rollouts" in done.stderr
    assert "lightning-grpc rollouts: error: unrecognized arguments: --bogus" in done.stderr


def test_a_runner_that_cannot_reach_its_store_says_so_in_one_line_and_exits() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [
            *CLI,
            "runner",
            "lightning_grpc.examples.combination_lock:agent",
            "--store",
            "127.0.0.1:1",
            "--connect-timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=CLEAN_ENV,
    )
    assert done.returncode == 2
    assert time.monotonic() - started < 30  # bounded: not the reconnect-for-ever of a running runner
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "127.0.0.1:1" in line]
    assert errors == [
        "error: STORE_UNREACHABLE: cannot reach the store at 127.0.0.1:1 within 1 s (is it running, and is the address right?)"
    ]
    assert "Traceback" not in done.stderr and "WARNING" not in done.stdout + done.stderr


def test_a_taken_port_is_one_clear_line_without_grpc_cores_own_log() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = command("serve", "--memory", "--port", str(port))
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert (
        f"cannot listen on 127.0.0.1:{port}: the port is in use (is another server running there?)" in output
    )
    assert "add_port.cc" not in output and "GRPC_VERBOSITY" not in output
    assert "Traceback" not in output


def test_serve_names_the_option_to_pass_when_the_backend_cannot_say_its_model() -> None:
    done = command(
        "serve",
        "--memory",
        "--port",
        "0",
        "--proxy-backend",
        "http://127.0.0.1:9/v1",
        "--proxy-backend-wait",
        "1",
    )
    assert done.returncode != 0
    assert "pass --proxy-model-name NAME" in done.stderr
    proxy = command("proxy", "--backend", "http://127.0.0.1:9/v1", "--backend-wait", "0")
    assert proxy.returncode != 0
    assert "pass --model-name NAME" in proxy.stderr


# ---------------------------------------------------------------- enqueue, cancel, delete
async def test_enqueue_inline_and_from_a_file_in_grpo_groups(client: StoreClient, tmp_path: Path) -> None:
    store = client.config.target
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": "3+3"}\n\n{"q": "4+4"}\n')
    done = await asyncio.to_thread(
        run_cli, "enqueue", '{"q": "2+2"}', "--file", str(tasks), "--group-size", "2", "--mode", "train",
        "--max-attempts", "3", "--store", store, "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    queued = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["input"] for r in queued] == [{"q": "2+2"}] * 2 + [{"q": "3+3"}] * 2 + [{"q": "4+4"}] * 2
    groups = [r["group_id"] for r in queued]
    assert groups[0] == groups[1] != groups[2] == groups[3] != groups[4] == groups[5]
    stored = await client.get_rollout(queued[0]["rollout_id"])
    assert str(stored.status) == "queuing" and str(stored.mode) == "train" and stored.config.max_attempts == 3


async def test_enqueue_names_the_line_that_is_not_json_and_queues_nothing(
    client: StoreClient, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": 1}\n{"q": 2\n')
    done = await asyncio.to_thread(run_cli, "enqueue", "--file", str(tasks), "--store", client.config.target)
    line = one_line_error(done)
    assert line.startswith(f"error: {tasks} line 2 is not JSON")
    assert (await client.list_rollouts()).items == []


async def test_cancel_then_delete_a_rollout(client: StoreClient) -> None:
    store = client.config.target
    queued = await client.enqueue_rollout({"q": 1})
    kept = await client.enqueue_rollout({"q": 2})
    refused = one_line_error(await asyncio.to_thread(run_cli, "delete", queued.rollout_id, "--store", store))
    assert refused.startswith("error: ROLLOUT_NOT_FINISHED: ")  # only ended rollouts are deleted
    done = await asyncio.to_thread(
        run_cli, "cancel", queued.rollout_id, "--reason", "bad prompt", "--store", store
    )
    assert done.returncode == 0, done.stderr
    assert table_rows(done.stdout)[queued.rollout_id][1] == "cancelled"
    assert (await client.get_rollout(queued.rollout_id)).status_message == "bad prompt"
    done = await asyncio.to_thread(run_cli, "delete", queued.rollout_id, "--store", store)
    assert done.stdout.strip() == "deleted 1 rollouts, 0 attempts and 0 spans"
    assert [r.rollout_id for r in (await client.list_rollouts()).items] == [kept.rollout_id]


async def test_retry_ends_a_stuck_attempt_and_queues_the_rollout(client: StoreClient) -> None:
    await client.enqueue_rollout({"q": 1})
    claimed = await client.dequeue_rollout(worker_id="hung")
    assert claimed is not None
    done = await asyncio.to_thread(
        run_cli, "retry", claimed.rollout_id, "--reason", "worker hung", "--store", client.config.target
    )
    assert done.returncode == 0, done.stderr
    assert table_rows(done.stdout)[claimed.rollout_id][1:] == ["requeuing", "1"]
    (attempt,) = await client.query_attempts(claimed.rollout_id)
    assert str(attempt.status) == "failed" and attempt.status_message == "worker hung"
