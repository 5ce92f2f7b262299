"""OpenTelemetry OTLP/gRPC ``TraceService/Export`` on the Store's server: spans from any OTel SDK.

A thin receiver, like the StoreService servicer: each OTLP span becomes a serialized
``lightning.v1.Span`` (:func:`lightning_grpc.convert.spans.otlp_span_to_pb`; resource attributes in
``Span.resource``) and goes to :meth:`Store.add_spans`, one batch per rollout attempt. What is OTLP's
own stays here: attribution, and which spans are refused and why.

Attribution (see :mod:`lightning_grpc.semconv`): each of the rollout id and the attempt id is taken
from the span's attributes, else from its resource's attributes, else from the request's gRPC
metadata. Spans that cannot be stored for a reason of their own (no attribution, an unknown
attempt, malformed ids, too large) are counted in ``partial_success`` with the reasons, and the rest
of the request is stored; transient store failures end the call with their status (UNAVAILABLE)
so that exporters retry, which is safe because a resent span is stored once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_service
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.trace.v1 import trace_pb2 as otlp_trace

from lightning_grpc import convert, logs, semconv
from lightning_grpc.convert.spans import SCOPE_NAME, SCOPE_VERSION, MalformedIdError, otlp_span_to_pb
from lightning_grpc.convert.values import otlp_attributes_to_pb, otlp_value_to_pb
from lightning_grpc.errors import (
    InvalidArgumentError,
    LightningError,
    NotFoundError,
    ResourceExhaustedError,
)
from lightning_grpc.logs import clip
from lightning_grpc.store import SpanRecord, Store
from lightning_grpc.store.core import MAX_BATCH_SPANS
from lightning_grpc.v1 import common_pb2, span_pb2

from . import caller
from .handlers import ServicerState, Undecodable, unary

log = logs.get_logger(__name__)

Ctx = grpc.aio.ServicerContext[Any, Any]
TRACE_SERVICE = otlp_service.DESCRIPTOR.services_by_name["TraceService"].full_name

#: Requests larger than this (serialized) are converted in a worker thread.
THREAD_BYTES = 1024 * 1024
#: At most this many distinct reasons are spelled out in ``partial_success.error_message``.
MAX_REASONS = 10

_ATTRIBUTION_KEYS = (
    semconv.ROLLOUT_ID,
    semconv.ATTEMPT_ID,
    semconv.LEGACY_ROLLOUT_ID,
    semconv.LEGACY_ATTEMPT_ID,
)
_SPAN_PREFIX = re.compile(r"^spans\[\d+\][.\s]?")

UNATTRIBUTED = (
    f"had no {semconv.ROLLOUT_ID}/{semconv.ATTEMPT_ID} "
    f"(span or resource attribute, or {semconv.ROLLOUT_ID_HEADER}/{semconv.ATTEMPT_ID_HEADER} header)"
)
MALFORMED_IDS = "had malformed ids (trace id must be 16 bytes, span id 8, parent span id 8 or none)"
BAD_SEQUENCE_ID = f"had a {semconv.SPAN_SEQUENCE_ID} that is not a non-negative integer"

# ------------------------------------------------------------------ attribution


def _attribution(attributes: Mapping[str, common_pb2.AnyValue]) -> tuple[str, str]:
    present = {k: convert.any_to_python(attributes[k]) for k in _ATTRIBUTION_KEYS if k in attributes}
    return semconv.attribution(present) if present else ("", "")


def _first(*candidates: tuple[str, str]) -> tuple[str, str]:
    """Each id from the first source that names it."""
    rollout_id = next((c[0] for c in candidates if c[0]), "")
    attempt_id = next((c[1] for c in candidates if c[1]), "")
    return rollout_id, attempt_id


def _header_attribution(context: Ctx) -> tuple[str, str]:
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if key in (semconv.ROLLOUT_ID_HEADER, semconv.ATTEMPT_ID_HEADER) and isinstance(value, str):
            found.setdefault(key, value.strip())
    return found.get(semconv.ROLLOUT_ID_HEADER, ""), found.get(semconv.ATTEMPT_ID_HEADER, "")


# ------------------------------------------------------------------ spans


class Rejected(Exception):
    """A span that cannot be stored, with the reason (a predicate: "had no ...")."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _sequence_id(attributes: Mapping[str, common_pb2.AnyValue]) -> int:
    if semconv.SPAN_SEQUENCE_ID not in attributes:
        return 0
    value = attributes[semconv.SPAN_SEQUENCE_ID]
    if value.WhichOneof("value") != "int_value" or value.int_value < 0:
        raise Rejected(BAD_SEQUENCE_ID)
    return value.int_value


