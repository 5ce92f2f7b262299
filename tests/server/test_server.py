"""The server around the store: health, reflection, auth, TLS, limits, errors on the wire, restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from lightning_grpc import semconv
from lightning_grpc.access import Credentials
from lightning_grpc.client import ClientConfig, RetryConfig, StoreClient, SyncStoreClient, TlsConfig
from lightning_grpc.errors import ERROR_DOMAIN, UnauthenticatedError, UnavailableError
from lightning_grpc.runner import Runner, rollout
from lightning_grpc.server.app import RunningServer, ServerConfig, TlsFiles, start_server
from lightning_grpc.tracing import emit_reward
from lightning_grpc.types import RolloutConfig, RolloutStatus
from lightning_grpc.v1 import store_service_pb2 as pb
from tests.conftest import every_store_backend  # noqa: F401  (runs on PostgreSQL too)
from tests.helpers import make_span, make_spans


async def health_status(target: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(resp.status)


async def test_health_is_serving_overall_and_per_service_and_not_serving_while_draining(
    server: RunningServer,
) -> None:
    target = f"127.0.0.1:{server.port}"
    assert await health_status(target) == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(target, "lightning.v1.StoreService") == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="nope"), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await server.health.enter_graceful_shutdown()
        second = await watch.read()
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


async def test_reflection_lists_the_services(server: RunningServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def requests():  # type: ignore[no-untyped-def]
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for resp in stub.ServerReflectionInfo(requests()):
            names = {s.name for s in resp.list_services_response.service}
            break
    assert {"lightning.v1.StoreService", "grpc.health.v1.Health"} <= names


async def test_errors_carry_a_status_with_one_error_info_and_no_traceback(client: StoreClient) -> None:
    stub = client.stub
    cases = [
        (stub.GetRollout(pb.GetRolloutRequest(rollout_id="ro-missing")), "NOT_FOUND", "ROLLOUT_NOT_FOUND"),
        (stub.GetRollout(pb.GetRolloutRequest()), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
        (stub.ListRollouts(pb.ListRolloutsRequest(page_size=-5)), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    ]
    for call, code, reason in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code().name == code
        status = rpc_status.from_call(err.value)
        assert status is not None and len(status.details) == 1
        info = error_details_pb2.ErrorInfo()
        status.details[0].Unpack(info)
        assert info.domain == ERROR_DOMAIN and info.reason == reason
        assert "Traceback" not in status.message
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListRollouts(pb.ListRolloutsRequest(page_size=-5))
    assert "page_size" in err.value.details()


async def test_bearer_token_guards_everything_but_health_and_reflection(tmp_path: Path) -> None:
    running = await start_server(ServerConfig(port=0, token="s3cret"))
    target = f"127.0.0.1:{running.port}"
    try:
        async with StoreClient(target) as anonymous:
            with pytest.raises(UnauthenticatedError) as err:
                await anonymous.statistics()
            assert "s3cret" not in err.value.message
        async with StoreClient(target, token="wrong") as wrong:
            with pytest.raises(UnauthenticatedError):
                await wrong.enqueue_rollout(1)
            with pytest.raises(UnauthenticatedError):
                async for _ in wrong.watch_rollouts():
                    pass
        async with StoreClient(target, token="s3cret") as good:
            assert (await good.enqueue_rollout(1)).status == RolloutStatus.QUEUING
        assert await health_status(target) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.stop()


async def test_tls_serves_clients_that_trust_the_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    running = await start_server(
        ServerConfig(port=0, tls=TlsFiles(cert_chain=tmp_path / "cert.pem", private_key=tmp_path / "key.pem"))
    )
    try:
        config = ClientConfig(
            target=f"127.0.0.1:{running.port}",
            tls=TlsConfig(root_certificates=ca.cert_pem.bytes(), server_name_override="localhost"),
            token=None,
        )
        async with StoreClient(config) as secure:
            assert (await secure.enqueue_rollout({"tls": True})).input == {"tls": True}
        async with StoreClient(f"127.0.0.1:{running.port}", retry=None, timeout=2) as plain:
            with pytest.raises(UnavailableError):
                await plain.statistics()
    finally:
        await running.stop()


async def test_a_runners_spans_travel_over_tls_with_its_runner_credential(tmp_path: Path) -> None:
    """The runner's span shipper opens its channel through the client's one factory: TLS and credential."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    files = TlsFiles(cert_chain=tmp_path / "cert.pem", private_key=tmp_path / "key.pem")
    running = await start_server(ServerConfig(port=0, tls=files, token="s3cret"))
    tls = TlsConfig(root_certificates=ca.cert_pem.bytes(), server_name_override="localhost")
    target = f"127.0.0.1:{running.port}"
    try:
        async with StoreClient(ClientConfig(target=target, tls=tls, token="s3cret")) as admin:
            queued = await admin.enqueue_rollout({"q": 1})

            @rollout
            def agent(task: Any) -> float:
                emit_reward(0.5)
                return 0.5

            credential = Credentials("s3cret").runner("tls-worker")
            runner = Runner(agent, ClientConfig(target=target, tls=tls, token=credential), max_rollouts=1)
            await runner.run()
            assert runner.succeeded == 1
            names = {s.name for s in await admin.query_spans(queued.rollout_id)}
            assert {semconv.SPAN_ROLLOUT, semconv.SPAN_REWARD} <= names, names
    finally:
        await running.stop()


