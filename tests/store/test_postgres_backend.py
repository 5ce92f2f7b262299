"""The PostgreSQL backend on a real PostgreSQL server: schema migrations, restart durability, span queries
(checked against the in-memory backend), ``serve --postgres``, and a database that goes down and comes back.

The store's behaviour suite runs on PostgreSQL too (tests/store/test_store_semantics.py); this file covers
what only a database server has. Skipped, with the reason, where no PostgreSQL server can be started.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest

from lightning_grpc.client import StoreClient
from lightning_grpc.errors import UnavailableError
from lightning_grpc.server.app import ServerConfig, start_server
from lightning_grpc.store.backend import MemoryBackend, SpanQuery
from lightning_grpc.store.state import SpanRecord, Txn
from lightning_grpc.types import PromptTemplate, RolloutStatus
from tests.conftest import ServerProcess
from tests.helpers import make_spans
from tests.store import postgres_server

pytestmark = pytest.mark.skipif(
    bool(postgres_server.why_unavailable()), reason=postgres_server.why_unavailable()
)


async def test_migrations_create_the_schema_once_and_record_each_version(postgres_url: str) -> None:
    import psycopg

    from lightning_grpc.store.postgres import MIGRATIONS, PostgresBackend, migrate

    backend = PostgresBackend(postgres_url)
    state = await backend.open()
    await backend.close()
    again = PostgresBackend(postgres_url)
    assert (await again.open()).store_id == state.store_id  # the same store, not a new one
    await again.close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        recorded = conn.execute("SELECT version, name FROM schema_migrations ORDER BY version").fetchall()
        assert recorded == [(v, name) for v, name, _ in MIGRATIONS]
        assert migrate(conn) == []  # nothing left to apply
        tables = {
            r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        }
    assert {"meta", "rollouts", "attempts", "spans", "workers", "resources", "changes"} <= tables


async def test_everything_acknowledged_is_there_after_a_restart(postgres_url: str) -> None:
    config = ServerConfig(port=0, postgres=postgres_url, grace=1.0)
    running = await start_server(config)
    client = StoreClient(running.address, retry=None)
    try:
        resources = await client.add_resources({"prompt": PromptTemplate("hi {x}", "f-string")})
        enqueued = await client.enqueue_rollouts([{"input": {"i": i}} for i in range(5)])
        [claimed] = await client.dequeue_rollouts(worker_id="w1")
        assert claimed.latest_attempt is not None
        rid, aid = claimed.rollout_id, claimed.latest_attempt.attempt_id
        sequence_ids = (await client.add_spans(make_spans(7), rollout_id=rid, attempt_id=aid)).sequence_ids
        await client.complete_attempt(rid, aid, "succeeded")
        await client.cancel_rollout(enqueued[-1].rollout_id, "not needed")
        before = await client.statistics()
        spans_before = await client.query_spans(rid)
        store_id = running.store.store_id
    finally:
        await client.close()
        await running.stop()

    again = await start_server(config)
    client = StoreClient(again.address, retry=None)
    try:
        assert again.store.store_id == store_id
        after = await client.statistics()
        assert after.backend == "postgres" and after.storage_bytes > 0
        assert (after.total_rollouts, after.total_attempts, after.total_spans) == (
            before.total_rollouts,
            before.total_attempts,
            before.total_spans,
        )
        assert after.rollouts_by_status == before.rollouts_by_status
        done = await client.get_rollout(rid)
        assert done.status == RolloutStatus.SUCCEEDED and done.latest_attempt is not None
        assert done.latest_attempt.attempt_id == aid and done.input == claimed.input
        assert (await client.get_rollout(enqueued[-1].rollout_id)).status == RolloutStatus.CANCELLED
        spans = await client.query_spans(rid)
        assert [s.sequence_id for s in spans] == sequence_ids
        assert [(s.span_id, s.name, s.attributes) for s in spans] == [
            (s.span_id, s.name, s.attributes) for s in spans_before
        ]
        assert (await client.get_latest_resources()) == resources
        # the queue kept its order, and the next sequence id continues where it was
        [nxt] = await client.dequeue_rollouts(worker_id="w2")
        assert nxt.rollout_id == enqueued[1].rollout_id
        workers = {w.worker_id for w in await client.query_workers()}
        assert {"w1", "w2"} <= workers
    finally:
        await client.close()
        await again.stop()


def _records(n: int) -> list[SpanRecord]:
    rnd = random.Random(7)
    out = []
    for i in range(n):
        attempt_no = 1 + i % 3
        name = rnd.choice(["llm.call", "tool.call", "reward", "agent.step", "llm.stream"])
        out.append(
            SpanRecord(
                rollout_id=rnd.choice(["ro-a", "ro-b"]),
                attempt_id=f"at-{attempt_no}",
                span_id=f"{i:016x}",
                trace_id=rnd.choice(["a" * 32, "b" * 32]),
                parent_span_id=rnd.choice(["", f"{max(0, i - 1):016x}"]),
                name=name,
                start_time_unix_nano=i * 1000,
                # beyond int64 once: clamped in the column
                end_time_unix_nano=2**64 - 1 if i == 5 else i * 1000 + 1,
                body=bytes([i % 256]) * (i % 17),
                sequence_id=1000 - i if i % 4 == 0 else i + 1,  # some submitted out of order
                attempt_no=attempt_no,
            )
        )
    return out


async def test_span_queries_answer_what_the_in_memory_backend_answers(postgres_url: str) -> None:
    from lightning_grpc.store.postgres import PostgresBackend

    records = _records(300)
    memory, backend = MemoryBackend(), PostgresBackend(postgres_url)
    await backend.open()
    try:
        for start in range(0, len(records), 50):  # several commits
            chunk = records[start : start + 50]
            memory.submit(Txn(spans=chunk))
            fut = backend.submit(Txn(spans=chunk))
            await fut
        queries = [
            SpanQuery("ro-a"),
            SpanQuery("ro-b", attempt_no=2),
            SpanQuery("ro-a", after=(1, 500), limit=17),
            SpanQuery("ro-a", descending=True, after=(2**31, 2**62), limit=25),
            SpanQuery("ro-b", descending=True, after=(2, 100)),
            SpanQuery("ro-a", trace_id="a" * 32),
            SpanQuery("ro-b", name="reward"),
            SpanQuery("ro-a", name_contains="llm"),
            SpanQuery("ro-b", parent_span_id=f"{10:016x}"),
            SpanQuery("ro-a", span_id=f"{4:016x}"),
            SpanQuery("ro-a", attempt_no=3, name_contains="call", limit=3),
            SpanQuery("ro-none"),
        ]
        for q in queries:
            want = [(r.attempt_no, r.sequence_id, r.span_id, r.body) for r in await memory.query_spans(q)]
            got = await backend.query_spans(q)
            assert [(r.attempt_no, r.sequence_id, r.span_id, r.body) for r in got] == want, q
            assert await backend.count_spans(q) == await memory.count_spans(q), q
        got_all = {r.span_id: r for r in await backend.query_spans(SpanQuery("ro-a", limit=10_000))}
        for r in records:
            if r.rollout_id == "ro-a":
                stored = got_all[r.span_id]
                assert (stored.trace_id, stored.parent_span_id, stored.name, stored.attempt_id) == (
                    r.trace_id,
                    r.parent_span_id,
                    r.name,
                    r.attempt_id,
                )
                assert stored.end_time_unix_nano == min(r.end_time_unix_nano, 2**63 - 1)
        for attempt_no in (1, 2, 3):
            assert backend.load_span_ids("ro-b", attempt_no) == memory.load_span_ids("ro-b", attempt_no)
        # a batch written twice (as after a connection cut during its COMMIT) stores each span once
        await backend.submit(Txn(spans=records[:50]))
        assert await backend.count_spans(SpanQuery("ro-a")) == await memory.count_spans(SpanQuery("ro-a"))
        # deleting a rollout deletes its spans
        await backend.submit(Txn(deleted_rollouts=["ro-b"]))
        assert await backend.query_spans(SpanQuery("ro-b")) == []
        assert await backend.count_spans(SpanQuery("ro-a")) > 0
    finally:
        await backend.close()


async def test_an_unreachable_database_at_start_is_a_typed_error_naming_it() -> None:
    from lightning_grpc.store.postgres import PostgresBackend

    port = postgres_server._free_port()  # nothing listens there
    backend = PostgresBackend(f"postgresql://someone:secret@127.0.0.1:{port}/lightning")
    with pytest.raises(UnavailableError) as err:
        await backend.open()
    assert err.value.reason == "DATABASE_UNAVAILABLE" and err.value.transient
    assert f"PostgreSQL database lightning at 127.0.0.1:{port}" in err.value.message
    assert "secret" not in err.value.message


def test_serve_postgres_stores_in_the_database(
    postgres_url: str, server_process: type[ServerProcess]
) -> None:
    async def scenario(address: str) -> tuple[str, int]:
        client = StoreClient(address, retry=None)
        try:
            await client.enqueue_rollouts([{"input": 1}, {"input": 2}])
            stats = await client.statistics()
            return stats.backend, stats.total_rollouts
        finally:
            await client.close()

    server = server_process("--port", "0", "--no-dashboard", "--postgres", postgres_url).start()
    assert asyncio.run(scenario(server.address)) == ("postgres", 2)
    assert server.terminate() == 0
    again = server_process("--port", "0", "--no-dashboard", "--postgres", postgres_url).start()
    assert asyncio.run(scenario(again.address)) == ("postgres", 4)  # the first two were kept
    assert again.terminate() == 0


# ---------------------------------------------------------------------- the database goes down


async def _until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert condition(), "timed out"


async def test_a_database_down_refuses_writes_loses_nothing_acknowledged_and_recovers(
    own_postgres: postgres_server.PostgresServer,
) -> None:
    """PostgreSQL stops: the write caught in the failing commit is answered UNAVAILABLE (DATABASE_UNAVAILABLE,
    retryable) and held, new writes are refused the same way, reads that would show unstored writes too; once
    PostgreSQL is back the held write is stored, writes succeed without a restart of the Store, and every
    acknowledged write is still there (a new Store on the same database finds it)."""
    from lightning_grpc.store.postgres import PostgresBackend

    url = own_postgres.create_database("lightning")
    config = ServerConfig(port=0, postgres=url, grace=1.0)
    running = await start_server(config)
    backend = running.store.backend
    assert isinstance(backend, PostgresBackend)
    backend.probe_interval = 3600  # no idle check: the first write of the outage is caught in its commit
    client = StoreClient(running.address, retry=None, timeout=10)
    try:
        acknowledged = [
            r.rollout_id for r in await client.enqueue_rollouts([{"input": i} for i in range(10)])
        ]
        [claimed] = await client.dequeue_rollouts(worker_id="w")
        assert claimed.latest_attempt is not None
        rid, aid = claimed.rollout_id, claimed.latest_attempt.attempt_id
        await client.add_spans(make_spans(10), rollout_id=rid, attempt_id=aid)

        own_postgres.stop("immediate")  # as a crash of the database server
        with pytest.raises(UnavailableError) as held:
            await client.add_spans(make_spans(5), rollout_id=rid, attempt_id=aid)
        assert held.value.reason == "DATABASE_UNAVAILABLE" and held.value.transient
        assert "PostgreSQL database lightning at 127.0.0.1" in held.value.message
        assert backend.unavailable
        for write in (
            lambda: client.enqueue_rollouts([{"input": "more"}]),
            lambda: client.heartbeat_attempt(rid, aid),
            lambda: client.add_spans(make_spans(1), rollout_id=rid, attempt_id=aid),
            lambda: client.complete_attempt(rid, aid, "succeeded"),
        ):
            with pytest.raises(UnavailableError) as refused:
                await write()
            assert refused.value.reason == "DATABASE_UNAVAILABLE"
            assert "PostgreSQL database lightning" in refused.value.message
        with pytest.raises(UnavailableError) as unread:
            await client.statistics()  # would show the held write, which is not stored yet
        assert unread.value.reason == "DATABASE_UNAVAILABLE"
        assert running.store._broken is None  # an outage is not a broken store

        own_postgres.start()
        await _until(lambda: not backend.unavailable)
        stats = await client.statistics()
        assert stats.total_spans == 15  # the held batch was written, once
        more = await client.enqueue_rollouts([{"input": "after"}])
        await client.complete_attempt(rid, aid, "succeeded")
    finally:
        await client.close()
        await running.stop()

    again = await start_server(config)
    client = StoreClient(again.address, retry=None)
    try:
        found = {r.rollout_id for r in await client.query_rollouts()}
        assert set(acknowledged) <= found and more[0].rollout_id in found
        assert len(await client.query_spans(rid)) == 15
        assert (await client.get_rollout(rid)).status == RolloutStatus.SUCCEEDED
    finally:
        await client.close()
        await again.stop()


async def test_an_outage_while_idle_is_seen_before_any_write(
    own_postgres: postgres_server.PostgresServer,
) -> None:
    """With nothing to write, the backend still notices the database go and come back (its probe), so the
    first write of an outage is refused outright rather than caught in a failing commit."""
    from lightning_grpc.store.postgres import PostgresBackend

    url = own_postgres.create_database("idle")
    backend = PostgresBackend(url, probe_interval=0.2)
    await backend.open()
    try:
        own_postgres.stop("fast")
        await _until(lambda: bool(backend.unavailable))
        assert "PostgreSQL database idle" in backend.unavailable
        own_postgres.start()
        await _until(lambda: not backend.unavailable)
        await backend.submit(Txn(meta={"checked": "yes"}))  # and it writes again, on a new connection
    finally:
        await backend.close()


async def test_an_outage_does_not_count_against_a_running_attempt(
    own_postgres: postgres_server.PostgresServer,
) -> None:
    """While the database is out of reach the attempt's heartbeats are refused, so its silence then is
    excused: no deadline fires during the outage, and the watchdog works again once the database is back."""
    from lightning_grpc.store.postgres import PostgresBackend
    from lightning_grpc.types import RolloutConfig

    url = own_postgres.create_database("outage")
    running = await start_server(ServerConfig(port=0, postgres=url, grace=1.0))
    backend = running.store.backend
    assert isinstance(backend, PostgresBackend)
    backend.probe_interval = 0.2  # the outage is seen while nothing is written
    client = StoreClient(running.address, retry=None, timeout=10)
    try:
        await client.enqueue_rollout({"x": 1}, config=RolloutConfig(unresponsive_timeout=1.5))
        claimed = await client.dequeue_rollout(worker_id="w")
        assert claimed is not None and claimed.latest_attempt is not None
        own_postgres.stop("fast")
        await _until(lambda: bool(backend.unavailable))
        await asyncio.sleep(3.0)  # twice the attempt's allowed silence
        own_postgres.start()
        await _until(lambda: not backend.unavailable)
        now = await client.get_rollout(claimed.rollout_id)
        assert now.latest_attempt is not None and now.latest_attempt.status.is_active, now
        [done] = await client.wait_for_rollouts([claimed.rollout_id], timeout=10)
        assert done.latest_attempt is not None and done.latest_attempt.status.name == "UNRESPONSIVE"
    finally:
        await client.close()
        await running.stop()
