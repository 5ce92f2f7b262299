"""A store that outlives its server: PostgreSQL-backed servers on one database, one writer, standbys.

Every ``serve --postgres`` of one database takes the writer lease (an advisory lock) before it loads
anything; a second one waits on it as a standby, without serving. These tests run real servers on a real
PostgreSQL cluster and kill the writer with SIGKILL under load:

- ``test_a_standby_takes_over_a_killed_writer_and_loses_nothing``: span streams (unary and streamed),
  rollout cycles with long-polling dequeues and a watch are running over one multi-address target (both
  servers' addresses); the writer is killed, the standby takes over, and everything acknowledged is there
  once (the same ledger and checks as the SQLite kill -9 test), what was in flight is sent again without
  duplicates, and the watch, resumed from its last token on the new writer, sees every change once, in
  order. The killed server is started again as the next standby, several times over. The seconds each
  take-over left the clients without a writer are printed.
- ``test_a_runner_given_both_addresses_carries_on_across_a_take_over``: a real runner process given both
  addresses keeps running rollouts, with their spans, through the writer's death.
- ``test_a_writer_that_lost_its_lease_stops_writing``: a writer whose database session is ended while a
  standby waits loses the lease to it, refuses writes (NOT_THE_WRITER) and exits with one error line; a
  writer whose session is ended with no standby waiting takes its lease back and goes on.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.client.channel import channel_target, make_channel
from lightning_grpc.store.postgres import WRITER_LEASE
from lightning_grpc.types import RolloutStatus
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.store.test_durability import (
    CALL_TIMEOUT,
    Ledger,
    Traffic,
    list_all,
    resend_unanswered,
    verify,
    wait_for_traffic,
)

pytest.importorskip("psycopg")

ROOT = Path(__file__).resolve().parents[2]
SEED = 20_261_127
TAKE_OVERS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client_channel(target: str) -> grpc.aio.Channel:
    """A channel as the clients make theirs (how soon it looks again for a lost server included), without
    their retries: the test sees every failure."""
    return make_channel(ClientConfig(target=target, retry=None))


def serve_args(url: str, port: int) -> list[str]:
    return ["--postgres", url, "--port", str(port), "--grace", "2", "--log-level", "INFO"]


async def writer(server_process: type[ServerProcess], url: str, port: int) -> ServerProcess:
    return await asyncio.to_thread(lambda: server_process(*serve_args(url, port)).start())


async def standby(server_process: type[ServerProcess], url: str, port: int) -> ServerProcess:
    """A server that found the lease taken: it waits, logging who holds it, and serves nothing yet."""
    proc = server_process(*serve_args(url, port)).launch()
    line = await asyncio.to_thread(proc.wait_for, "event=postgres_standby")
    assert "waiting for the writer lease" in line and "writer='lightning-grpc store" in line, line
    with pytest.raises(OSError):  # not listening: clients' channels pass it by
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    return proc


async def first_write_after(target: str, rollout_id: str, since: float) -> float:
    """Seconds from ``since`` until a write through ``target`` is acknowledged (polled every 20 ms, on a
    channel made as the clients make theirs)."""
    async with client_channel(target) as channel:
        stub = pb_grpc.StoreServiceStub(channel)
        request = pb.EnqueueRolloutsRequest(rollouts=[pb.RolloutSpec(rollout_id=rollout_id)])
        while True:
            try:
                await stub.EnqueueRollouts(request, timeout=2)
                return time.monotonic() - since
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
                assert time.monotonic() - since < 30, "no writer 30 s after the kill"
                await asyncio.sleep(0.02)


def logged_at(line: str) -> float:
    """The time a log line was written (its leading ``YYYY-mm-dd HH:MM:SS,mmm``, local time)."""
    stamp = " ".join(line.split()[:2])
    return (
        time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(stamp.split(",")[1]) / 1000
    )


class Watch:
    """A WatchRollouts stream that resumes from its last token whenever its server goes away."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.revisions: list[int] = []
        self.rollouts: set[str] = set()
        self.resumed = 0
        self.token = ""
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.StoreServiceStub(channel)
            while not self.stop.is_set():
                request = pb.WatchRolloutsRequest(resume_token=self.token)
                request.progress_interval.FromMilliseconds(200)
                try:
                    async for message in stub.WatchRollouts(request, wait_for_ready=True):
                        if message.HasField("rollout"):
                            self.revisions.append(message.revision)
                            self.rollouts.add(message.rollout.rollout_id)
                        self.token = message.resume_token
                        if self.stop.is_set():
                            return
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    self.resumed += 1
                    await asyncio.sleep(0.05)


