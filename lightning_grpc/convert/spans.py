"""Spans: the domain :class:`~lightning_grpc.types.Span` and ``lightning.v1.Span``, and spans as stored."""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError

from lightning_grpc import types as t
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.store.state import SpanRecord
from lightning_grpc.v1 import span_pb2

from .values import attributes_from_pb, attributes_to_pb

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


# ------------------------------------------------------------------ spans as the store keeps them


def span_records(spans: Any) -> list[SpanRecord]:
    """Serialized spans as store records, each parsed in full so that only readable spans are stored.

    The stored body is the span exactly as received; its ids come from the parsed message.
    """
    parse = span_pb2.Span.FromString
    records = []
    for i, body in enumerate(spans):
        try:
            s = parse(body)
        except DecodeError:
            raise InvalidArgumentError(f"spans[{i}]", "is not a valid lightning.v1.Span") from None
        records.append(
            SpanRecord(
                s.rollout_id,
                s.attempt_id,
                s.span_id,
                s.trace_id,
                s.parent_span_id,
                s.name,
                s.start_time_unix_nano,
                s.end_time_unix_nano,
                body,
                s.sequence_id,
            )
        )
    return records
