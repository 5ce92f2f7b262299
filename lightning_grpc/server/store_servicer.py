"""StoreService over gRPC: translate Protobuf <-> domain and call the store core. Nothing else."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc

from lightning_grpc import convert
from lightning_grpc.access import SESSION_CALLS
from lightning_grpc.convert.store import statistics_to_pb
from lightning_grpc.errors import InvalidArgumentError, LightningError, UnavailableError
from lightning_grpc.pipelined import answers_as_done, answers_in_order
from lightning_grpc.store import (
    AddSpansResult,
    DequeueRequest,
    SpanRecord,
    SpanSelection,
    Store,
)
from lightning_grpc.v1 import common_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc

from . import caller, wire
from .handlers import ServicerState, Undecodable, internal_error, register_service, streaming, unary

Ctx = grpc.aio.ServicerContext[Any, Any]

#: The largest google.protobuf.Duration (about 10,000 years): a longer timeout could not be sent back.
MAX_DURATION_SECONDS = 315_576_000_000.999_999_999


def check_duration(seconds: float, field: str) -> None:
    """The store's rule for rollout timeouts that travel as google.protobuf.Duration (its timeout_rule)."""
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_DURATION_SECONDS:
        raise InvalidArgumentError(field, f"must be a positive google.protobuf.Duration (got {seconds:g} s)")


def _span_records(
    spans: Any, rollout_id: str, attempt_id: str, stream_request: bytes | None = None
) -> list[SpanRecord]:
    """The spans of a write, once the caller may write every attempt they name: a span's own ids win over
    the request's, so each is checked (PERMISSION_DENIED before anything is stored)."""
    records = convert.span_records(spans, stream_request=stream_request)
    caller.authorize_spans((r.rollout_id or rollout_id, r.attempt_id or attempt_id) for r in records)
    return records


#: The batches of one AddSpansStream that may wait for their commit at once (see answers_in_order).
STREAM_BATCHES_IN_COMMIT = 16


def _batch_stored(batch_id: int, result: AddSpansResult) -> pb.AddSpansStreamResponse:
    return pb.AddSpansStreamResponse(
        batch_id=batch_id, stored_count=result.stored_count, duplicate_count=result.duplicate_count
    )


def _error_of(exc: LightningError) -> pb.BatchError:
    """An error about one message of a stream, as its unary RPC's status would have told it."""
    code = grpc.StatusCode[exc.code_name].value[0]
    return pb.BatchError(code=code, reason=exc.reason, message=exc.message)


def _batch_refused(batch_id: int, exc: LightningError) -> pb.AddSpansStreamResponse:
    return pb.AddSpansStreamResponse(batch_id=batch_id, error=_error_of(exc))


def _session_refused(answer: pb.RunnerSessionResponse, exc: LightningError) -> pb.RunnerSessionResponse:
    answer.error.CopyFrom(_error_of(exc))
    return answer


#: The messages of one RunnerSession handled at once (a runner's claims, heartbeats and outcomes in flight).
SESSION_MESSAGES_AT_ONCE = 64


async def _once_durable(
    batch_id: int, result: AddSpansResult, durable: Awaitable[None]
) -> pb.AddSpansStreamResponse:
    """The answer to a stream's batch once its commit is done (an UNAVAILABLE store ends the stream)."""
    try:
        await durable
    except UnavailableError:
        raise
    except LightningError as exc:
        return _batch_refused(batch_id, exc)
    return _batch_stored(batch_id, result)


def _selection(sel: pb.SpanSelector) -> SpanSelection:
    return SpanSelection(
        rollout_id=sel.rollout_id,
        attempt_id=sel.attempt_id,
        trace_id=sel.trace_id,
        span_id=sel.span_id,
        parent_span_id=sel.parent_span_id,
        name=sel.name,
        name_contains=sel.name_contains,
    )


def _wait(request: Any, field: str) -> float | None:
    return convert.duration_to_float(getattr(request, field)) if request.HasField(field) else None


def _descending(order: int) -> bool:
    return order == common_pb2.SORT_ORDER_DESCENDING