@pytest.mark.timeout(240)
async def test_a_standby_takes_over_a_killed_writer_and_loses_nothing(
    postgres_url: str, server_process: type[ServerProcess]
) -> None:
    rng = random.Random(SEED)
    ports = [free_port(), free_port()]
    target = channel_target(",".join(f"127.0.0.1:{p}" for p in ports))
    assert target == f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    current = await writer(server_process, postgres_url, ports[0])
    waiting = await standby(server_process, postgres_url, ports[1])
    ledger = Ledger()
    watch = Watch(target)
    watching = asyncio.create_task(watch.run())
    without_writer: list[float] = []  # from the kill to the first write acknowledged through the target
    serving: list[float] = []  # from the kill to the standby serving (its log)
    for cycle in range(TAKE_OVERS):
        traffic = Traffic(target, ledger, rng, cycle, client_channel(target))
        tasks = [asyncio.create_task(traffic.enqueuer(n)) for n in range(2)]
        tasks += [asyncio.create_task(traffic.worker(n, use_stream=n % 2 == 0)) for n in range(4)]
        await wait_for_traffic(traffic, 30)
        await asyncio.sleep(rng.uniform(0.05, 0.8))
        traffic.killed = True
        ledger.in_flight_at_kills.append(traffic.in_flight)
        killed_at, killed_wall = time.monotonic(), time.time()
        await asyncio.to_thread(current.kill)
        traffic.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await traffic.close()
        assert not traffic.failures, "\n".join(traffic.failures)
        assert current.proc is not None and current.proc.returncode == -signal.SIGKILL

        probe = f"probe-{cycle}"
        without_writer.append(await first_write_after(target, probe, killed_at))
        ledger.rollouts[probe] = pb.RolloutSpec(rollout_id=probe)
        started = await asyncio.to_thread(waiting.wait_for, "event=server_started")
        assert any("event=postgres_writer_lease" in line for line in waiting.lines)
        serving.append(logged_at(started) - killed_wall)
        async with client_channel(target) as channel:
            stub = pb_grpc.StoreServiceStub(channel)
            await verify(stub, ledger, "postgres")
            await resend_unanswered(stub, ledger)
            await verify(stub, ledger, "postgres")
        old_port = ports[0] if current.port == ports[0] else ports[1]
        current, waiting = waiting, await standby(server_process, postgres_url, old_port)

    async with client_channel(target) as channel:
        stub = pb_grpc.StoreServiceStub(channel)
        while (
            await stub.DequeueRollouts(pb.DequeueRolloutsRequest(max_rollouts=10_000), timeout=CALL_TIMEOUT)
        ).rollouts:
            pass
        totals = await verify(stub, ledger, "postgres")
        rollouts = await list_all(stub, "ListRollouts", pb.ListRolloutsRequest(page_size=1000), "rollouts")
        assert all(r.attempt_count > 0 for r in rollouts if r.rollout_id in ledger.rollouts)
    # The watch, resumed on each new writer, saw every acknowledged rollout, and every change once, in order.
    deadline = time.monotonic() + 20
    while not set(ledger.rollouts) <= watch.rollouts and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    watch.stop.set()
    await asyncio.wait_for(watching, 10)
    assert set(ledger.rollouts) <= watch.rollouts, sorted(set(ledger.rollouts) - watch.rollouts)[:5]
    assert watch.revisions == sorted(set(watch.revisions)), "a change seen twice or out of order"
    assert watch.resumed >= TAKE_OVERS
    assert await asyncio.to_thread(current.terminate) == 0
    assert await asyncio.to_thread(waiting.terminate) == 0  # a standby stops cleanly too
    assert sum(ledger.in_flight_at_kills) > 0, "no kill hit a request in flight"
    assert sum(ledger.resent.values()) > 0, "nothing was in flight at any kill"
    print(
        f"\nwriter kill -9 x{TAKE_OVERS}: seconds without a writer {[round(s, 3) for s in without_writer]} "
        f"(the standby serving after {[round(s, 3) for s in serving]}), "
        f"{totals}, in flight at the kills {ledger.in_flight_at_kills}, resent {dict(ledger.resent)}, "
        f"of which already done {dict(ledger.already_done)}, watch resumed {watch.resumed} times over "
        f"{len(watch.revisions)} changes"
    )
    assert totals["spans"] >= 100 and totals["rollouts"] >= 50, totals


