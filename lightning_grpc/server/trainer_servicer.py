"""TrainerService over gRPC: translate Protobuf <-> domain and call the trainer core. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from lightning_grpc import convert
from lightning_grpc.batching import BatchOptions, BuiltBatch, GroupSample, Layout, TrainerCore, pad
from lightning_grpc.batching.batches import SpanReader
from lightning_grpc.batching.tensors import chunk_bounds, row_bytes
from lightning_grpc.convert.trainer import aggregation_fallback_to_pb
from lightning_grpc.store import SpanSelection, Store
from lightning_grpc.types import RolloutMode, Span
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import trainer_service_pb2 as pb
from lightning_grpc.v1 import trainer_service_pb2_grpc as pb_grpc

from .handlers import ServicerState, register_service, streaming, unary

Ctx = grpc.aio.ServicerContext[Any, Any]
TRAINER_SERVICE = pb.DESCRIPTOR.services_by_name["TrainerService"].full_name


def span_reader(store: Store) -> SpanReader:
    """Reads an attempt's spans straight from the store core, as domain spans with the store's ids."""
    parse = span_pb2.Span.FromString

    async def read(rollout_id: str, attempt_id: str) -> list[Span]:
        selection = SpanSelection(rollout_id, attempt_id=attempt_id)
        spans: list[Span] = []
        token = ""
        while True:
            page = await store.list_spans(selection, page_size=10_000, page_token=token)
            for record in page.items:
                span = convert.span_from_pb(parse(record.body), numpy_arrays=True)
                span.rollout_id, span.attempt_id = record.rollout_id, record.attempt_id
                span.sequence_id = record.sequence_id
                spans.append(span)
            token = page.next_page_token
            if not token:
                return spans

    return read


def _mode(value: int) -> RolloutMode:
    try:
        return RolloutMode(value)
    except ValueError:
        return value  # type: ignore[return-value]  # the store answers INVALID_ARGUMENT naming the field


def _counts(counter: Mapping[str, int], out: Any) -> None:
    for reason, count in sorted(counter.items()):
        out.add(reason=reason, count=count)


def batch_messages(
    batch: BuiltBatch, *, carried_over: int, closed_by_deadline: bool, options: BatchOptions
) -> Iterator[pb.GetBatchResponse]:
    """A built batch as its stream: a header, then chunks of whole rows within the chunk size.

    Chunks are made one at a time, so the first is on its way while the next is built.
    """
    ragged = batch.ragged
    layout, pad_id = options.layout, options.pad_token_id
    widths = (int(ragged.prompt_lengths.max(initial=0)), int(ragged.response_lengths.max(initial=0)))
    sizes = row_bytes(ragged)
    if layout == Layout.PADDED:  # every row costs the padded widths, in the wire dtypes
        per_row = (widths[0] + widths[1]) * (4 * ragged.token_ids.dtype.itemsize + 8) + 160
        sizes = np.full(len(sizes), per_row)
    bounds = chunk_bounds(sizes, options.max_chunk_bytes - 4096)
    header = pb.BatchHeader(
        batch_id=batch.batch_id,
        group_ids=batch.group_ids,
        row_count=batch.row_count,
        carried_over_groups=carried_over,
        closed_by_deadline=closed_by_deadline,
        trajectory_breaks=batch.trajectory_breaks,
        layout=int(layout),  # type: ignore[arg-type]
        pad_token_id=pad_id,
        chunk_count=len(bounds),
        prompt_length=widths[0],
        response_length=widths[1],
    )
    for r in batch.rollouts:
        header.rollouts.add(
            rollout_id=r.rollout_id,
            attempt_id=r.attempt_id,
            group_id=r.group_id,
            status=int(r.status),
            reward=r.reward,
            filled=r.filled,
            row_count=r.row_count,
        )
    _counts(batch.drops, header.drops)
    _counts(batch.fallbacks, header.fallbacks)
    calls = np.concatenate(([0], np.cumsum(ragged.calls_per_row, dtype=np.int64))).tolist()
    for i, (start, stop) in enumerate(bounds):
        msg = pb.GetBatchResponse(
            row_offset=start,
            call_span_ids=batch.call_span_ids[calls[start] : calls[stop]],
            call_policy_versions=batch.call_policy_versions[calls[start] : calls[stop]],
        )
        if i == 0:
            msg.header.CopyFrom(header)
        part = ragged.row_slice(start, stop)
        arrays = part.arrays()
        if layout == Layout.PADDED:
            arrays = pad(
                part,
                pad_token_id=pad_id,
                prompt_length=widths[0],
                response_length=widths[1],
                ids_dtype=ragged.token_ids.dtype,
            )
        for name, array in arrays.items():
            convert.tensor_to_pb(array, msg.tensors[name])
        yield msg


class TrainerServicer(ServicerState, pb_grpc.TrainerServiceServicer):
    def __init__(self, core: TrainerCore) -> None:
        self.core = core

    @unary
    async def SubmitGroups(self, request: pb.SubmitGroupsRequest, context: Ctx) -> pb.SubmitGroupsResponse:
        samples = [
            GroupSample(
                input=convert.value_to_python(s.input) if s.HasField("input") else None,
                group_id=s.group_id,
                metadata=convert.struct_to_dict(s.metadata),
            )
            for s in request.samples
        ]
        groups = await self.core.submit_groups(
            samples,
            request.group_size,
            mode=_mode(request.mode),
            resources_id=request.resources_id,
            config=convert.config_from_pb(request.config) if request.HasField("config") else None,
            step=request.step,
        )
        resp = pb.SubmitGroupsResponse()
        for g in groups:
            resp.groups.add(group_id=g.group_id, rollout_ids=g.rollout_ids)
        return resp

    @streaming
    async def GetBatch(self, request: pb.GetBatchRequest, context: Ctx) -> AsyncIterator[pb.GetBatchResponse]:
        options = convert.batch_options_from_pb(request.options)
        wait = convert.duration_to_float(request.wait) if request.HasField("wait") else 0.0
        wait = self.core.store.check_wait(wait, "wait")
        remaining = context.time_remaining()
        if remaining is not None:
            wait = max(0.0, min(wait, remaining - 0.05))
        result = await self.core.get_batch(
            request_id=request.request_id,
            mode=_mode(request.mode),
            min_groups=request.min_groups,
            max_groups=request.max_groups,
            wait=wait,
            options=options,
        )
        for message in batch_messages(
            result.batch,
            carried_over=result.carried_over_groups,
            closed_by_deadline=result.closed_by_deadline,
            options=options,
        ):
            yield message

    @unary
    async def ReportStep(self, request: pb.ReportStepRequest, context: Ctx) -> pb.ReportStepResponse:
        event = await self.core.report_step(
            request.run_id,
            request.step,
            request.policy_version,
            dict(request.metrics),
            [convert.run_interruption_from_pb(i) for i in request.interruptions],
        )
        resp = pb.ReportStepResponse()
        convert.training_event_to_pb(event, resp.event)
        return resp

    @streaming
    async def WatchTraining(
        self, request: pb.WatchTrainingRequest, context: Ctx
    ) -> AsyncIterator[pb.WatchTrainingResponse]:
        async for event in self.core.watch_training(request.run_id, request.after_sequence, request.follow):
            resp = pb.WatchTrainingResponse()
            convert.training_event_to_pb(event, resp.event)
            yield resp

    @unary
    async def GetTrainerStatus(
        self, request: pb.GetTrainerStatusRequest, context: Ctx
    ) -> pb.GetTrainerStatusResponse:
        status = self.core.status()
        resp = pb.GetTrainerStatusResponse(
            batches=status.batches, rows=status.rows, policy_version=status.policy_version
        )
        for c in status.groups:
            resp.groups.add(
                mode=int(c.mode),
                pending=c.pending,
                ready=c.ready,
                carried_over=c.carried_over,
                consumed=c.consumed,
            )
        _counts(status.drops, resp.drops)
        _counts(status.fallbacks, resp.fallbacks)
        if status.last_event is not None:
            convert.training_event_to_pb(status.last_event, resp.last_event)
        return resp

    @unary
    async def GetTriplets(self, request: pb.GetTripletsRequest, context: Ctx) -> pb.GetTripletsResponse:
        options = convert.batch_options_from_pb(request.options)
        found = await self.core.inspect(request.rollout_id, options)
        rollout, triplets = found.rollout, found.triplets
        resp = pb.GetTripletsResponse(
            rollout_id=rollout.rollout_id,
            attempt_id=rollout.latest_attempt.attempt_id if rollout.latest_attempt else "",
            status=int(rollout.status),  # type: ignore[arg-type]
            calls=triplets.calls,
        )
        if triplets.reward is not None:
            resp.reward = triplets.reward
        for t in triplets.triplets:
            m = resp.triplets.add(
                prompt_ids=t.prompt_ids.tolist(),
                response_ids=t.response_ids.tolist(),
                span_id=t.span_id,
                response_id=t.response_id,
                model=t.model,
                policy_version=t.policy_version,
                call_index=t.call_index,
                agent_name=t.agent_name,
                finish_reason=t.finish_reason,
                streamed=t.streamed,
                forced_positions=t.forced_positions.tolist(),
            )
            if t.logprobs is not None:
                m.log_probs.extend(t.logprobs.tolist())
            if t.reward is not None:
                m.reward = t.reward
            if t.temperature is not None:
                m.temperature = t.temperature
            if t.top_p is not None:
                m.top_p = t.top_p
        for d in triplets.drops:
            resp.drops.add(
                reason=str(getattr(d.reason, "value", d.reason)),
                span_id=d.span_id,
                call_index=d.call_index,
                detail=d.detail,
            )
        for row in found.rows.rows:
            resp.rows.add(
                turn_index=row.turn_index,
                policy_versions=row.policy_versions,
                has_log_probs=row.logprobs is not None,
                call_span_ids=row.call_span_ids,
            )
            resp.row_prompt_lengths.append(len(row.prompt_ids))
            resp.row_response_lengths.append(len(row.response_ids))
            resp.row_trainable_tokens.append(int(row.response_mask.sum()))
        if found.rows.fallback is not None:
            aggregation_fallback_to_pb(found.rows.fallback, resp.aggregation_fallback)
        return resp


def add_trainer_service(servicer: TrainerServicer, server: grpc.aio.Server) -> None:
    register_service(pb.DESCRIPTOR.services_by_name["TrainerService"], pb, servicer, server)


__all__ = ["TRAINER_SERVICE", "TrainerServicer", "add_trainer_service", "batch_messages", "span_reader"]
