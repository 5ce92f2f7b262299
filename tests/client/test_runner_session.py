"""StoreClient.runner_session(): the runner's calls over one stream, shared by many tasks, surviving a
server restart, and falling back to the unary calls on a server without RunnerSession."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lightning_grpc.client import ClientConfig, RetryConfig, RunnerSession, StoreClient
from lightning_grpc.client.errors import from_rpc_error
from lightning_grpc.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from lightning_grpc.server.app import ServerConfig, make_store, start_server
from lightning_grpc.server.store_servicer import StoreServicer
from lightning_grpc.types import AttemptStatus, RolloutStatus, Span
from lightning_grpc.v1 import store_service_pb2 as pb


def spans(n: int, tag: str) -> list[Span]:
    return [Span(trace_id="b" * 32, span_id=f"{i + 1:016x}", name=f"{tag}-{i}") for i in range(n)]


async def test_a_rollouts_calls_over_a_session_answer_as_the_clients_own(client: StoreClient) -> None:
    await client.enqueue_rollouts([{"input": {"n": i}} for i in range(3)])
    async with client.runner_session() as session:
        first = await session.dequeue_rollout(worker_id="w1")
        assert first is not None and first.latest_attempt is not None
        beat = await session.heartbeat_attempt(first.rollout_id, first.latest_attempt.attempt_id)
        assert not beat.should_stop and beat.rollout_status in (
            RolloutStatus.PREPARING,
            RolloutStatus.RUNNING,
        )
        attempt, rollout, nxt = await session.complete_and_dequeue(
            first.rollout_id,
            first.latest_attempt.attempt_id,
            "succeeded",
            spans=spans(3, "first"),
            worker_id="w1",
        )
        assert attempt.status == AttemptStatus.SUCCEEDED and rollout.status == RolloutStatus.SUCCEEDED
        [second] = nxt
        assert second.latest_attempt is not None and second.latest_attempt.worker_id == "w1"
        _, failed = await session.complete_attempt(
            second.rollout_id, second.latest_attempt.attempt_id, "failed", "no luck", {"why": "test"}
        )
        assert failed.status == RolloutStatus.FAILED
        with pytest.raises(NotFoundError) as missing:
            await session.heartbeat_attempt("ro-nobody", "at-nobody")
        assert "ro-nobody" in str(missing.value)
        with pytest.raises(FailedPreconditionError):  # ended with another outcome: the same error as unary
            await session.complete_attempt(first.rollout_id, first.latest_attempt.attempt_id, "failed")
        rest = await session.dequeue_rollouts(5, worker_id="w1")
        assert len(rest) == 1  # the session still works after its errors
    stored = await client.list_spans(first.rollout_id)
    assert [s.name for s in stored.items] == ["first-0", "first-1", "first-2"]
    got = await client.get_rollout(second.rollout_id)
    assert got.latest_attempt is not None and got.latest_attempt.metadata.get("why") == "test"


async def test_many_tasks_share_one_session(client: StoreClient) -> None:
    async with client.runner_session() as session:
        claims = [
            asyncio.ensure_future(session.dequeue_rollout(worker_id=f"w{i}", wait=5)) for i in range(20)
        ]
        await asyncio.sleep(0.2)
        await client.enqueue_rollouts([{"input": i} for i in range(20)])
        got = await asyncio.gather(*claims)
        assert all(r is not None for r in got)
        assert len({r.rollout_id for r in got if r is not None}) == 20
        reports = [
            session.complete_attempt(r.rollout_id, r.latest_attempt.attempt_id, "succeeded")
            for r in got
            if r is not None and r.latest_attempt is not None
        ]
        done = await asyncio.gather(*reports)
    assert {rollout.status for _, rollout in done} == {RolloutStatus.SUCCEEDED}


async def test_a_claim_owed_when_the_server_restarts_is_sent_again_and_answered(tmp_path: Path) -> None:
    config = ServerConfig(port=0, db=tmp_path / "store.db", grace=0.5)
    first = await start_server(config)
    port = first.port
    retry = RetryConfig(max_attempts=30, initial_backoff=0.05, max_backoff=0.2)
    async with StoreClient(ClientConfig(target=f"127.0.0.1:{port}", retry=retry)) as client:
        session = client.runner_session()
        await session.dequeue_rollouts(worker_id="w1")  # the stream is open
        claim = asyncio.ensure_future(session.dequeue_rollout(worker_id="w1", wait=8))
        await asyncio.sleep(0.2)
        await first.stop()  # drains: the stream ends UNAVAILABLE with the claim unanswered
        second = await start_server(ServerConfig(port=port, db=tmp_path / "store.db", grace=0.5))
        try:
            await client.enqueue_rollouts([{"input": "after the restart"}])
            got = await asyncio.wait_for(claim, 15)
            assert got is not None and got.input == "after the restart"
            assert got.latest_attempt is not None and got.latest_attempt.worker_id == "w1"
        finally:
            await session.close()
            await second.stop()


async def test_a_server_without_runner_session_is_asked_with_the_unary_calls(tmp_path: Path) -> None:
    store = await make_store(ServerConfig(port=0)).start()
    servicer = StoreServicer(store)
    server = grpc.aio.server()
    unary = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=getattr(pb, f"{name}Request").FromString,
            response_serializer=getattr(pb, f"{name}Response").SerializeToString,
        )
        for name in ("EnqueueRollouts", "DequeueRollouts", "HeartbeatAttempt", "CompleteAttempt")
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("lightning.v1.StoreService", unary),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with StoreClient(f"127.0.0.1:{port}") as client, client.runner_session() as session:
            await client.enqueue_rollouts([{"input": 1}, {"input": 2}])
            got = await session.dequeue_rollout(worker_id="w1")
            assert got is not None and got.latest_attempt is not None
            _, rollout, nxt = await session.complete_and_dequeue(
                got.rollout_id, got.latest_attempt.attempt_id, "succeeded", worker_id="w1"
            )
            assert rollout.status == RolloutStatus.SUCCEEDED and len(nxt) == 1
    finally:
        await server.stop(0)
        await store.close()


async def silent_session(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    async for _ in requests:
        pass  # reads every message and answers none
    if False:  # pragma: no cover - makes this an async generator
        yield


async def test_an_unanswered_message_raises_deadline_exceeded_and_close_ends_the_rest() -> None:
    server, port = await session_server(silent_session)
    try:
        async with StoreClient(f"127.0.0.1:{port}", timeout=0.5) as client:
            session = client.runner_session()
            with pytest.raises(DeadlineExceededError) as late:
                await session.heartbeat_attempt("ro-1", "at-1")
            assert "HeartbeatAttempt" in str(late.value)
            owed = asyncio.ensure_future(session.dequeue_rollout(worker_id="w1", wait=30))
            await asyncio.sleep(0.2)
            await session.close()
            with pytest.raises(UnavailableError) as closed:
                await owed
            assert closed.value.reason == "SESSION_CLOSED"
    finally:
        await server.stop(0)


async def session_server(session: Any) -> tuple[grpc.aio.Server, int]:
    """A started server on 127.0.0.1 whose RunnerSession is ``session`` (a stream-stream handler), and its
    port."""
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        session,
        request_deserializer=pb.RunnerSessionRequest.FromString,
        response_serializer=pb.RunnerSessionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("lightning.v1.StoreService", {"RunnerSession": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


class SilentFirst:
    """The session's stub, whose first RunnerSession stream goes to a server that never answers; every later
    stream is the real one."""

    def __init__(self, stub: Any, silent: Any) -> None:
        self.stub, self.silent, self.opened = stub, silent, 0

    def RunnerSession(self, **kw: Any) -> Any:
        self.opened += 1
        return (self.stub if self.opened > 1 else self.silent).RunnerSession(**kw)


@contextlib.asynccontextmanager
async def first_stream_to(
    peer: Any, timeout: float
) -> AsyncIterator[tuple[StoreClient, RunnerSession, SilentFirst]]:
    """A real server, its client (``timeout``) and a runner session of it whose first stream goes to a server
    whose RunnerSession is ``peer`` instead; every later stream to the real one."""
    other, port = await session_server(peer)
    running = await start_server(ServerConfig(port=0))
    try:
        async with (
            StoreClient(running.address, timeout=timeout) as client,
            StoreClient(f"127.0.0.1:{port}") as peer_client,
            client.runner_session() as session,
        ):
            session._stub = stub = SilentFirst(session._stub, peer_client._stub)
            yield client, session, stub
    finally:
        await running.stop()
        await other.stop(0)


async def test_a_stream_that_answers_nothing_is_given_up_and_its_owed_messages_go_on_a_new_one() -> None:
    """A stream that stays open and never answers (a server whose stream reader died) must not leave the
    runner's calls unanswered for good: the call that waited out its timeout fails, the stream is given up,
    and a claim still owed is sent again on a new stream and answered."""
    async with first_stream_to(silent_session, timeout=0.5) as (client, session, stub):
        claim = asyncio.ensure_future(session.dequeue_rollout(worker_id="w1", wait=10))
        await asyncio.sleep(0.1)
        with pytest.raises(DeadlineExceededError):
            await session.heartbeat_attempt("ro-1", "at-1")  # unanswered for its whole 0.5 s
        [queued] = await client.enqueue_rollouts([{"input": "after"}])
        claimed = await asyncio.wait_for(claim, 5)  # sent again on the new stream, and answered
        assert claimed is not None and claimed.rollout_id == queued.rollout_id
        assert stub.opened == 2
        with pytest.raises(NotFoundError):  # the new stream answers what comes next
            await session.heartbeat_attempt("ro-1", "at-1")
        assert stub.opened == 2


async def never_reads(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    """A RunnerSession that reads nothing: once its window is full, a client's write waits for good."""
    await asyncio.sleep(3600)
    if False:  # pragma: no cover - makes this an async generator
        yield