@pytest.mark.timeout(180)
async def test_a_runner_given_both_addresses_carries_on_across_a_take_over(
    postgres_url: str, server_process: type[ServerProcess]
) -> None:
    ports = [free_port(), free_port()]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    first = await writer(server_process, postgres_url, ports[0])
    second = await standby(server_process, postgres_url, ports[1])
    runner = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lightning_grpc.cli.main",
        "runner",
        "tests.runner_agents:TracedAgent",
        "--store",
        addresses,
        "--concurrency",
        "8",
        "--max-rollouts",
        "80",
        "--poll-wait",
        "0.5",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        async with StoreClient(addresses) as client:
            ids = [
                r.rollout_id for r in await client.enqueue_rollouts([{"input": {"i": i}} for i in range(80)])
            ]
            deadline = time.monotonic() + 60
            while (await client.statistics()).rollouts_by_status.get("succeeded", 0) < 20:
                assert time.monotonic() < deadline, "the runner never got going"
                await asyncio.sleep(0.1)
            await asyncio.to_thread(first.kill)
            await asyncio.to_thread(second.wait_for, "event=server_started")
            done = await client.wait_for_rollouts(ids, timeout=90)
            assert len(done) == 80 and {r.status for r in done} == {RolloutStatus.SUCCEEDED}
            for rid in ids:
                spans = await client.query_spans(rid)
                latest = [s for s in spans if s.attempt_id == spans[-1].attempt_id]
                names = collections.Counter(s.name for s in latest)
                assert names["agent.step"] == 1 and names["lightning.reward"] == 1, (rid, names)
                assert len({(s.attempt_id, s.span_id) for s in spans}) == len(spans), "a span stored twice"
        out, _ = await asyncio.wait_for(runner.communicate(), 60)
        assert runner.returncode == 0, out.decode()[-3000:]
    finally:
        if runner.returncode is None:
            runner.kill()
            await runner.wait()
    assert await asyncio.to_thread(second.terminate) == 0


@pytest.mark.timeout(120)
async def test_a_writer_that_lost_its_lease_stops_writing(
    postgres_url: str, server_process: type[ServerProcess]
) -> None:
    import psycopg

    def end_lease_session() -> int:
        """End the database session that holds the writer lease (as a cut network would); returns how many."""
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            ended = conn.execute(
                "SELECT pg_terminate_backend(l.pid) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted"
                " AND l.classid::bigint = %s AND l.objid::bigint = %s"
                " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                (WRITER_LEASE >> 32, WRITER_LEASE & 0xFFFF_FFFF),
            ).fetchall()
        return len(ended)

    # No standby: the writer takes its lease back on a new connection and goes on.
    alone = await writer(server_process, postgres_url, free_port())
    async with StoreClient(alone.address) as client:
        await client.enqueue_rollouts([{"input": {"i": 0}}])
        assert await asyncio.to_thread(end_lease_session) == 1
        deadline = time.monotonic() + 15  # its idle check finds the connection gone and replaces it
        while not any("event=postgres_writer_lease_kept" in line for line in alone.lines):
            assert time.monotonic() < deadline, "".join(alone.lines[-20:])
            await asyncio.sleep(0.1)
        await client.enqueue_rollouts([{"input": {"i": 1}}])
        assert len(await client.query_rollouts()) == 2
    assert await asyncio.to_thread(alone.terminate) == 0

    # A standby waiting: it gets the lease the moment the session ends; the old writer stops.
    first = await writer(server_process, postgres_url, free_port())
    second = await standby(server_process, postgres_url, free_port())
    assert await asyncio.to_thread(end_lease_session) == 1
    await asyncio.to_thread(second.wait_for, "event=server_started")
    assert first.proc is not None
    code = await asyncio.to_thread(first.proc.wait, 30)
    output = "".join(first.lines) + (first.proc.stdout.read() if first.proc.stdout else "")
    assert code == 2, output[-3000:]
    assert "event=postgres_writer_lease_lost" in output
    assert "error: NOT_THE_WRITER: another server took over the store's database" in output
    assert "Traceback" not in output
    async with StoreClient(second.address) as client:
        assert len(await client.query_rollouts()) == 2
    assert await asyncio.to_thread(second.terminate) == 0


