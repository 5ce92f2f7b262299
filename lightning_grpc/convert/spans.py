"""Spans: every shape a span arrives in becomes a ``lightning.v1.Span`` here, and spans as the Store keeps them.

- the domain :class:`~lightning_grpc.types.Span` <-> ``lightning.v1.Span`` (clients, the proxy);
- an OpenTelemetry SDK span -> ``lightning.v1.Span`` (the span processor of :mod:`lightning_grpc.tracing`);
- an OTLP span -> ``lightning.v1.Span`` (the OTLP receiver, :mod:`lightning_grpc.server.otlp`, which
  attributes spans to attempts and reports the ones it refuses);
- serialized spans -> the Store's records.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.trace.v1 import trace_pb2 as otlp_trace
from opentelemetry.trace import SpanKind, StatusCode

from lightning_grpc import types as t
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.store.state import SpanRecord
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as store_pb

from .framing import bytes_views, map_entry_view
from .values import attributes_from_pb, attributes_to_pb, otlp_attributes_to_pb

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

# ------------------------------------------------------------------ domain spans


def span_to_pb(s: t.Span, out: span_pb2.Span | None = None) -> span_pb2.Span:
    m = out if out is not None else span_pb2.Span()
    m.rollout_id = s.rollout_id
    m.attempt_id = s.attempt_id
    m.sequence_id = s.sequence_id
    m.trace_id = s.trace_id
    m.span_id = s.span_id
    m.parent_span_id = s.parent_span_id
    m.name = s.name
    m.kind = s.kind  # type: ignore[assignment]
    m.start_time_unix_nano = s.start_time_unix_nano
    m.end_time_unix_nano = s.end_time_unix_nano
    if s.status_code or s.status_message:
        m.status.code = s.status_code  # type: ignore[assignment]
        m.status.message = s.status_message
    attributes_to_pb(s.attributes, m.attributes)
    for e in s.events:
        ev = m.events.add(name=e.name, time_unix_nano=e.time_unix_nano)
        attributes_to_pb(e.attributes, ev.attributes)
    for link in s.links:
        lk = m.links.add(trace_id=link.trace_id, span_id=link.span_id)
        attributes_to_pb(link.attributes, lk.attributes)
    attributes_to_pb(s.resource, m.resource)
    return m


def span_from_pb(m: span_pb2.Span, numpy_arrays: bool = False) -> t.Span:
    """A domain span; ``numpy_arrays`` keeps int and double array attributes (token ids) as numpy arrays."""
    return t.Span(
        trace_id=m.trace_id,
        span_id=m.span_id,
        name=m.name,
        rollout_id=m.rollout_id,
        attempt_id=m.attempt_id,
        sequence_id=m.sequence_id,
        parent_span_id=m.parent_span_id,
        kind=m.kind,
        start_time_unix_nano=m.start_time_unix_nano,
        end_time_unix_nano=m.end_time_unix_nano,
        status_code=m.status.code,
        status_message=m.status.message,
        attributes=attributes_from_pb(m.attributes, numpy_arrays),
        events=[t.SpanEvent(e.name, e.time_unix_nano, attributes_from_pb(e.attributes)) for e in m.events],
        links=[t.SpanLink(k.trace_id, k.span_id, attributes_from_pb(k.attributes)) for k in m.links],
        resource=attributes_from_pb(m.resource),
    )


# ------------------------------------------------------------------ OpenTelemetry SDK spans

_OTEL_KINDS = {
    SpanKind.INTERNAL: span_pb2.SPAN_KIND_INTERNAL,
    SpanKind.SERVER: span_pb2.SPAN_KIND_SERVER,
    SpanKind.CLIENT: span_pb2.SPAN_KIND_CLIENT,
    SpanKind.PRODUCER: span_pb2.SPAN_KIND_PRODUCER,
    SpanKind.CONSUMER: span_pb2.SPAN_KIND_CONSUMER,
}
_OTEL_STATUS = {
    StatusCode.UNSET: span_pb2.SPAN_STATUS_CODE_UNSPECIFIED,
    StatusCode.OK: span_pb2.SPAN_STATUS_CODE_OK,
    StatusCode.ERROR: span_pb2.SPAN_STATUS_CODE_ERROR,
}


def otel_span_to_pb(span: ReadableSpan, rollout_id: str, attempt_id: str) -> span_pb2.Span:
    """An OpenTelemetry SDK span, attributed to an attempt, as a ``lightning.v1.Span``."""
    ctx = span.context
    m = span_pb2.Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        trace_id=format(ctx.trace_id, "032x") if ctx else "",
        span_id=format(ctx.span_id, "016x") if ctx else "",
        parent_span_id=format(span.parent.span_id, "016x") if span.parent else "",
        name=span.name,
        kind=_OTEL_KINDS.get(span.kind, span_pb2.SPAN_KIND_UNSPECIFIED),
        start_time_unix_nano=span.start_time or 0,
        end_time_unix_nano=span.end_time or 0,
    )
    if span.status.status_code != StatusCode.UNSET or span.status.description:
        m.status.code = _OTEL_STATUS[span.status.status_code]
        m.status.message = span.status.description or ""
    if span.attributes:
        attributes_to_pb(span.attributes, m.attributes)
    for event in span.events:
        ev = m.events.add(name=event.name, time_unix_nano=event.timestamp or 0)
        if event.attributes:
            attributes_to_pb(event.attributes, ev.attributes)
    for link in span.links:
        lk = m.links.add(
            trace_id=format(link.context.trace_id, "032x"), span_id=format(link.context.span_id, "016x")
        )
        if link.attributes:
            attributes_to_pb(link.attributes, lk.attributes)
    if span.resource is not None and span.resource.attributes:
        attributes_to_pb(span.resource.attributes, m.resource)
    return m


# ------------------------------------------------------------------ OTLP spans

#: Span attributes that carry the instrumentation scope (OpenTelemetry's names for non-OTLP formats).
SCOPE_NAME = "otel.scope.name"
SCOPE_VERSION = "otel.scope.version"

_KIND_NAMES = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
_OTLP_KINDS = {
    otlp_trace.Span.SpanKind.Value(f"SPAN_KIND_{n}"): span_pb2.SpanKind.Value(f"SPAN_KIND_{n}")
    for n in _KIND_NAMES
}
_OTLP_STATUS = {
    otlp_trace.Status.STATUS_CODE_UNSET: span_pb2.SPAN_STATUS_CODE_UNSPECIFIED,
    otlp_trace.Status.STATUS_CODE_OK: span_pb2.SPAN_STATUS_CODE_OK,
    otlp_trace.Status.STATUS_CODE_ERROR: span_pb2.SPAN_STATUS_CODE_ERROR,
}


class MalformedIdError(ValueError):
    """An OTLP span whose trace id is not 16 bytes, span id not 8, or parent span id neither 8 nor none."""


def _hex_id(raw: bytes, size: int, optional: bool = False) -> str:
    if optional and (not raw or raw == bytes(size)):
        return ""
    if len(raw) != size or raw == bytes(size):
        raise MalformedIdError(raw.hex())
    return raw.hex()


def otlp_span_to_pb(src: otlp_trace.Span, scope: otlp_common.InstrumentationScope) -> span_pb2.Span:
    """An OTLP span as ours (ids as lowercase hex, the scope as attributes), not yet attributed to an
    attempt and without its resource. Raises :class:`MalformedIdError`."""
    span = span_pb2.Span(
        trace_id=_hex_id(src.trace_id, 16),
        span_id=_hex_id(src.span_id, 8),
        parent_span_id=_hex_id(src.parent_span_id, 8, optional=True),
        name=src.name,
        kind=_OTLP_KINDS.get(src.kind, span_pb2.SPAN_KIND_UNSPECIFIED),
        start_time_unix_nano=src.start_time_unix_nano,
        end_time_unix_nano=src.end_time_unix_nano,
    )
    if src.HasField("status"):
        span.status.code = _OTLP_STATUS.get(src.status.code, span_pb2.SPAN_STATUS_CODE_UNSPECIFIED)
        span.status.message = src.status.message
    otlp_attributes_to_pb(src.attributes, span.attributes)
    if scope.name and SCOPE_NAME not in span.attributes:
        span.attributes[SCOPE_NAME].string_value = scope.name
        if scope.version and SCOPE_VERSION not in span.attributes:
            span.attributes[SCOPE_VERSION].string_value = scope.version
    for event in src.events:
        converted = span.events.add(name=event.name, time_unix_nano=event.time_unix_nano)
        otlp_attributes_to_pb(event.attributes, converted.attributes)
    for link in src.links:
        # Link ids are kept whatever their length: the store does not index them.
        converted_link = span.links.add(trace_id=link.trace_id.hex(), span_id=link.span_id.hex())
        otlp_attributes_to_pb(link.attributes, converted_link.attributes)
    return span


# ------------------------------------------------------------------ spans as the store keeps them


#: A batch of spans parsed at once: a message of the contract with ``repeated Span spans``, read with its maps
#: as their entries (see :func:`.framing.map_entry_view`: it accepts the same bytes, in about two thirds of the
#: time for the attributes of an LLM call), and its copy that holds the same spans serialized (see
#: :func:`.framing.bytes_views`).
_Batch: Any = map_entry_view(store_pb.AddSpansStreamRequest.DESCRIPTOR)
_BatchOfBytes: Any = bytes_views("lightning_grpc.convert.batch", store_pb.AddSpansStreamRequest.DESCRIPTOR)[
    "AddSpansStreamRequestRaw"
]


def span_records(spans: Iterable[bytes], *, stream_request: bytes | None = None) -> list[SpanRecord]:
    """Serialized spans as store records, each parsed in full so that only readable spans are stored.

    The stored body is the span exactly as received; its ids come from the parsed message. The batch is
    parsed in one call (one call a span costs a fifth more): ``stream_request`` when the spans are those of
    that serialized AddSpansStreamRequest, else a batch built of them. A batch that does not parse is parsed
    again span by span, to name the span at fault.
    """
    bodies = list(spans)
    batch = stream_request if stream_request is not None else _BatchOfBytes(spans=bodies).SerializeToString()
    try:
        parsed: Any = _Batch.FromString(batch).spans
    except DecodeError:
        parsed = _each_span(bodies)
    return [span_record(s, body) for s, body in zip(parsed, bodies, strict=True)]


#: A span as the contract's message (``lightning.v1.Span``), for modules that hold one without importing the stubs.
SpanMessage = span_pb2.Span


def span_record(span: Any, body: bytes) -> SpanRecord:
    """The store record of a span whose message is ``span`` (a ``lightning.v1.Span``, parsed or built here) and
    whose serialized form is ``body``."""
    return SpanRecord(
        span.rollout_id,
        span.attempt_id,
        span.span_id,
        span.trace_id,
        span.parent_span_id,
        span.name,
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        body,
        span.sequence_id,
    )


def _each_span(bodies: list[bytes]) -> list[span_pb2.Span]:
    """The spans parsed one by one (INVALID_ARGUMENT naming the first that does not parse)."""
    parsed = []
    for i, body in enumerate(bodies):
        try:
            parsed.append(span_pb2.Span.FromString(body))
        except DecodeError:
            raise InvalidArgumentError(f"spans[{i}]", "is not a valid lightning.v1.Span") from None
    return parsed