def _before_deadline(context: Ctx) -> Callable[[float], float]:
    """Shortens a wait (seconds) so that the answer comes before the caller's deadline."""

    def bound(wait: float) -> float:
        remaining = context.time_remaining()
        return wait if remaining is None else max(0.0, min(wait, remaining - 0.05))

    return bound


#: How UpdateRollout reads the updatable fields (Store.UPDATABLE) that are messages; the others are scalars.
_UPDATE_READERS: dict[str, Callable[[pb.UpdateRolloutRequest], Any]] = {
    "input": lambda m: convert.value_to_python(m.input) if m.HasField("input") else None,
    "config": lambda m: convert.config_from_pb(m.config),
    "metadata": lambda m: convert.struct_to_dict(m.metadata),
}


class StoreServicer(ServicerState, pb_grpc.StoreServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    # ------------------------------------------------------------ rollouts
    @unary
    async def StartRollout(self, request: pb.StartRolloutRequest, context: Ctx) -> pb.StartRolloutResponse:
        rollout = await self.store.start_rollout(convert.spec_from_pb(request.rollout), request.worker_id)
        resp = pb.StartRolloutResponse()
        convert.rollout_to_pb(rollout, resp.rollout)
        return resp

    @unary
    async def EnqueueRollouts(
        self, request: pb.EnqueueRolloutsRequest, context: Ctx
    ) -> pb.EnqueueRolloutsResponse:
        rollouts = await self.store.enqueue_rollouts([convert.spec_from_pb(s) for s in request.rollouts])
        resp = pb.EnqueueRolloutsResponse()
        for r in rollouts:
            convert.rollout_to_pb(r, resp.rollouts.add())
        return resp

    @unary
    async def DequeueRollouts(
        self, request: pb.DequeueRolloutsRequest, context: Ctx
    ) -> pb.DequeueRolloutsResponse:
        wait = self._bounded_wait(request, "wait_timeout", context)
        rollouts = await self.store.dequeue_rollouts(
            request.worker_id, request.max_rollouts, wait, request.request_id
        )
        resp = pb.DequeueRolloutsResponse()
        for r in rollouts:
            convert.rollout_to_pb(r, resp.rollouts.add())
        return resp

    def _bounded_wait(self, request: Any, field: str, context: Ctx) -> float:
        """A request's wait, validated, then shortened so the answer comes before the caller's deadline."""
        return _before_deadline(context)(self.store.check_wait(_wait(request, field), field))

    @unary
    async def StartAttempt(self, request: pb.StartAttemptRequest, context: Ctx) -> pb.StartAttemptResponse:
        rollout = await self.store.start_attempt(request.rollout_id, request.worker_id)
        resp = pb.StartAttemptResponse()
        convert.rollout_to_pb(rollout, resp.rollout)
        return resp

    @unary
    async def UpdateRollout(self, request: pb.UpdateRolloutRequest, context: Ctx) -> pb.UpdateRolloutResponse:
        paths = list(request.update_mask.paths)
        if not paths:
            paths = [f.name for f, _ in request.ListFields() if f.name not in ("rollout_id", "update_mask")]
        changes: dict[str, Any] = {}
        for path in paths:
            if path not in Store.UPDATABLE:
                raise InvalidArgumentError(
                    "update_mask", f"unknown path {path!r}; updatable: {', '.join(Store.UPDATABLE)}"
                )
            read = _UPDATE_READERS.get(path)
            changes[path] = read(request) if read is not None else getattr(request, path)
        rollout = await self.store.update_rollout(request.rollout_id, changes)
        resp = pb.UpdateRolloutResponse()
        convert.rollout_to_pb(rollout, resp.rollout)
        return resp

    @unary
    async def CancelRollout(self, request: pb.CancelRolloutRequest, context: Ctx) -> pb.CancelRolloutResponse:
        rollout = await self.store.cancel_rollout(request.rollout_id, request.reason)
        resp = pb.CancelRolloutResponse()
        convert.rollout_to_pb(rollout, resp.rollout)
        return resp

    @unary
    async def RetryRollout(self, request: pb.RetryRolloutRequest, context: Ctx) -> pb.RetryRolloutResponse:
        rollout = await self.store.retry_rollout(request.rollout_id, request.reason)
        resp = pb.RetryRolloutResponse()
        convert.rollout_to_pb(rollout, resp.rollout)
        return resp

    @unary
    async def GetRollout(self, request: pb.GetRolloutRequest, context: Ctx) -> pb.GetRolloutResponse:
        rollout = await self.store.get_rollout(request.rollout_id)
        resp = pb.GetRolloutResponse()
        convert.rollout_to_pb(rollout, resp.rollout)
        return resp

    @unary
    async def ListRollouts(self, request: pb.ListRolloutsRequest, context: Ctx) -> pb.ListRolloutsResponse:
        page = await self.store.list_rollouts(
            statuses=list(request.statuses),
            rollout_ids=list(request.rollout_ids),
            rollout_id_contains=request.rollout_id_contains,
            mode=request.mode,
            group_id=request.group_id,
            order_by=request.order_by,
            descending=_descending(request.order),
            page_size=request.page_size,
            page_token=request.page_token,
            match_any=request.match == pb.FILTER_MATCH_ANY,
        )
        resp = pb.ListRolloutsResponse(next_page_token=page.next_page_token, total_size=page.total_size)
        for r in page.items:
            convert.rollout_to_pb(r, resp.rollouts.add())
        return resp

    # ------------------------------------------------------------ attempts
    @unary
    async def GetLatestAttempt(
        self, request: pb.GetLatestAttemptRequest, context: Ctx
    ) -> pb.GetLatestAttemptResponse:
        attempt = await self.store.get_latest_attempt(request.rollout_id)
        resp = pb.GetLatestAttemptResponse()
        if attempt is not None:
            convert.attempt_to_pb(attempt, resp.attempt)
        return resp

    @unary
    async def ListAttempts(self, request: pb.ListAttemptsRequest, context: Ctx) -> pb.ListAttemptsResponse:
        page = await self.store.list_attempts(
            request.rollout_id,
            descending=_descending(request.order),
            page_size=request.page_size,
            page_token=request.page_token,
        )
        resp = pb.ListAttemptsResponse(next_page_token=page.next_page_token, total_size=page.total_size)
        for a in page.items:
            convert.attempt_to_pb(a, resp.attempts.add())
        return resp

    @unary
    async def HeartbeatAttempt(
        self, request: pb.HeartbeatAttemptRequest, context: Ctx
    ) -> pb.HeartbeatAttemptResponse:
        result = await self.store.heartbeat_attempt(request.rollout_id, request.attempt_id)
        resp = pb.HeartbeatAttemptResponse(
            rollout_status=int(result.rollout_status),  # type: ignore[arg-type]
            cancelled=result.cancelled,
            should_stop=result.should_stop,
        )
        convert.attempt_to_pb(result.attempt, resp.attempt)
        return resp

    @unary
    async def CompleteAttempt(self, request: Any, context: Ctx) -> pb.CompleteAttemptResponse:
        """``request`` is a wire.CompleteAttemptRequestRaw: its spans stay serialized."""
        outcome = (
            request.rollout_id,
            request.attempt_id,
            request.status,
            request.message,
            convert.struct_to_dict(request.metadata) if request.HasField("metadata") else None,
            _span_records(request.spans, request.rollout_id, request.attempt_id) if request.spans else None,
        )
        resp = pb.CompleteAttemptResponse()
        if request.HasField("dequeue_next"):
            nxt = request.dequeue_next
            attempt, rollout, claimed = await self.store.complete_and_dequeue(
                *outcome,
                dequeue_next=DequeueRequest(
                    nxt.worker_id, nxt.max_rollouts, _wait(nxt, "wait_timeout"), nxt.request_id
                ),
                bound_wait=_before_deadline(context),
            )
            for r in claimed:
                convert.rollout_to_pb(r, resp.next_rollouts.add())
        else:
            attempt, rollout = await self.store.complete_attempt(*outcome)
        convert.attempt_to_pb(attempt, resp.attempt)
        convert.rollout_to_pb(rollout, resp.rollout)
        return resp

    # ------------------------------------------------------------ spans
    @unary
    async def AddSpans(self, request: Any, context: Ctx) -> pb.AddSpansResponse:
        """``request`` is a wire.AddSpansRequestRaw: the spans stay serialized."""
        result = await self.store.add_spans(
            _span_records(request.spans, request.rollout_id, request.attempt_id),
            request.rollout_id,
            request.attempt_id,
        )
        return pb.AddSpansResponse(
            sequence_ids=result.sequence_ids,
            stored_count=result.stored_count,
            duplicate_count=result.duplicate_count,
        )

    @streaming
    async def AddSpansStream(
        self, request_iterator: AsyncIterator[Any], context: Ctx
    ) -> AsyncIterator[pb.AddSpansStreamResponse]:
        """Each request is a wire.SpanBatch: the spans stay serialized.

        Batches are stored in the order they arrive and answered in that order, each once it is durable;
        up to :data:`STREAM_BATCHES_IN_COMMIT` of a stream wait for their commit while the next are read, so
        a client with many batches in flight fills each commit from one stream too."""
        messages = self.until_drained(request_iterator)
        async with aclosing(
            answers_in_order(messages, self._take_span_batch, STREAM_BATCHES_IN_COMMIT)
        ) as answers:
            async for answer in answers:
                yield answer

    def _take_span_batch(
        self, batch: Any
    ) -> pb.AddSpansStreamResponse | asyncio.Task[pb.AddSpansStreamResponse]:
        if isinstance(batch, Undecodable):
            raise batch.error()
        try:
            submitted = self.store.submit_spans(
                _span_records(batch.spans, batch.rollout_id, batch.attempt_id, batch.data),
                batch.rollout_id,
                batch.attempt_id,
            )
        except UnavailableError:
            raise  # the server cannot take spans now: the stream ends, the client reconnects and resends
        except LightningError as exc:  # about this batch: the client's shipper decides (exc.transient)
            return _batch_refused(batch.batch_id, exc)
        if submitted.durable is None:
            return _batch_stored(batch.batch_id, submitted.result)
        return asyncio.ensure_future(_once_durable(batch.batch_id, submitted.result, submitted.durable))

    # ------------------------------------------------------------ a runner's calls over one stream
    @streaming
    async def RunnerSession(
        self, request_iterator: AsyncIterator[Any], context: Ctx
    ) -> AsyncIterator[pb.RunnerSessionResponse]:
        """Each request is a wire.RunnerSessionRequestRaw (a completion's spans stay serialized).

        A message is handled by the RPC it stands for, as that RPC's call would be, and answered as soon as
        it is done; up to :data:`SESSION_MESSAGES_AT_ONCE` of a stream are handled at once."""
        messages = self.until_drained(request_iterator)
        step = functools.partial(self._session_step, context=context)
        async with aclosing(answers_as_done(messages, step, SESSION_MESSAGES_AT_ONCE)) as answers:
            async for answer in answers:
                yield answer

    async def _session_step(self, message: Any, context: Ctx) -> pb.RunnerSessionResponse:
        if isinstance(message, Undecodable):
            raise message.error()  # no id to answer it with: the stream ends INVALID_ARGUMENT, as AddSpansStream's
        answer = pb.RunnerSessionResponse(message_id=message.message_id)
        call = message.WhichOneof("call")
        if call is None:
            return _session_refused(
                answer, InvalidArgumentError("call", f"set one of {', '.join(SESSION_CALLS)}")
            )
        method = SESSION_CALLS[call]
        request = getattr(message, call)
        try:
            stand_in = caller.authorize_as(method, request)
            response = await _SESSION_HANDLERS[method](self, request, context)
            caller.answer_as(stand_in, response)
        except UnavailableError:
            raise  # the server cannot go on: the stream ends, the client resends what it has no answer to
        except LightningError as exc:
            return _session_refused(answer, exc)
        except Exception as exc:  # logged with its traceback; the client gets INTERNAL for this message only
            return _session_refused(answer, internal_error(method, exc))
        getattr(answer, call).CopyFrom(response)
        return answer

    @unary
    async def ListSpans(self, request: pb.ListSpansRequest, context: Ctx) -> bytes:  # type: ignore[override]
        """Answers a serialized ListSpansResponse built from the stored span bytes."""
        page = await self.store.list_spans(
            _selection(request.selector),
            request.page_size,
            request.page_token,
            descending=_descending(request.order),
        )
        return wire.spans_message(page.items, page.next_page_token, page.total_size)

    @streaming
    async def TailSpans(self, request: pb.TailSpansRequest, context: Ctx) -> AsyncIterator[bytes]:  # type: ignore[override]
        """Yields serialized TailSpansResponse messages built from the stored span bytes."""
        async for records in self.store.tail_spans(_selection(request.selector), follow=request.follow):
            yield wire.spans_message(records)

    @unary
    async def GetNextSpanSequenceId(
        self, request: pb.GetNextSpanSequenceIdRequest, context: Ctx
    ) -> pb.GetNextSpanSequenceIdResponse:
        first = await self.store.next_span_sequence_id(request.rollout_id, request.attempt_id, request.count)
        return pb.GetNextSpanSequenceIdResponse(sequence_id=first)

    # ------------------------------------------------------------ resources
    @unary
    async def AddResources(self, request: pb.AddResourcesRequest, context: Ctx) -> pb.AddResourcesResponse:
        update = await self.store.add_resources(
            convert.resources_from_pb(request.resources), request.resources_id
        )
        resp = pb.AddResourcesResponse()
        convert.resources_update_to_pb(update, resp.resources)
        return resp

    @unary
    async def UpdateResources(
        self, request: pb.UpdateResourcesRequest, context: Ctx
    ) -> pb.UpdateResourcesResponse:
        update = await self.store.update_resources(
            request.resources_id, convert.resources_from_pb(request.resources), request.expected_version
        )
        resp = pb.UpdateResourcesResponse()
        convert.resources_update_to_pb(update, resp.resources)
        return resp

    @unary
    async def GetResources(self, request: pb.GetResourcesRequest, context: Ctx) -> pb.GetResourcesResponse:
        update = await self.store.get_resources(request.resources_id)
        resp = pb.GetResourcesResponse()
        convert.resources_update_to_pb(update, resp.resources)
        return resp

    @unary
    async def GetLatestResources(
        self, request: pb.GetLatestResourcesRequest, context: Ctx
    ) -> pb.GetLatestResourcesResponse:
        update = await self.store.get_latest_resources()
        resp = pb.GetLatestResourcesResponse()
        if update is not None:
            convert.resources_update_to_pb(update, resp.resources)
        return resp

    @unary
    async def ListResources(self, request: pb.ListResourcesRequest, context: Ctx) -> pb.ListResourcesResponse:
        page = await self.store.list_resources(
            resources_id_contains=request.resources_id_contains,
            descending=_descending(request.order),
            page_size=request.page_size,
            page_token=request.page_token,
        )
        resp = pb.ListResourcesResponse(next_page_token=page.next_page_token, total_size=page.total_size)
        for u in page.items:
            convert.resources_update_to_pb(u, resp.resources.add())
        return resp

    # ------------------------------------------------------------ workers
    @unary
    async def HeartbeatWorker(
        self, request: pb.HeartbeatWorkerRequest, context: Ctx
    ) -> pb.HeartbeatWorkerResponse:
        stats = (
            convert.struct_to_dict(request.heartbeat_stats) if request.HasField("heartbeat_stats") else None
        )
        worker = await self.store.heartbeat_worker(request.worker_id, stats)
        resp = pb.HeartbeatWorkerResponse()
        convert.worker_to_pb(worker, resp.worker)
        return resp

    @unary
    async def GetWorker(self, request: pb.GetWorkerRequest, context: Ctx) -> pb.GetWorkerResponse:
        worker = await self.store.get_worker(request.worker_id)
        resp = pb.GetWorkerResponse()
        convert.worker_to_pb(worker, resp.worker)
        return resp

    @unary
    async def ListWorkers(self, request: pb.ListWorkersRequest, context: Ctx) -> pb.ListWorkersResponse:
        page = await self.store.list_workers(
            statuses=list(request.statuses),
            worker_id_contains=request.worker_id_contains,
            page_size=request.page_size,
            page_token=request.page_token,
            order_by=request.order_by,
            descending=_descending(request.order),
        )
        resp = pb.ListWorkersResponse(next_page_token=page.next_page_token, total_size=page.total_size)
        for w in page.items:
            convert.worker_to_pb(w, resp.workers.add())
        return resp

    # ------------------------------------------------------------ waiting
    @unary
    async def WaitForRollouts(
        self, request: pb.WaitForRolloutsRequest, context: Ctx
    ) -> pb.WaitForRolloutsResponse:
        wait = self._bounded_wait(request, "timeout", context)
        rollouts = await self.store.wait_for_rollouts(list(request.rollout_ids), wait)
        resp = pb.WaitForRolloutsResponse()
        for r in rollouts:
            convert.rollout_to_pb(r, resp.rollouts.add())
        return resp

    @streaming
    async def WatchRollouts(
        self, request: pb.WatchRolloutsRequest, context: Ctx
    ) -> AsyncIterator[pb.WatchRolloutsResponse]:
        events = self.store.watch_rollouts(
            request.resume_token,
            list(request.rollout_ids),
            list(request.statuses),
            _wait(request, "progress_interval"),
        )
        async for event in events:
            resp = pb.WatchRolloutsResponse(resume_token=event.resume_token, revision=event.revision)
            if event.rollout is not None:
                convert.rollout_to_pb(event.rollout, resp.rollout)
            yield resp

    # ------------------------------------------------------------ statistics and housekeeping
    @unary
    async def GetStatistics(self, request: pb.GetStatisticsRequest, context: Ctx) -> pb.GetStatisticsResponse:
        return statistics_to_pb(await self.store.statistics())

    @unary
    async def DeleteRollouts(
        self, request: pb.DeleteRolloutsRequest, context: Ctx
    ) -> pb.DeleteRolloutsResponse:
        before = convert.ts_to_float(request.finished_before) if request.HasField("finished_before") else None
        result = await self.store.delete_rollouts(list(request.rollout_ids), before)
        return pb.DeleteRolloutsResponse(
            deleted_rollouts=result.deleted_rollouts,
            deleted_attempts=result.deleted_attempts,
            deleted_spans=result.deleted_spans,
        )


#: The handlers a RunnerSession message is answered by: the RPCs' own, without the adapter around a call
#: (the session checks each message itself, and an error is the message's answer, not the stream's end).
_SESSION_HANDLERS: dict[str, Callable[[StoreServicer, Any, Ctx], Awaitable[Any]]] = {
    method: getattr(StoreServicer, method).__wrapped__ for method in SESSION_CALLS.values()
}

#: Methods whose requests are read through the wire views, and whose answers are already bytes.
RAW_REQUESTS = {
    "AddSpans": wire.AddSpansRequestRaw,
    "AddSpansStream": wire.SpanBatch,
    "CompleteAttempt": wire.CompleteAttemptRequestRaw,
    "RunnerSession": wire.RunnerSessionRequestRaw,
}
RAW_RESPONSES = {"ListSpans", "TailSpans"}


def add_store_service(servicer: StoreServicer, server: grpc.aio.Server) -> None:
    """Register StoreService, with the hot span paths kept as bytes."""
    register_service(
        pb.DESCRIPTOR.services_by_name["StoreService"],
        pb,
        servicer,
        server,
        raw_requests=RAW_REQUESTS,
        raw_responses=RAW_RESPONSES,
    )


__all__ = ["MAX_DURATION_SECONDS", "StoreServicer", "add_store_service", "check_duration"]