async def test_a_stream_whose_write_waits_for_good_is_given_up_too() -> None:
    async with first_stream_to(never_reads, timeout=1.0) as (client, session, stub):
        [queued] = await client.enqueue_rollouts([{"input": "big"}])
        big = [Span(trace_id="c" * 32, span_id=f"{i + 1:016x}", name="x" * 200_000) for i in range(10)]
        reports = [
            asyncio.ensure_future(session.complete_attempt(f"ro-{i}", "at-1", "succeeded", spans=big))
            for i in range(8)
        ]  # 2 MB each: more than the stream's window takes
        results = await asyncio.gather(*reports, return_exceptions=True)
        assert any(isinstance(r, DeadlineExceededError) for r in results), results
        # on a new stream, to the real server (which may still be refusing the reports sent again there)
        claimed = await session.dequeue_rollout(worker_id="w1", wait=10)
        assert claimed is not None and claimed.rollout_id == queued.rollout_id
        assert stub.opened >= 2


async def heartbeats_only(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    """A RunnerSession that answers heartbeats and leaves every other message unanswered."""
    async for message in requests:
        if message.WhichOneof("call") == "heartbeat_attempt":
            answer = pb.RunnerSessionResponse(message_id=message.message_id)
            answer.heartbeat_attempt.SetInParent()
            yield answer


async def test_a_message_unanswered_on_a_stream_that_answers_others_keeps_the_stream() -> None:
    server, port = await session_server(heartbeats_only)
    try:
        async with StoreClient(f"127.0.0.1:{port}", timeout=0.5) as client:
            session = client.runner_session()
            claim = asyncio.ensure_future(session.dequeue_rollout(worker_id="w1"))
            await asyncio.sleep(0.1)
            await session.heartbeat_attempt("ro-1", "at-1")  # answered after the claim was sent
            with pytest.raises(DeadlineExceededError):
                await claim
            await asyncio.sleep(0.1)
            assert session._streams == 1  # slow, not lost: the stream is kept
            await session.heartbeat_attempt("ro-1", "at-1")
            assert session._streams == 1
            await session.close()
    finally:
        await server.stop(0)


#: What grpc.aio reports for a stream whose status it lost to a write made as the server ended the call.
LOST = grpc.aio.AioRpcError(
    grpc.StatusCode.INTERNAL,
    grpc.aio.Metadata(),
    grpc.aio.Metadata(),
    details="Internal error from Core",
    debug_error_string='Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object>,)',
)


class StatusLostOnce:
    """The session's stub, whose first RunnerSession stream ends as grpc.aio ends a stream when a write lost
    the race with the server's answer; every later stream is the real one."""

    def __init__(self, stub: Any) -> None:
        self.stub, self.opened = stub, 0

    def RunnerSession(self, **kw: Any) -> Any:
        self.opened += 1
        return self.stub.RunnerSession(**kw) if self.opened > 1 else _LostStream()


class _LostStream:
    async def write(self, message: Any) -> None:
        pass

    def __aiter__(self) -> _LostStream:
        return self

    async def __anext__(self) -> Any:
        raise LOST

    def cancel(self) -> bool:
        return True


async def test_a_stream_whose_status_grpc_lost_to_a_write_is_opened_again_to_learn_the_real_one() -> None:
    """A refused session must say UNAUTHENTICATED, not grpc.aio's INTERNAL, even with retries off."""
    running = await start_server(ServerConfig(port=0, token="s3cret"))
    try:
        config = ClientConfig(target=running.address, token="not the token", retry=None)
        async with StoreClient(config) as client, client.runner_session() as session:
            session._stub = stub = StatusLostOnce(session._stub)
            with pytest.raises(UnauthenticatedError):
                await session.dequeue_rollout(worker_id="w1")
            assert stub.opened == 2
    finally:
        await running.stop()


async def fails_like_grpc(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    await context.abort(grpc.StatusCode.INTERNAL, 'Failed "execute_batch"')
    raise AssertionError("abort returns no answer")


async def test_only_grpcs_own_failed_write_reads_as_a_lost_status() -> None:
    lost = from_rpc_error(LOST)
    assert isinstance(lost, UnavailableError) and lost.reason == "STREAM_STATUS_LOST" and lost.transient
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(fails_like_grpc)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Fails", {"Call": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await channel.unary_unary("/test.Fails/Call")(b"")
        # a server's INTERNAL whose message reads like grpc.aio's own is the server's error
        assert isinstance(from_rpc_error(raised.value), InternalError)
    finally:
        await server.stop(0)