async def test_gzip_and_large_batches_up_to_the_64_mib_limit(server: RunningServer) -> None:
    async with StoreClient(f"127.0.0.1:{server.port}", gzip=True) as client:
        r = await client.start_rollout({"big": True})
        assert r.latest_attempt
        spans = make_spans(30)
        for s in spans:
            s.attributes["prompt"] = "token " * 60_000  # ~360 KB each, ~11 MB in one message
        result = await client.add_spans(
            spans, rollout_id=r.rollout_id, attempt_id=r.latest_attempt.attempt_id
        )
        assert result.stored_count == 30
        back = await client.query_spans(r.rollout_id)
        assert len(back) == 30 and back[0].attributes["prompt"] == "token " * 60_000


async def test_span_size_limit_gives_resource_exhausted() -> None:
    from lightning_grpc.errors import ResourceExhaustedError

    running = await start_server(ServerConfig(port=0, max_span_bytes=2048))
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            r = await client.start_rollout(1)
            assert r.latest_attempt
            with pytest.raises(ResourceExhaustedError) as err:
                await client.add_spans(
                    [make_span(blob="x" * 5000)],
                    rollout_id=r.rollout_id,
                    attempt_id=r.latest_attempt.attempt_id,
                )
            assert err.value.reason == "SPAN_TOO_LARGE" and err.value.metadata["field"] == "spans[0]"
    finally:
        await running.stop()


