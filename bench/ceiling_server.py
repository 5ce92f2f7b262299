"""The Python gRPC ceiling: a grpc.aio server that parses span batches and stores nothing.

It answers the same methods with the same messages as the Store, so the same driver measures
both; the gap between them is what storing costs. For the rollout cycle it also hands out queued
rollouts (EnqueueRollouts, DequeueRollouts, CompleteAttempt with its dequeue_next, and the same two
over RunnerSession) from a plain
queue of ids, with no states, attempts, timeouts or records: what one call a rollout costs in
gRPC and Protobuf alone.

    python bench/ceiling_server.py --port 0      # prints "READY <port>"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_grpc.v1 import rollout_pb2
from lightning_grpc.v1 import store_service_pb2 as pb

SERVICE = "lightning.v1.StoreService"
QUEUING, RUNNING, SUCCEEDED = (
    rollout_pb2.ROLLOUT_STATUS_QUEUING,
    rollout_pb2.ROLLOUT_STATUS_RUNNING,
    rollout_pb2.ROLLOUT_STATUS_SUCCEEDED,
)
ATTEMPT_RUNNING = rollout_pb2.ATTEMPT_STATUS_RUNNING


async def add_spans(request: pb.AddSpansRequest, context: grpc.aio.ServicerContext) -> pb.AddSpansResponse:
    return pb.AddSpansResponse(stored_count=len(request.spans))


async def add_spans_stream(
    requests: AsyncIterator[pb.AddSpansStreamRequest], context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.AddSpansStreamResponse]:
    async for batch in requests:
        yield pb.AddSpansStreamResponse(batch_id=batch.batch_id, stored_count=len(batch.spans))


class RolloutQueue:
    """Queued rollout ids and their inputs; a claim answers a RUNNING rollout with an attempt."""

    def __init__(self) -> None:
        self.queued: collections.deque[tuple[str, Any]] = collections.deque()
        self.ids = itertools.count(1)

    async def enqueue(
        self, request: pb.EnqueueRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> pb.EnqueueRolloutsResponse:
        resp = pb.EnqueueRolloutsResponse()
        for spec in request.rollouts:
            rollout = resp.rollouts.add(rollout_id=f"ro-{next(self.ids):012x}", status=QUEUING)
            rollout.input.CopyFrom(spec.input)
            rollout.create_time.GetCurrentTime()
            self.queued.append((rollout.rollout_id, spec.input))
        return resp

    async def claim(self, request: pb.DequeueRolloutsRequest, into: Any) -> None:
        """One queued rollout as claimed by the request's worker into the repeated field ``into``; none,
        after its wait_timeout (at most 0.2 s), when the queue is empty."""
        if not self.queued:
            await asyncio.sleep(min(request.wait_timeout.ToTimedelta().total_seconds(), 0.2))
            return
        rollout_id, value = self.queued.popleft()
        rollout = into.add(rollout_id=rollout_id, status=RUNNING, attempt_count=1)
        rollout.input.CopyFrom(value)
        rollout.start_time.GetCurrentTime()
        attempt = rollout.latest_attempt
        attempt.rollout_id, attempt.attempt_id, attempt.sequence_number = rollout_id, f"at-{rollout_id}", 1
        attempt.status, attempt.worker_id = ATTEMPT_RUNNING, request.worker_id
        attempt.start_time.CopyFrom(rollout.start_time)

    async def dequeue(
        self, request: pb.DequeueRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DequeueRolloutsResponse:
        resp = pb.DequeueRolloutsResponse()
        await self.claim(request, resp.rollouts)
        return resp

    async def complete(
        self, request: pb.CompleteAttemptRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteAttemptResponse:
        resp = pb.CompleteAttemptResponse()
        resp.attempt.rollout_id, resp.attempt.attempt_id = request.rollout_id, request.attempt_id
        resp.attempt.sequence_number, resp.attempt.status = 1, request.status
        resp.attempt.end_time.GetCurrentTime()
        resp.rollout.rollout_id, resp.rollout.status = request.rollout_id, SUCCEEDED
        resp.rollout.end_time.CopyFrom(resp.attempt.end_time)
        if request.HasField("dequeue_next"):
            await self.claim(request.dequeue_next, resp.next_rollouts)
        return resp

    async def session(
        self, requests: AsyncIterator[pb.RunnerSessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RunnerSessionResponse]:
        """RunnerSession: each message answered in turn by the call it carries (claims and reports only)."""
        async for message in requests:
            answer = pb.RunnerSessionResponse(message_id=message.message_id)
            if message.HasField("complete_attempt"):
                answer.complete_attempt.CopyFrom(await self.complete(message.complete_attempt, context))
            else:
                await self.claim(message.dequeue_rollouts, answer.dequeue_rollouts.rollouts)
            yield answer


async def main(port: int) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
    )
    handlers = {
        "AddSpans": unary(add_spans, pb.AddSpansRequest, pb.AddSpansResponse),
        "AddSpansStream": grpc.stream_stream_rpc_method_handler(
            add_spans_stream,
            request_deserializer=pb.AddSpansStreamRequest.FromString,
            response_serializer=pb.AddSpansStreamResponse.SerializeToString,
        ),
        **rollout_handlers(RolloutQueue()),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def unary(method: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        method, request_deserializer=request.FromString, response_serializer=response.SerializeToString
    )


def rollout_handlers(queue: RolloutQueue) -> dict[str, grpc.RpcMethodHandler]:
    return {
        "EnqueueRollouts": unary(queue.enqueue, pb.EnqueueRolloutsRequest, pb.EnqueueRolloutsResponse),
        "DequeueRollouts": unary(queue.dequeue, pb.DequeueRolloutsRequest, pb.DequeueRolloutsResponse),
        "CompleteAttempt": unary(queue.complete, pb.CompleteAttemptRequest, pb.CompleteAttemptResponse),
        "RunnerSession": grpc.stream_stream_rpc_method_handler(
            queue.session,
            request_deserializer=pb.RunnerSessionRequest.FromString,
            response_serializer=pb.RunnerSessionResponse.SerializeToString,
        ),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(main(parser.parse_args().port))