def lease_session(url: str) -> tuple[str, int] | None:
    """(name, process id) of the database session holding the writer lease."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT a.application_name, a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = %s AND l.objid::bigint = %s",
            (WRITER_LEASE >> 32, WRITER_LEASE & 0xFFFF_FFFF),
        ).fetchone()
    return (str(row[0]), int(row[1])) if row else None


@pytest.mark.timeout(120)
async def test_a_writer_takes_its_lease_back_from_its_own_cut_off_session(
    postgres_url: str, server_process: type[ServerProcess]
) -> None:
    """The network cut the writer's session, and PostgreSQL has not ended it yet: the lease is still held in
    the writer's name. The writer, on a new connection, ends that session and goes on writing, rather than
    losing the lease to itself. (A session under the writer's name that takes the lease the moment the real
    one ends plays the cut-off session.)"""
    import psycopg

    server = await writer(server_process, postgres_url, free_port())
    holder = await asyncio.to_thread(lease_session, postgres_url)
    assert holder is not None and holder[0].startswith("lightning-grpc store ")
    name, pid = holder
    ghost = await asyncio.to_thread(psycopg.connect, postgres_url, autocommit=True, application_name=name)
    try:
        waiting = asyncio.create_task(
            asyncio.to_thread(ghost.execute, "SELECT pg_advisory_lock(%s)", (WRITER_LEASE,))
        )
        await asyncio.sleep(0.3)
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await asyncio.wait_for(waiting, 10)  # the ghost holds the lease now, under the writer's name
        deadline = time.monotonic() + 15
        while not any("event=postgres_writer_lease_kept" in line for line in server.lines):
            assert time.monotonic() < deadline, "".join(server.lines[-20:])
            await asyncio.sleep(0.1)
        assert ghost.broken or ghost.closed or not await asyncio.to_thread(_alive, ghost)
    finally:
        ghost.close()
    async with StoreClient(server.address) as client:
        await client.enqueue_rollouts([{"input": {"i": 1}}])
        assert len(await client.query_rollouts()) == 1
    after = await asyncio.to_thread(lease_session, postgres_url)
    assert after is not None and after[0] == name and after[1] != pid
    assert await asyncio.to_thread(server.terminate) == 0


def _alive(conn: Any) -> bool:
    try:
        conn.execute("SELECT 1")
    except Exception:
        return False
    return True


@pytest.mark.timeout(150)
async def test_a_standby_waits_through_a_database_restart(
    own_postgres: Any, server_process: type[ServerProcess]
) -> None:
    """PostgreSQL restarts while a writer serves and a standby waits: the standby reconnects and waits again
    (it does not exit), exactly one server writes afterwards, and nothing acknowledged is lost."""
    url = own_postgres.create_database("lightning")
    ports = [free_port(), free_port()]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    first = await writer(server_process, url, ports[0])
    second = await standby(server_process, url, ports[1])
    async with StoreClient(addresses) as client:
        before = [
            r.rollout_id for r in await client.enqueue_rollouts([{"input": {"i": i}} for i in range(5)])
        ]
    await asyncio.to_thread(own_postgres.stop, "fast")
    await asyncio.sleep(1.0)
    await asyncio.to_thread(own_postgres.start)
    deadline = time.monotonic() + 60
    async with StoreClient(addresses) as client:
        while True:
            try:
                after = await client.enqueue_rollouts([{"rollout_id": "after-restart", "input": {"i": 9}}])
                break
            except Exception as exc:  # UNAVAILABLE while the writer reconnects
                assert time.monotonic() < deadline, f"no writer a minute after the restart: {exc}"
                await asyncio.sleep(0.2)
        assert after[0].rollout_id == "after-restart"
        ids = {r.rollout_id for r in await client.query_rollouts()}
    assert set(before) | {"after-restart"} <= ids
    assert second.proc is not None and first.proc is not None
    standby_alive = second.proc.poll() is None
    writer_alive = first.proc.poll() is None
    print(
        f"\nafter the database restart the {'first writer kept' if writer_alive else 'standby took'} the lease"
    )
    assert standby_alive, "".join(second.lines[-20:])
    if writer_alive:  # the writer took its lease back: the standby still waits, having reconnected
        output = await asyncio.to_thread(_lines_until, second, "event=postgres_standby_reconnecting")
        assert "event=postgres_standby_reconnecting" in output
        assert await asyncio.to_thread(first.terminate) == 0
    else:  # the standby got the lease first: the writer stopped, saying why
        assert first.proc.returncode == 2
    assert await asyncio.to_thread(second.terminate) == 0


def _lines_until(proc: ServerProcess, event: str) -> str:
    if proc._drainer is None:  # still a standby: read its output so far
        try:
            return proc.wait_for(event, timeout=10)
        except RuntimeError:
            return "".join(proc.lines)
    return "".join(proc.lines)