async def test_the_span_stream_acknowledges_each_batch_after_storing_it(client: StoreClient) -> None:
    r = await client.start_rollout(1)
    assert r.latest_attempt
    aid = r.latest_attempt.attempt_id
    from lightning_grpc import convert

    batches = []
    for i in range(5):
        req = pb.AddSpansStreamRequest(batch_id=i + 1, rollout_id=r.rollout_id, attempt_id=aid)
        for s in make_spans(10):
            convert.span_to_pb(s, req.spans.add())
        batches.append(req)
    bad = pb.AddSpansStreamRequest(batch_id=99, rollout_id=r.rollout_id, attempt_id="at-unknown")
    bad.spans.append(convert.span_to_pb(make_span()))

    async def requests():  # type: ignore[no-untyped-def]
        for b in [*batches[:3], bad, *batches[3:], batches[0]]:
            yield b

    acks = [a async for a in client.stub.AddSpansStream(requests())]
    assert [a.batch_id for a in acks] == [1, 2, 3, 99, 4, 5, 1]
    assert [a.stored_count for a in acks] == [10, 10, 10, 0, 10, 10, 0]
    assert acks[-1].duplicate_count == 10
    assert (
        acks[3].error.reason == "ATTEMPT_NOT_FOUND"
        and acks[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    )
    assert len(await client.query_spans(r.rollout_id)) == 50


async def test_unavailable_server_raises_a_typed_error_after_the_declared_retries() -> None:
    config = ClientConfig(
        target="127.0.0.1:9", retry=RetryConfig(max_attempts=3, initial_backoff=0.05), timeout=3
    )
    async with StoreClient(config) as client:
        with pytest.raises(UnavailableError):
            await client.statistics()


async def test_retries_recover_when_the_server_comes_up_during_the_call(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ClientConfig(
        target=f"127.0.0.1:{port}", retry=RetryConfig(max_attempts=5, initial_backoff=0.3, max_backoff=1)
    )
    async with StoreClient(config) as client:

        async def start_later() -> RunningServer:
            await asyncio.sleep(0.4)
            return await start_server(ServerConfig(port=port))

        task = asyncio.create_task(start_later())
        stats = await client.statistics()
        running = await task
        assert stats.total_rollouts == 0
        await running.stop()


async def test_the_sync_client_works_from_plain_code(server: RunningServer) -> None:
    def script() -> tuple[str, int]:
        with SyncStoreClient(f"127.0.0.1:{server.port}") as c:
            r = c.start_rollout({"sync": True}, worker_id="s")
            c.add_spans(make_spans(3), rollout_id=r.rollout_id, attempt_id=r.latest_attempt.attempt_id)
            c.complete_attempt(r.rollout_id, r.latest_attempt.attempt_id, "succeeded")
            batches = c.tail_spans(r.rollout_id)
            return c.get_rollout(r.rollout_id).status.name, sum(len(b) for b in batches)

    status, spans = await asyncio.to_thread(script)
    assert (status, spans) == ("SUCCEEDED", 3)


async def test_sqlite_state_survives_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    first = await start_server(ServerConfig(port=0, db=db))
    async with StoreClient(f"127.0.0.1:{first.port}") as c:
        queued = await c.enqueue_rollouts([{"input": i} for i in range(4)])
        d = await c.dequeue_rollout(worker_id="w")
        assert d and d.latest_attempt
        await c.add_spans(make_spans(3), rollout_id=d.rollout_id, attempt_id=d.latest_attempt.attempt_id)
        slow = await c.start_rollout({"slow": 1}, config=RolloutConfig(unresponsive_timeout=0.6))
        events = [e async for e in _first_events(c, 1)]
        token = events[0].resume_token
        done = await c.start_rollout({"done": 1})
        assert done.latest_attempt
        await c.complete_attempt(done.rollout_id, done.latest_attempt.attempt_id, "succeeded")
    await first.stop()
    second = await start_server(ServerConfig(port=0, db=db))
    try:
        async with StoreClient(f"127.0.0.1:{second.port}") as c:
            nxt = await c.dequeue_rollout()
            assert nxt is not None and nxt.rollout_id == queued[1].rollout_id  # queue order kept
            more = await c.add_spans(
                make_spans(2), rollout_id=d.rollout_id, attempt_id=d.latest_attempt.attempt_id
            )
            assert more.sequence_ids == [4, 5]  # numbering continues
            replay = [e async for e in _events_after(c, token, 2)]
            assert [e.rollout.status for e in replay if e.rollout] == [
                RolloutStatus.PREPARING,
                RolloutStatus.SUCCEEDED,
            ]
            await asyncio.sleep(1.2)  # the watchdog deadline of the restored attempt still fires
            assert (await c.get_rollout(slow.rollout_id)).status == RolloutStatus.FAILED
            s = await c.statistics()
            assert s.total_spans == 5 and s.total_rollouts == 6 and s.backend == "sqlite"
    finally:
        await second.stop()


async def test_a_batch_larger_than_one_insert_statement_is_stored_whole_and_in_order(tmp_path: Path) -> None:
    from lightning_grpc.store.sqlite import ROWS_PER_STATEMENT

    db = tmp_path / "store.db"
    count = ROWS_PER_STATEMENT * 2 + 37  # two full statements, then three of 32, 4 and 1 spans
    spans = make_spans(count)
    first = await start_server(ServerConfig(port=0, db=db))
    async with StoreClient(f"127.0.0.1:{first.port}") as c:
        r = await c.start_rollout({"big": 1})
        assert r.latest_attempt
        stored = await c.add_spans(spans, rollout_id=r.rollout_id, attempt_id=r.latest_attempt.attempt_id)
        assert stored.sequence_ids == list(range(1, count + 1))
    await first.stop()
    second = await start_server(ServerConfig(port=0, db=db))
    try:
        async with StoreClient(f"127.0.0.1:{second.port}") as c:
            read = [s async for batch in c.tail_spans(r.rollout_id) for s in batch]
            assert [s.span_id for s in read] == [s.span_id for s in spans]
            assert [s.sequence_id for s in read] == list(range(1, count + 1))
            assert read[-1].name == spans[-1].name and read[-1].attributes == spans[-1].attributes
    finally:
        await second.stop()


def test_an_insert_statement_holds_no_more_spans_than_the_sqlite_library_takes_parameters() -> None:
    import sqlite3

    from lightning_grpc.store.rows import SPAN_COLUMNS
    from lightning_grpc.store.sqlite import ROWS_PER_STATEMENT, rows_per_statement

    conn = sqlite3.connect(":memory:")
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)  # the limit of SQLite before 3.32
        assert rows_per_statement(conn, len(SPAN_COLUMNS)) == 64  # 90 would fit: the power of two below
        assert rows_per_statement(conn, 1_000) == 1
        conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32_766)
        assert rows_per_statement(conn, len(SPAN_COLUMNS)) == ROWS_PER_STATEMENT
    finally:
        conn.close()


@pytest.mark.parametrize("count", [1, 2, 3, 63, 64, 65, 2047, 2048, 2049, 4133, 10_000])
def test_a_commits_rows_take_few_statements_of_few_sizes(count: int) -> None:
    from lightning_grpc.store.sqlite import ROWS_PER_STATEMENT, statement_sizes

    most = ROWS_PER_STATEMENT
    sizes = list(statement_sizes(count, most))
    assert sum(sizes) == count
    assert sizes == sorted(sizes, reverse=True)
    assert all(s <= most and s & (s - 1) == 0 for s in sizes)  # powers of two: 9 statement texts at most
    assert len(sizes) == count // most + bin(count % most).count("1")


async def _first_events(client: StoreClient, n: int):  # type: ignore[no-untyped-def]
    count = 0
    async for ev in client.watch_rollouts(include_progress=True):
        yield ev
        count += 1
        if count >= n:
            return


async def _events_after(client: StoreClient, token: str, n: int):  # type: ignore[no-untyped-def]
    count = 0
    async for ev in client.watch_rollouts(token):
        yield ev
        count += 1
        if count >= n:
            return