def convert_span(src: otlp_trace.Span, scope: otlp_common.InstrumentationScope) -> span_pb2.Span:
    """An OTLP span as ours (:func:`~lightning_grpc.convert.spans.otlp_span_to_pb`), refused when its ids
    are malformed."""
    try:
        return otlp_span_to_pb(src, scope)
    except MalformedIdError:
        raise Rejected(MALFORMED_IDS) from None


def _record(span: span_pb2.Span, resource_bytes: bytes) -> SpanRecord:
    # A serialized Span followed by a serialized Span holding only the resource parses as one Span.
    return convert.span_record(span, span.SerializeToString() + resource_bytes)


class Rejections:
    """Counts of refused spans by reason, in the order the reasons were first met."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, count: int, why: str) -> None:
        why = clip(why)  # it may echo an id the exporter sent
        self.counts[why] = self.counts.get(why, 0) + count

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def message(self) -> str:
        reasons = list(self.counts.items())
        parts = [f"{n} {'span' if n == 1 else 'spans'} {why}" for why, n in reasons[:MAX_REASONS]]
        rest = reasons[MAX_REASONS:]
        if rest:
            parts.append(f"{sum(n for _, n in rest)} more spans for {len(rest)} other reasons")
        return "; ".join(parts)


Batches = dict[tuple[str, str], list[SpanRecord]]


def group_spans(
    request: otlp_service.ExportTraceServiceRequest, headers: tuple[str, str], rejections: Rejections
) -> Batches:
    """Convert and attribute every span of a request, grouped by (rollout id, attempt id)."""
    batches: Batches = {}
    for resource_spans in request.resource_spans:
        holder = span_pb2.Span()
        otlp_attributes_to_pb(resource_spans.resource.attributes, holder.resource)
        resource_bytes = holder.SerializeToString()
        from_resource = _attribution(holder.resource)
        for scope_spans in resource_spans.scope_spans:
            for src in scope_spans.spans:
                try:
                    span = convert_span(src, scope_spans.scope)
                    span.sequence_id = _sequence_id(span.attributes)
                except Rejected as exc:
                    rejections.add(1, exc.why)
                    continue
                key = _first(_attribution(span.attributes), from_resource, headers)
                if not key[0] or not key[1]:
                    rejections.add(1, UNATTRIBUTED)
                    continue
                span.rollout_id, span.attempt_id = key
                batches.setdefault(key, []).append(_record(span, resource_bytes))
    return batches


# ------------------------------------------------------------------ storing


def _unknown(rollout_id: str, attempt_id: str, exc: NotFoundError) -> str:
    if exc.reason == "ROLLOUT_NOT_FOUND":
        return f"named unknown rollout {rollout_id}"
    return f"named unknown attempt {attempt_id} of rollout {rollout_id}"


def _span_fault(exc: LightningError) -> bool:
    """Whether the store refused a batch for something about one of its spans."""
    if isinstance(exc, ResourceExhaustedError):
        return exc.reason == "SPAN_TOO_LARGE"
    return isinstance(exc, InvalidArgumentError)


def _lasting(exc: LightningError) -> bool:
    """Whether retrying the same spans cannot help (so they are reported, not retried)."""
    return exc.code_name in ("FAILED_PRECONDITION", "ALREADY_EXISTS", "OUT_OF_RANGE")


async def store_batch(
    store: Store, key: tuple[str, str], records: list[SpanRecord], rejections: Rejections
) -> None:
    """Store one attempt's spans, counting in ``rejections`` those the store refuses for good.

    When the store refuses the batch for one of its spans, the batch is halved until the culprits
    are alone, so that one bad span does not cost the others. Transient errors propagate.
    """
    try:
        await store.add_spans(records, *key)
    except NotFoundError as exc:
        rejections.add(len(records), _unknown(*key, exc))
    except LightningError as exc:
        if exc.transient:
            raise  # its status goes back to the exporter, which sends the request again
        if _span_fault(exc) and len(records) > 1:
            half = len(records) // 2
            await store_batch(store, key, records[:half], rejections)
            await store_batch(store, key, records[half:], rejections)
        elif _span_fault(exc) or _lasting(exc):
            rejections.add(len(records), _refusal(store, exc))
        else:
            raise


def _refusal(store: Store, exc: LightningError) -> str:
    if exc.reason == "SPAN_TOO_LARGE":
        return f"exceeded the store's limit of {store.max_span_bytes} bytes per span"
    return f"could not be stored: {_SPAN_PREFIX.sub('', exc.message)}"


class TraceServicer(ServicerState, otlp_grpc.TraceServiceServicer):
    """``opentelemetry.proto.collector.trace.v1.TraceService`` over the store core."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @unary
    async def Export(self, request: Any, context: Ctx) -> otlp_service.ExportTraceServiceResponse:
        """``request`` is the serialized request (see :func:`add_otlp_service`) or a parsed one."""
        rejections = Rejections()
        # spans that name no attempt are the caller's when it holds an attempt credential
        headers = _first(_header_attribution(context), caller.attempt_of_caller())
        if isinstance(request, bytes) and len(request) > THREAD_BYTES:
            # Converting is pure CPU and touches no store state: off the loop, other calls go on.
            batches = await asyncio.to_thread(decode_and_group, request, headers, rejections)
        else:
            batches = decode_and_group(request, headers, rejections)
        caller.authorize_spans(batches)  # every attempt named must be the caller's, before any is stored
        for key, records in batches.items():
            for start in range(0, len(records), MAX_BATCH_SPANS):
                await store_batch(self.store, key, records[start : start + MAX_BATCH_SPANS], rejections)
        response = otlp_service.ExportTraceServiceResponse()
        if rejections.total:
            response.partial_success.rejected_spans = rejections.total
            response.partial_success.error_message = rejections.message()
            log.warning(
                "event=otlp_spans_rejected rejected=%d why=%r", rejections.total, rejections.message()
            )
        return response


