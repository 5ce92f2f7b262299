"""Runners over real servers: attribution, crashes, cancellation, stream cuts, fleets, hooks, emitters."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.runner import Hook, LitAgent, Runner, RunnerSpec, rollout
from lightning_grpc.server.app import RunningServer
from lightning_grpc.tracing import (
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    install_tracing,
    operation,
)
from lightning_grpc.types import (
    AttemptStatus,
    PromptTemplate,
    ProxyLLM,
    Rollout,
    RolloutConfig,
    RolloutStatus,
)
from tests.conftest import ROOT
from tests.runner_agents import sync_counter


async def runner_process(target: str, agent: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lightning_grpc.cli.main",
        "runner",
        agent,
        "--store",
        target,
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def spans_by_name(spans: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


async def test_200_concurrent_rollouts_keep_every_span_in_its_own_attempt(
    server: RunningServer, client: StoreClient
) -> None:
    target = f"127.0.0.1:{server.port}"
    rollouts = await client.enqueue_rollouts([{"input": {"i": i}} for i in range(200)])
    proc = await runner_process(
        target,
        "tests.runner_agents:TracedAgent",
        "--concurrency",
        "200",
        "--max-rollouts",
        "200",
        "--poll-wait",
        "0.5",
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out.decode()[-3000:]
    done = await client.wait_for_rollouts([r.rollout_id for r in rollouts], timeout=10)
    assert len(done) == 200 and {r.status for r in done} == {RolloutStatus.SUCCEEDED}
    total = 0
    for r in rollouts:
        spans = await client.query_spans(r.rollout_id)
        total += len(spans)
        final = await client.get_rollout(r.rollout_id)
        assert final.latest_attempt is not None
        assert {s.attempt_id for s in spans} == {final.latest_attempt.attempt_id}
        named = spans_by_name(spans)
        (step,) = named["agent.step"]
        (http,) = named["GET"]  # made by the httpx instrumentation inside the agent
        (reward,) = named[semconv.SPAN_REWARD]
        (root,) = named[semconv.SPAN_ROLLOUT]
        assert step.parent_span_id == root.span_id and step.trace_id == root.trace_id
        assert step.attributes["task.rollout"] == r.rollout_id
        assert r.rollout_id in str(http.attributes.get("url.full") or http.attributes.get("http.url"))
        assert http.parent_span_id == step.span_id
        assert semconv.read_primary_reward(reward.attributes) == r.input["i"] / 1000
    assert total == 200 * 4  # nothing landed in another attempt


async def test_a_killed_runner_leaves_unresponsive_attempts_that_another_runner_retries(
    server: RunningServer, client: StoreClient
) -> None:
    target = f"127.0.0.1:{server.port}"
    cfg = RolloutConfig(unresponsive_timeout=1.5, max_attempts=2, retry_on=(AttemptStatus.UNRESPONSIVE,))
    ids = [
        r.rollout_id for r in await client.enqueue_rollouts([{"input": i, "config": cfg} for i in range(6)])
    ]
    first = await runner_process(
        target, "tests.runner_agents:slow_first_attempt", "--concurrency", "6", "--heartbeat-interval", "0.3"
    )
    deadline = time.monotonic() + 30
    while (await client.statistics()).rollouts_by_status.get("running", 0) < 6:
        assert time.monotonic() < deadline, "the first runner never took the rollouts"
        await asyncio.sleep(0.1)
    first.send_signal(signal.SIGKILL)
    await first.wait()
    second = await runner_process(
        target,
        "tests.runner_agents:slow_first_attempt",
        "--concurrency",
        "6",
        "--max-rollouts",
        "6",
        "--poll-wait",
        "0.5",
    )
    done = await client.wait_for_rollouts(ids, timeout=30)
    out, _ = await asyncio.wait_for(second.communicate(), 30)
    assert second.returncode == 0, out.decode()[-2000:]
    assert len(done) == 6 and {r.status for r in done} == {RolloutStatus.SUCCEEDED}
    for rid in ids:
        attempts = await client.query_attempts(rid)
        assert [a.status for a in attempts] == [AttemptStatus.UNRESPONSIVE, AttemptStatus.SUCCEEDED]
        assert attempts[0].worker_id != attempts[1].worker_id and attempts[0].end_time is not None


async def test_cancelling_a_rollout_stops_its_async_agent_within_a_heartbeat_interval(
    server: RunningServer, client: StoreClient
) -> None:
    stopped: dict[str, float] = {}

    @rollout
    async def forever(task: Any, rollout: Rollout) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stopped[rollout.rollout_id] = time.monotonic()
            raise

    runner = Runner(forever, f"127.0.0.1:{server.port}", concurrency=2, heartbeat_interval=0.3, poll_wait=0.3)
    loop_task = asyncio.create_task(runner.run())
    r = await client.enqueue_rollout({"forever": True})
    while (await client.get_rollout(r.rollout_id)).status != RolloutStatus.PREPARING:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    cancelled_at = time.monotonic()
    await client.cancel_rollout(r.rollout_id, "enough")
    while r.rollout_id not in stopped and time.monotonic() - cancelled_at < 5:
        await asyncio.sleep(0.02)
    runner.stop()
    await asyncio.wait_for(loop_task, 10)
    assert r.rollout_id in stopped and stopped[r.rollout_id] - cancelled_at < 0.3 + 0.3
    final = await client.get_rollout(r.rollout_id)
    assert final.status == RolloutStatus.CANCELLED and final.latest_attempt is not None
    assert final.latest_attempt.status == AttemptStatus.CANCELLED


async def test_a_sync_agent_learns_of_cancellation_through_should_stop(
    server: RunningServer, client: StoreClient, tmp_path: Path
) -> None:
    from tests.runner_agents import sync_until_stopped

    marker = tmp_path / "stopped"
    runner = Runner(sync_until_stopped, f"127.0.0.1:{server.port}", heartbeat_interval=0.2, poll_wait=0.3)
    loop_task = asyncio.create_task(runner.run())
    r = await client.enqueue_rollout({"marker": str(marker)})
    while (await client.get_rollout(r.rollout_id)).status == RolloutStatus.QUEUING:
        await asyncio.sleep(0.05)
    await client.cancel_rollout(r.rollout_id)
    cancelled_at = time.time()
    for _ in range(100):
        if marker.exists():
            break
        await asyncio.sleep(0.05)
    runner.stop()
    await asyncio.wait_for(loop_task, 10)
    assert marker.exists() and float(marker.read_text().split()[0]) - cancelled_at < 1.0


async def test_sigterm_lets_a_runner_finish_what_it_holds_and_exit(
    server: RunningServer, client: StoreClient
) -> None:
    target = f"127.0.0.1:{server.port}"
    ids = [r.rollout_id for r in await client.enqueue_rollouts([{"input": {"i": i}} for i in range(40)])]
    proc = await runner_process(
        target, "tests.runner_agents:sync_counter", "--concurrency", "2", "--poll-wait", "0.2"
    )
    while (await client.statistics()).rollouts_by_status.get("succeeded", 0) < 4:
        await asyncio.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()[-2000:]
    rollouts = [await client.get_rollout(rid) for rid in ids]
    statuses = {r.status for r in rollouts}
    assert statuses <= {RolloutStatus.SUCCEEDED, RolloutStatus.QUEUING}  # nothing left half-done
    assert RolloutStatus.QUEUING in statuses  # it stopped taking work
    assert "event=runner_stopped" in out.decode()


async def test_spans_cut_by_a_store_restart_arrive_exactly_once(server_process, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = tmp_path / "store.db"
    store = server_process("--db", str(db), "--port", str(port)).start()
    target = store.address
    async with StoreClient(target) as client:
        r = await client.start_rollout({"stream": "cut"})
        assert r.latest_attempt is not None
        aid = r.latest_attempt.attempt_id
    processor = install_tracing()
    streamer = processor.streamer_for(target)
    from opentelemetry import trace

    from lightning_grpc.tracing import AttemptContext, attempt_context

    processor.route(aid, streamer)
    tracer = trace.get_tracer("tests.cut")
    sent = 0

    async def emit(n: int) -> None:
        nonlocal sent
        with attempt_context(AttemptContext(r.rollout_id, aid)):
            for _ in range(n):
                with tracer.start_as_current_span("work") as span:
                    span.set_attribute("n", sent)
                sent += 1
                if sent % 50 == 0:
                    await asyncio.sleep(0.01)

    await emit(500)
    await asyncio.sleep(0.2)
    store.kill()  # SIGKILL while batches are in flight
    await emit(500)  # these queue up while the store is down
    store2 = server_process("--db", str(db), "--port", str(port)).start()
    await emit(500)
    assert await streamer.aflush(timeout=30)
    async with StoreClient(store2.address) as client:
        spans = await client.query_spans(r.rollout_id)
    values = sorted(s.attributes["n"] for s in spans)
    assert values == list(range(1500))  # every span, exactly once
    assert len({s.sequence_id for s in spans}) == 1500
    assert streamer.stats.reconnects >= 1 and streamer.stats.rejected == 0


async def test_a_ray_fleet_runs_a_batch_of_rollouts_to_completion(
    server: RunningServer, client: StoreClient
) -> None:
    pytest.importorskip("ray")
    from lightning_grpc.runner import RayFleet

    ids = [r.rollout_id for r in await client.enqueue_rollouts([{"input": {"i": i}} for i in range(24)])]
    spec = RunnerSpec(
        agent="tests.runner_agents:sync_counter",
        store=f"127.0.0.1:{server.port}",
        concurrency=4,
        options={"poll_wait": 0.5},
    )
    fleet = await asyncio.to_thread(RayFleet, spec, 2)
    try:
        done = await client.wait_for_rollouts(ids, timeout=120)
        await asyncio.to_thread(fleet.stop)
        counts = await asyncio.to_thread(fleet.wait, 60)
    finally:
        await asyncio.to_thread(fleet.shutdown)
    assert len(done) == 24 and {r.status for r in done} == {RolloutStatus.SUCCEEDED}
    assert sum(counts) == 24
    assert len(counts) == 2  # two actors ran (which one took which rollouts is up to the queue)
    for rid in ids[:3]:
        spans = await client.query_spans(rid)
        reward = [s for s in spans if s.name == semconv.SPAN_REWARD]
        assert semconv.read_primary_reward(reward[0].attributes) == (await client.get_rollout(rid)).input["i"]


class RecordingHook(Hook):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def on_rollout_start(self, rollout: Rollout) -> None:
        self.calls.append("rollout_start")

    def on_trace_start(self, rollout: Rollout) -> None:
        self.calls.append("trace_start")

    def on_trace_end(self, rollout: Rollout) -> None:
        self.calls.append("trace_end")

    async def on_rollout_end(self, rollout: Rollout, result: Any, error: BaseException | None) -> None:
        self.calls.append(f"rollout_end:{rollout.status}:{type(error).__name__ if error else ''}")


class StatefulAgent(LitAgent):
    def __init__(self) -> None:
        self.events: list[str] = []

    def setup(self) -> None:
        self.events.append("setup")

    def teardown(self) -> None:
        self.events.append("teardown")

    async def training_rollout(self, task: Any, resources: Any, rollout: Rollout) -> float:
        self.events.append("train")
        return 0.75

    async def validation_rollout(self, task: Any, resources: Any, rollout: Rollout) -> float:
        self.events.append("val")
        if task == "boom":
            raise RuntimeError("validation exploded")
        return {"acc": 0.5, "speed": 0.25}  # type: ignore[return-value]


async def test_step_mode_hooks_modes_and_agent_lifecycle(server: RunningServer, client: StoreClient) -> None:
    agent, hook = StatefulAgent(), RecordingHook()
    runner = Runner(agent, f"127.0.0.1:{server.port}", hooks=[hook])
    trained = await runner.step("q1", mode="train")
    validated = await runner.step("q2", mode="val")
    failed = await runner.step("boom", mode="val")
    await runner.close()
    assert agent.events == ["setup", "train", "val", "val", "teardown"]
    assert (
        trained.rollout.status == RolloutStatus.SUCCEEDED
        and validated.rollout.status == RolloutStatus.SUCCEEDED
    )
    assert failed.rollout.status == RolloutStatus.FAILED
    assert failed.rollout.status_message == "RuntimeError: validation exploded"
    assert hook.calls[:4] == ["rollout_start", "trace_start", "trace_end", "rollout_end:succeeded:"]
    assert hook.calls[-1] == "rollout_end:failed:RuntimeError"
    (reward,) = [
        s for s in await client.query_spans(validated.rollout.rollout_id) if s.name == semconv.SPAN_REWARD
    ]
    assert semconv.read_reward(reward.attributes) == {"acc": 0.5, "speed": 0.25}
    assert semconv.read_primary_reward(reward.attributes) == 0.5


async def test_resources_are_injected_by_name_and_kind_with_proxy_endpoints_routed(
    server: RunningServer, client: StoreClient
) -> None:
    seen: dict[str, Any] = {}

    @rollout
    def agent(task: Any, llm: Any, prompt_template: PromptTemplate, judge: Any, rollout: Rollout) -> float:
        seen.update(llm=llm, prompt=prompt_template.format(q=task), judge=judge, rollout=rollout)
        return 1.0

    res = {
        "main_llm": ProxyLLM("http://127.0.0.1:9000/v1", "tiny"),
        "judge": ProxyLLM("http://127.0.0.1:9001", "judge"),
        "prompt": PromptTemplate("Q: {q}"),
    }
    outcome = await Runner(agent, f"127.0.0.1:{server.port}").step("2+2", resources=res)
    assert outcome.rollout.status == RolloutStatus.SUCCEEDED
    attempt = outcome.rollout.latest_attempt
    assert attempt is not None
    rid, aid = outcome.rollout.rollout_id, attempt.attempt_id
    assert seen["llm"].endpoint == f"http://127.0.0.1:9000/rollout/{rid}/attempt/{aid}/v1"
    assert seen["judge"].endpoint == f"http://127.0.0.1:9001/rollout/{rid}/attempt/{aid}"
    assert seen["prompt"] == "Q: 2+2" and seen["rollout"].rollout_id == rid

    @rollout
    def needs_missing(task: Any, tokenizer: Any) -> float:
        return 0.0

    missing = await Runner(needs_missing, f"127.0.0.1:{server.port}").step("x")
    assert missing.rollout.status == RolloutStatus.FAILED and "tokenizer" in missing.rollout.status_message

    @rollout
    def ambiguous(task: Any, llm: Any) -> float:
        return 0.0

    two = {"a": ProxyLLM("http://a", "m"), "b": ProxyLLM("http://b", "m")}
    unclear = await Runner(ambiguous, f"127.0.0.1:{server.port}").step("x", resources=two)
    assert unclear.rollout.status == RolloutStatus.FAILED and "ambiguous" in unclear.rollout.status_message


async def test_emitters_write_what_the_conventions_read_back(
    server: RunningServer, client: StoreClient
) -> None:
    @operation
    def tokenize(text: str, lower: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    @operation(name="fetch")
    async def fetch(url: str) -> dict[str, Any]:
        return {"status": 200, "bytes": 12}

    @operation
    def explode() -> None:
        raise KeyError("nope")

    @operation("shout")  # the name given positionally
    def loud(text: str) -> str:
        return text.upper()

    @rollout
    async def agent(task: Any) -> None:
        tokenize("Hello big world")
        await fetch("http://x")
        with operation("compute") as op:
            op.set_output(loud("hi"))
        with operation(name="manual") as op:
            op.set_input("a", k=2)
            op.set_output([1.5, 2.5])
        with pytest.raises(KeyError):
            explode()
        emit_message("thinking")
        emit_object({"plan": ["a", "b"]})
        emit_object(b"\x00\xff")
        try:
            raise ValueError("bad tool")
        except ValueError as exc:
            emit_exception(exc)
        emit_annotation({"judge": {"score": 3, "notes": "ok"}}, tags=["eval", "v2"])
        dims = emit_reward({"correct": 1, "cost": 0.1 + 0.2}, primary="correct")
        assert dims == {"correct": 1.0, "cost": 0.1 + 0.2}

    outcome = await Runner(agent, f"127.0.0.1:{server.port}").step("task")
    assert outcome.rollout.status == RolloutStatus.SUCCEEDED, outcome.rollout.status_message
    named = spans_by_name(await client.query_spans(outcome.rollout.rollout_id))
    ops = {s.attributes[semconv.OPERATION_NAME]: s for s in named[semconv.SPAN_OPERATION]}
    assert ops["tokenize"].attributes["lightning.operation.input.text"] == "Hello big world"
    assert ops["tokenize"].attributes["lightning.operation.output"] == [5, 3, 5]
    assert ops["fetch"].attributes["lightning.operation.output.status"] == 200
    assert ops["manual"].attributes["lightning.operation.input.args.0"] == "a"
    assert ops["manual"].attributes["lightning.operation.output"] == [1.5, 2.5]
    assert ops["compute"].attributes["lightning.operation.output"] == "HI"
    assert ops["shout"].attributes["lightning.operation.input.text"] == "hi"
    assert ops["explode"].status_code == 2 and any(e.name == "exception" for e in ops["explode"].events)
    assert named[semconv.SPAN_MESSAGE][0].attributes[semconv.MESSAGE_BODY] == "thinking"
    objects = [semconv.read_object(s.attributes) for s in named[semconv.SPAN_OBJECT]]
    assert objects == [{"plan": ["a", "b"]}, b"\x00\xff"]
    (exc_span,) = named[semconv.SPAN_EXCEPTION]
    assert exc_span.attributes[semconv.EXCEPTION_TYPE] == "ValueError" and exc_span.status_code == 2
    (note,) = named[semconv.SPAN_ANNOTATION]
    assert note.attributes["judge.score"] == 3 and semconv.read_tags(note.attributes) == ["eval", "v2"]
    (reward,) = named[semconv.SPAN_REWARD]
    assert semconv.read_reward(reward.attributes) == {"correct": 1.0, "cost": 0.1 + 0.2}
    assert semconv.read_primary_reward(reward.attributes) == 1.0


def test_reward_conventions_reject_what_they_cannot_read_back() -> None:
    with pytest.raises(ValueError):
        semconv.reward_attributes({"a": 1.0, "b": 2.0})  # several dimensions need a primary
    with pytest.raises(ValueError):
        semconv.reward_attributes(float("nan"))
    with pytest.raises(TypeError):
        semconv.reward_attributes("high")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        semconv.reward_attributes({"a": 1.0}, primary="b")
    legacy = {"agentlightning.reward.0.name": "eff", "agentlightning.reward.0.value": 0.5}
    assert semconv.read_primary_reward(legacy) == 0.5
    links = semconv.link_attributes({"gen_ai.response.id": "chatcmpl-1"})
    assert semconv.read_links(links) == {"gen_ai.response.id": "chatcmpl-1"}


async def test_a_wrong_agent_reference_is_refused_in_one_line() -> None:
    proc = await runner_process("127.0.0.1:1", "no_such_module:agent")
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 2 and "Traceback" not in text
    assert text.strip().splitlines()[-1].startswith("error: cannot load agent 'no_such_module:agent'")


async def until_sigterm_is_handled(proc: asyncio.subprocess.Process, read: list[bytes]) -> None:
    """Wait until ``proc`` handles SIGTERM. On Linux its mask of caught signals says so as soon as the
    handler is installed; elsewhere the first runner's start line does (a fleet installs its handler
    before it starts any runner). Lines read from its output are added to ``read``."""
    status = Path(f"/proc/{proc.pid}/status")
    if status.exists():
        term = 1 << (signal.SIGTERM - 1)
        while proc.returncode is None:
            try:
                caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
            except FileNotFoundError:
                return  # it has exited: the test reads how
            if int(caught.split()[1], 16) & term:
                return
            await asyncio.sleep(0.01)
        return
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        read.append(line)
        if b"event=runner_started" in line:
            return


@pytest.mark.parametrize("moment", ["interpreter_starting", "handler_installed"])
async def test_sigterm_while_a_fleet_starts_stops_it_cleanly(
    server: RunningServer, client: StoreClient, moment: str
) -> None:
    proc = await runner_process(
        f"127.0.0.1:{server.port}",
        "tests.runner_agents:sync_counter",
        "--processes",
        "2",
        "--poll-wait",
        "0.2",
    )
    read: list[bytes] = []
    if moment == "interpreter_starting":
        await asyncio.sleep(0.3)  # most likely before the handler: either outcome below is right
    else:
        await asyncio.wait_for(until_sigterm_is_handled(proc, read), 60)
    proc.send_signal(signal.SIGTERM)
    rest, _ = await asyncio.wait_for(proc.communicate(), 60)
    out = b"".join(read) + rest
    if proc.returncode == -signal.SIGTERM:
        # The signal came while the interpreter was still starting, before it could handle it:
        # nothing had started, so nothing may be left behind.
        assert moment == "interpreter_starting" and "event=runner_started" not in out.decode()
        await asyncio.sleep(1.0)
        assert await client.query_workers() == []
    else:
        assert proc.returncode == 0, out.decode()[-2000:]


async def test_the_runner_command_runs_ray_actors_on_a_local_ray(
    server: RunningServer, client: StoreClient
) -> None:
    pytest.importorskip("ray")
    if server.store.backend.name != "sqlite":
        pytest.skip("one backend is enough for the Ray path of the command")
    ids = [r.rollout_id for r in await client.enqueue_rollouts([{"input": {"i": i}} for i in range(12)])]
    proc = await runner_process(
        f"127.0.0.1:{server.port}",
        "tests.runner_agents:sync_counter",
        "--ray",
        "--processes",
        "2",
        "--max-rollouts",
        "6",
        "--poll-wait",
        "0.3",
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, out.decode()[-3000:]
    done = await client.wait_for_rollouts(ids, timeout=5)
    assert len(done) == 12 and {r.status for r in done} == {RolloutStatus.SUCCEEDED}
    assert "event=ray_fleet_exit actors=2" in out.decode()


async def test_the_runner_heartbeats_its_worker_with_machine_stats(
    server: RunningServer, client: StoreClient
) -> None:
    runner = Runner(rollout(lambda task: 1.0), f"127.0.0.1:{server.port}", worker_id="stats-worker")
    outcome = await runner.step("x")
    await runner.close()
    assert outcome.rollout.status == RolloutStatus.SUCCEEDED
    worker = await client.get_worker_by_id("stats-worker")
    assert worker is not None and worker.last_heartbeat_time is not None
    stats = worker.heartbeat_stats
    assert stats["cpu_cores"] >= 1 and stats["memory_total_gib"] > 0 and "cpu_percent" in stats
    assert stats["pid"] > 0 and "completed_rollouts" in stats and "active_rollouts" in stats


async def test_a_runner_gives_up_at_start_up_when_its_store_cannot_be_reached() -> None:
    from lightning_grpc.errors import UnavailableError

    @rollout
    async def agent(task: Any) -> float:
        return 1.0

    runner = Runner(agent, "127.0.0.1:1", connect_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(UnavailableError, match=r"cannot reach the store at 127\.0\.0\.1:1 within 0\.5 s"):
        await runner.run()
    assert time.monotonic() - started < 10


async def test_an_agents_exception_is_stored_on_its_attempt_logged_once_and_counted_as_failed(
    server: RunningServer, client: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    def parse_answer(text: str) -> int:
        return int(text)

    @rollout
    def shaky(task: Any) -> float:
        if task["i"] % 2:
            return float(parse_answer("not a number"))
        return 1.0

    for i in range(4):
        await client.enqueue_rollout({"i": i})
    runner = Runner(shaky, f"127.0.0.1:{server.port}", concurrency=2, max_rollouts=4, poll_wait=0.2)
    with caplog.at_level("WARNING", logger="lightning_grpc.runner"):
        assert await runner.run() == 4
    assert (runner.succeeded, runner.failed, runner.stopped) == (2, 2, 0)
    failures = [r for r in caplog.records if "event=agent_failed" in r.getMessage()]
    assert len(failures) == 2 and all(r.exc_info for r in failures)  # once per failure, with its traceback
    failed = [r for r in (await client.list_rollouts()).items if str(r.status) == "failed"]
    assert len(failed) == 2
    (attempt,) = await client.query_attempts(failed[0].rollout_id)
    error = attempt.metadata[semconv.ATTEMPT_ERROR]
    assert error["type"] == "builtins.ValueError"
    assert error["message"] == "invalid literal for int() with base 10: 'not a number'"
    assert "in parse_answer" in error["traceback"] and error["traceback"].rstrip().endswith(error["message"])
    assert attempt.status_message == f"ValueError: {error['message']}"
    shown = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "lightning_grpc.cli.main",
            "rollout",
            failed[0].rollout_id,
            "--store",
            f"127.0.0.1:{server.port}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "error of attempt 1: builtins.ValueError: invalid literal" in shown.stdout
    assert "in parse_answer" in shown.stdout


async def test_one_rollout_is_one_trace_under_one_root_span_per_attempt(
    server: RunningServer, client: StoreClient
) -> None:
    @rollout
    async def agent(task: Any, rollout: Any) -> None:
        with operation("compute"):
            pass
        emit_reward(1.0)
        if rollout.latest_attempt.sequence_number == 1:
            raise RuntimeError("first try fails")

    queued = await client.enqueue_rollout(
        {"x": 1}, config=RolloutConfig(max_attempts=2, retry_on=(AttemptStatus.FAILED,))
    )
    runner = Runner(agent, f"127.0.0.1:{server.port}", max_rollouts=2, poll_wait=0.2)
    assert await runner.run() == 2
    spans = await client.query_spans(queued.rollout_id)
    trace_id = f"{semconv.rollout_trace_id(queued.rollout_id):032x}"
    assert {s.trace_id for s in spans} == {trace_id}  # both attempts, one trace
    roots = {s.attempt_id: s for s in spans if s.name == semconv.SPAN_ROLLOUT}
    assert len(roots) == 2 and all(not r.parent_span_id for r in roots.values())
    for s in spans:
        if s.name != semconv.SPAN_ROLLOUT:
            assert s.parent_span_id == roots[s.attempt_id].span_id, s.name
    first = min(roots.values(), key=lambda r: r.attributes[semconv.ATTEMPT_SEQUENCE_NUMBER])
    assert first.status_code == 2 and "first try fails" in first.status_message


async def test_the_spans_an_attempt_has_not_sent_by_its_end_are_stored_with_its_outcome(
    server: RunningServer, client: StoreClient
) -> None:
    """What an attempt's spans wait for when it ends goes with its outcome (CompleteAttempt's spans, one
    commit), succeeded or failed: no batch of their own, each span stored once, in the order it ended."""
    from opentelemetry import trace

    from lightning_grpc.client.spans import SpanStreamer

    target = f"127.0.0.1:{server.port}"
    processor = install_tracing()
    streamer = SpanStreamer(target, linger=60.0)  # nothing is cut into a batch unless a flush asks
    processor.streamers[target] = streamer

    @rollout
    async def agent(task: Any, rollout: Any) -> None:
        tracer = trace.get_tracer("tests.last_spans")
        for step in range(3):
            with tracer.start_as_current_span(f"step-{step}"):
                pass
        emit_reward(1.0)
        if task["fail"]:
            raise RuntimeError("this one fails")

    try:
        ok = await client.enqueue_rollout({"fail": False})
        failing = await client.enqueue_rollout({"fail": True})
        runner = Runner(agent, target, max_rollouts=2, poll_wait=0.2)
        assert await runner.run() == 2
        assert (runner.succeeded, runner.failed) == (1, 1)
        stored = 0
        for queued, status in ((ok, RolloutStatus.SUCCEEDED), (failing, RolloutStatus.FAILED)):
            assert (await client.get_rollout(queued.rollout_id)).status == status
            spans = sorted(await client.query_spans(queued.rollout_id), key=lambda s: s.sequence_id)
            names = [s.name for s in spans]
            assert names[:3] == ["step-0", "step-1", "step-2"] and names[-1] == semconv.SPAN_ROLLOUT
            assert semconv.SPAN_REWARD in names and len(set(s.span_id for s in spans)) == len(spans)
            stored += len(spans)
        stats = streamer.stats
        assert stats.taken == stats.submitted == stored and stats.acknowledged == 0
        assert streamer.shipper.pending == 0 and streamer.shipper.attempts_pending == 0
    finally:
        processor.streamers.pop(target, None)
        streamer.close()


def test_a_stop_before_the_runner_starts_is_kept(server_process: Any) -> None:
    """A SIGTERM that reaches a runner process before its loop runs calls stop() on a runner built outside
    any event loop: the runner must still stop as soon as it starts, not run on with the request lost."""
    server = server_process("--memory", "--port", "0", "--no-dashboard").start()
    runner = Runner(sync_counter, server.address, poll_wait=0.2)
    runner.stop()
    started = time.monotonic()
    assert asyncio.run(asyncio.wait_for(runner.run(), 20)) == 0
    assert time.monotonic() - started < 10


async def test_an_attempt_whose_spans_the_store_cannot_take_fails_rather_than_succeeds_without_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that keeps refusing an attempt's spans for now (its memory full): once ``spans_timeout`` has
    passed, the attempt is reported failed, saying why, and not succeeded without its reward span. The log
    says the spans were not acknowledged, not that the agent failed."""
    from opentelemetry import trace

    from lightning_grpc.server.app import ServerConfig, start_server
    from tests.helpers import fill_memory_until_refused

    running = await start_server(ServerConfig(port=0, max_memory_bytes=200_000))
    target = f"127.0.0.1:{running.port}"

    @rollout
    def big(task: Any) -> float:
        with trace.get_tracer("tests.big").start_as_current_span("big") as span:
            span.set_attribute("blob", "w" * 40_000)
        return 1.0

    try:
        async with StoreClient(target) as client:
            queued = await client.enqueue_rollout({"i": 0})
            filler = await client.start_rollout({"filler": True})
            assert filler.latest_attempt is not None
            await fill_memory_until_refused(client, filler.rollout_id, filler.latest_attempt.attempt_id)
            ended: list[Rollout] = []

            class Ends(Hook):
                def on_rollout_end(self, rollout: Rollout, result: Any, error: BaseException | None) -> None:
                    ended.append(rollout)

            runner = Runner(big, target, max_rollouts=1, poll_wait=0.2, spans_timeout=1.0, hooks=[Ends()])
            with caplog.at_level("WARNING", logger="lightning_grpc.runner"):
                assert await runner.run() == 1
            assert (runner.succeeded, runner.failed) == (0, 1)
            # as the store answered the report (a full in-memory store may evict the finished rollout next)
            [final] = ended
            assert final.rollout_id == queued.rollout_id and final.status == RolloutStatus.FAILED
            assert final.latest_attempt is not None and final.latest_attempt.status == AttemptStatus.FAILED
            message = final.latest_attempt.status_message
            assert "the store did not acknowledge this attempt's spans within 1 s" in message
            logged = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("event=spans_not_acknowledged") for m in logged), logged
            assert not any("event=agent_failed" in m for m in logged), logged
    finally:
        await running.stop()
