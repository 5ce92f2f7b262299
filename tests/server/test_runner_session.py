"""RunnerSession: a runner's claims, heartbeats and reports as messages of one stream, each handled as its
RPC would handle it, answered as it is done, an error answering its message and not ending the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from lightning_grpc.access import Credentials
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.server.app import RunningServer, ServerConfig
from lightning_grpc.v1 import rollout_pb2, span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc
from tests.helpers import serving

TOKEN = "session-admin-token"


class Session:
    """One RunnerSession stream on raw stubs: send a message, read answers as they come."""

    def __init__(self, channel: grpc.aio.Channel, bearer: str | None = None) -> None:
        metadata = (("authorization", f"Bearer {bearer}"),) if bearer else ()
        self.stream = pb_grpc.StoreServiceStub(channel).RunnerSession(metadata=metadata, timeout=30)
        self.ids = 0

    async def send(self, **call: Any) -> int:
        self.ids += 1
        await self.stream.write(pb.RunnerSessionRequest(message_id=self.ids, **call))
        return self.ids

    async def answer(self) -> pb.RunnerSessionResponse:
        return await asyncio.wait_for(self.stream.read(), 10)

    async def ask(self, **call: Any) -> pb.RunnerSessionResponse:
        message_id = await self.send(**call)
        answer = await self.answer()
        assert answer.message_id == message_id
        return answer


@pytest_asyncio.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ch


def span(name: str) -> span_pb2.Span:
    return span_pb2.Span(trace_id="a" * 32, span_id=f"{abs(hash(name)) % 16**16:016x}", name=name)


async def test_each_call_is_answered_as_its_rpc_would_answer_it(
    client: StoreClient, channel: grpc.aio.Channel
) -> None:
    await client.enqueue_rollouts([{"input": {"n": 1}}, {"input": {"n": 2}}])
    session = Session(channel)

    claimed = await session.ask(dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w1"))
    [first] = claimed.dequeue_rollouts.rollouts
    assert first.status == rollout_pb2.ROLLOUT_STATUS_PREPARING  # as DequeueRollouts answers it
    attempt = first.latest_attempt
    assert attempt.worker_id == "w1" and attempt.attempt_id

    beat = await session.ask(
        heartbeat_attempt=pb.HeartbeatAttemptRequest(
            rollout_id=first.rollout_id, attempt_id=attempt.attempt_id
        )
    )
    assert beat.WhichOneof("result") == "heartbeat_attempt"
    assert not beat.heartbeat_attempt.should_stop
    assert beat.heartbeat_attempt.attempt.status == rollout_pb2.ATTEMPT_STATUS_RUNNING

    report = pb.CompleteAttemptRequest(
        rollout_id=first.rollout_id,
        attempt_id=attempt.attempt_id,
        status=rollout_pb2.ATTEMPT_STATUS_SUCCEEDED,
        spans=[span("one"), span("two")],
        dequeue_next=pb.DequeueRolloutsRequest(worker_id="w1"),
    )
    done = await session.ask(complete_attempt=report)
    assert done.complete_attempt.rollout.status == rollout_pb2.ROLLOUT_STATUS_SUCCEEDED
    [second] = done.complete_attempt.next_rollouts
    assert second.rollout_id != first.rollout_id and second.latest_attempt.worker_id == "w1"
    stored = await client.list_spans(first.rollout_id)
    assert sorted(s.name for s in stored.items) == ["one", "two"]
    await session.stream.done_writing()
    assert await session.stream.code() == grpc.StatusCode.OK


async def test_an_error_answers_its_message_and_the_stream_goes_on(
    client: StoreClient, channel: grpc.aio.Channel
) -> None:
    await client.enqueue_rollouts([{"input": 1}])
    session = Session(channel)
    missing = await session.ask(
        complete_attempt=pb.CompleteAttemptRequest(
            rollout_id="ro-missing", attempt_id="at-missing", status=rollout_pb2.ATTEMPT_STATUS_SUCCEEDED
        )
    )
    assert missing.WhichOneof("result") == "error"
    assert missing.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "ro-missing" in missing.error.message
    bad_limit = await session.ask(dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w1", max_rollouts=-3))
    assert bad_limit.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "max_rollouts" in bad_limit.error.message
    empty = await session.ask()  # no call at all
    assert empty.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert empty.error.message.startswith("call: set one of dequeue_rollouts, heartbeat_attempt")
    claimed = await session.ask(dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w1"))
    assert len(claimed.dequeue_rollouts.rollouts) == 1  # the stream still works


async def test_a_claim_that_waits_does_not_hold_up_a_report_sent_after_it(
    client: StoreClient, channel: grpc.aio.Channel
) -> None:
    await client.enqueue_rollouts([{"input": 1}])
    [claimed] = await client.dequeue_rollouts(worker_id="w1")
    assert claimed.latest_attempt is not None
    session = Session(channel)
    waiting = await session.send(
        dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w1", wait_timeout={"seconds": 5})
    )
    report = await session.send(
        complete_attempt=pb.CompleteAttemptRequest(
            rollout_id=claimed.rollout_id,
            attempt_id=claimed.latest_attempt.attempt_id,
            status=rollout_pb2.ATTEMPT_STATUS_FAILED,
            message="broke",
        )
    )
    first = await session.answer()
    assert (
        first.message_id == report
        and first.complete_attempt.attempt.status == rollout_pb2.ATTEMPT_STATUS_FAILED
    )
    await client.enqueue_rollouts([{"input": 2}])  # the waiting claim takes it
    second = await session.answer()
    assert second.message_id == waiting and len(second.dequeue_rollouts.rollouts) == 1


async def test_a_session_open_when_the_server_drains_ends_unavailable(server_config: ServerConfig) -> None:
    async with serving(server_config) as running, grpc.aio.insecure_channel(running.address) as ch:
        session = Session(ch)
        await session.ask(dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w1"))
        stopping = asyncio.ensure_future(running.stop())
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(session.stream.read(), 10)
        await stopping
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (ended.value.details() or "")


# ---------------------------------------------------------------------- access control, message by message


@pytest_asyncio.fixture
async def secured() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=0.5, token=TOKEN)) as running:
        yield running


async def test_each_message_is_checked_as_its_rpc_and_a_refusal_answers_it(secured: RunningServer) -> None:
    creds = Credentials(TOKEN)
    async with StoreClient(ClientConfig(target=secured.address, token=TOKEN)) as admin:
        await admin.enqueue_rollouts([{"input": 1}, {"input": 2}])
    async with grpc.aio.insecure_channel(secured.address) as ch:
        runner = Session(ch, creds.runner("w1"))
        theirs = await runner.ask(dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w2"))
        assert theirs.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert theirs.error.reason == "WRONG_WORKER"
        mine = await runner.ask(dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w1"))
        [rollout] = mine.dequeue_rollouts.rollouts
        credential = rollout.latest_attempt.credential
        assert credential.startswith(
            "lgc1."
        )  # the answer carries the attempt credential, as DequeueRollouts'

        agent = Session(ch, credential)
        claim = await agent.ask(dequeue_rollouts=pb.DequeueRolloutsRequest(worker_id="w1"))
        assert claim.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert claim.error.reason == "ROLE_NOT_ALLOWED" and "DequeueRollouts" in claim.error.message
        sneaky = await agent.ask(
            complete_attempt=pb.CompleteAttemptRequest(
                rollout_id=rollout.rollout_id,
                attempt_id=rollout.latest_attempt.attempt_id,
                status=rollout_pb2.ATTEMPT_STATUS_SUCCEEDED,
                dequeue_next=pb.DequeueRolloutsRequest(worker_id="w1"),
            )
        )
        assert sneaky.error.reason == "ROLE_NOT_ALLOWED"  # a claim inside a report is still a claim
        own = await agent.ask(
            complete_attempt=pb.CompleteAttemptRequest(
                rollout_id=rollout.rollout_id,
                attempt_id=rollout.latest_attempt.attempt_id,
                status=rollout_pb2.ATTEMPT_STATUS_SUCCEEDED,
            )
        )
        assert own.complete_attempt.rollout.status == rollout_pb2.ROLLOUT_STATUS_SUCCEEDED
        ended = await agent.ask(
            heartbeat_attempt=pb.HeartbeatAttemptRequest(
                rollout_id=rollout.rollout_id, attempt_id=rollout.latest_attempt.attempt_id
            )
        )
        assert ended.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert ended.error.reason == "CREDENTIAL_EXPIRED"  # the attempt ended while the stream was open