def decode_and_group(request: Any, headers: tuple[str, str], rejections: Rejections) -> Batches:
    if isinstance(request, bytes):
        request = parse_request(request)
    return group_spans(request, headers, rejections)


def parse_request(data: bytes) -> otlp_service.ExportTraceServiceRequest:
    try:
        return otlp_service.ExportTraceServiceRequest.FromString(data)
    except DecodeError:
        raise Undecodable(otlp_service.ExportTraceServiceRequest.DESCRIPTOR.full_name).error() from None


def add_otlp_service(servicer: TraceServicer, server: grpc.aio.Server) -> None:
    """Register TraceService as the generated helper does, but parse requests in the handler.

    An undecodable request then answers INVALID_ARGUMENT rather than gRPC's UNKNOWN.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, otlp_service.ExportTraceServiceResponse]] = {
        "Export": grpc.unary_unary_rpc_method_handler(
            servicer.Export,
            request_deserializer=None,
            response_serializer=otlp_service.ExportTraceServiceResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TRACE_SERVICE, handlers),))
    server.add_registered_method_handlers(TRACE_SERVICE, handlers)


#: The OTLP value conversion, under the name this module gave it.
convert_value = otlp_value_to_pb

__all__ = [
    "SCOPE_NAME",
    "SCOPE_VERSION",
    "TRACE_SERVICE",
    "TraceServicer",
    "add_otlp_service",
    "convert_span",
    "convert_value",
]
