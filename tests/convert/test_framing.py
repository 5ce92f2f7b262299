"""Every message framed by hand (lightning_grpc.convert.framing) against the generated classes of the contract:
the hand-framed bytes parse with them and equal what SerializeToString gives for the same message
(deterministic serialization throughout: a span's attributes are a map, whose order is otherwise free)."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError

from lightning_grpc import convert
from lightning_grpc.convert import framing
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.server import wire
from lightning_grpc.store.state import SpanRecord
from lightning_grpc.types import Span
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb

NUMBERS = [1, 5, 127, 128, 300, 16_383, 16_384, 2**31, 2**53 + 1, 2**63 - 1, 2**64 - 1]


def span(i: int, *, big: bool = False, **ids: object) -> span_pb2.Span:
    attributes = {"text": "x" * (70_000 if big else 10), "n": i, "ids": [1, 2, 3], "ünïcode": "✓"}
    return convert.span_to_pb(
        Span(
            trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", name=f"span-{i}", attributes=attributes, **ids
        )
    )


def test_varint_is_protobufs() -> None:
    for n in NUMBERS:
        assert pb.AddSpansStreamRequest(batch_id=n).SerializeToString(
            deterministic=True
        ) == b"\x08" + framing.varint(n)


def test_keys_are_those_of_the_generated_classes() -> None:
    assert span_pb2.Span(rollout_id="r").SerializeToString(deterministic=True)[:1] == framing.SPAN_ROLLOUT_ID
    assert span_pb2.Span(attempt_id="a").SerializeToString(deterministic=True)[:1] == framing.SPAN_ATTEMPT_ID
    assert (
        span_pb2.Span(sequence_id=7).SerializeToString(deterministic=True)
        == framing.SPAN_SEQUENCE_ID + b"\x07"
    )
    one = span(1)
    for response in (pb.ListSpansResponse(spans=[one]), pb.TailSpansResponse(spans=[one])):
        assert response.SerializeToString(deterministic=True).startswith(framing.SPANS_RESPONSE_SPANS)
    token = pb.ListSpansResponse(next_page_token="t").SerializeToString(deterministic=True)
    assert token.startswith(framing.LIST_SPANS_NEXT_PAGE_TOKEN)
    assert (
        pb.AddSpansStreamRequest(spans=[one])
        .SerializeToString(deterministic=True)
        .startswith(framing.STREAM_REQUEST_SPANS)
    )
    # The one-byte form the benchmarks use.
    assert framing.length_delimited(0x22, b"abc") == framing.delimited(framing.STREAM_REQUEST_SPANS, b"abc")


def test_a_key_is_refused_for_a_field_that_is_not_framed_by_hand() -> None:
    with pytest.raises(ValueError, match="not framed by hand"):
        framing.field_key(pb.AddSpansResponse.DESCRIPTOR, "sequence_ids")  # packed


@pytest.mark.parametrize("sequence_id", [0, 1, 300, 2**40])
def test_a_stored_span_parses_as_the_span_with_the_stores_ids(sequence_id: int) -> None:
    for body in (span(3), span(4, rollout_id="old", attempt_id="older", sequence_id=9), span_pb2.Span()):
        framed = framing.stored_span(body.SerializeToString(deterministic=True), "ro-ü", "at-1", sequence_id)
        expected = span_pb2.Span()
        expected.CopyFrom(body)
        expected.rollout_id, expected.attempt_id, expected.sequence_id = "ro-ü", "at-1", sequence_id
        assert span_pb2.Span.FromString(framed).SerializeToString(
            deterministic=True
        ) == expected.SerializeToString(deterministic=True)
    # With nothing before them the appended ids are in field order: byte for byte the same.
    alone = span_pb2.Span(rollout_id="ro", attempt_id="at", sequence_id=sequence_id)
    if sequence_id:
        assert framing.stored_span(b"", "ro", "at", sequence_id) == alone.SerializeToString(
            deterministic=True
        )


@pytest.mark.parametrize("token", ["", "next-page-ü"])
def test_a_spans_message_is_a_list_and_a_tail_spans_response(token: str) -> None:
    bodies = [span(i, big=(i == 2)) for i in range(5)]
    records = [
        SpanRecord(
            f"ro-{i}",
            f"at-{i}",
            b.span_id,
            b.trace_id,
            "",
            b.name,
            0,
            0,
            b.SerializeToString(deterministic=True),
            i + 1,
        )
        for i, b in enumerate(bodies)
    ]
    framed = framing.spans_message(records, token)
    assert wire.spans_message is framing.spans_message
    stored = []
    for i, b in enumerate(bodies):
        s = span_pb2.Span()
        s.CopyFrom(b)
        s.rollout_id, s.attempt_id, s.sequence_id = f"ro-{i}", f"at-{i}", i + 1
        stored.append(s)
    listed = pb.ListSpansResponse(spans=stored, next_page_token=token)
    assert pb.ListSpansResponse.FromString(framed).SerializeToString(
        deterministic=True
    ) == listed.SerializeToString(deterministic=True)
    if not token:
        tailed = pb.TailSpansResponse(spans=stored)
        assert pb.TailSpansResponse.FromString(framed).SerializeToString(
            deterministic=True
        ) == tailed.SerializeToString(deterministic=True)
    # Records whose bodies are empty frame to exactly the generated bytes.
    empty = [SpanRecord("ro", "at", "", "", "", "", 0, 0, b"", n) for n in NUMBERS[:4]]
    expected = pb.ListSpansResponse(
        spans=[span_pb2.Span(rollout_id="ro", attempt_id="at", sequence_id=n) for n in NUMBERS[:4]],
        next_page_token=token,
    )
    assert framing.spans_message(empty, token) == expected.SerializeToString(deterministic=True)


@pytest.mark.parametrize("batch_id", NUMBERS)
def test_a_stream_request_is_byte_for_byte_the_generated_one(batch_id: int) -> None:
    spans = [span(i, big=(i == 1)) for i in range(4)]
    framed = framing.stream_request(
        batch_id, "ro-ü", "at-1", [s.SerializeToString(deterministic=True) for s in spans]
    )
    expected = pb.AddSpansStreamRequest(batch_id=batch_id, rollout_id="ro-ü", attempt_id="at-1", spans=spans)
    assert framed == expected.SerializeToString(deterministic=True)
    assert pb.AddSpansStreamRequest.FromString(framed) == expected
    assert framing.stream_request(batch_id, "r", "a", []) == pb.AddSpansStreamRequest(
        batch_id=batch_id, rollout_id="r", attempt_id="a"
    ).SerializeToString(deterministic=True)


def test_the_bytes_views_read_the_contracts_messages_with_spans_as_bytes() -> None:
    spans = [span(i, big=(i == 0)) for i in range(3)]
    bodies = [s.SerializeToString(deterministic=True) for s in spans]
    for message, view, head in (
        (pb.AddSpansRequest, wire.AddSpansRequestRaw, {}),
        (pb.AddSpansStreamRequest, wire.AddSpansStreamRequestRaw, {"batch_id": 2**40}),
    ):
        original = message(rollout_id="ro-ü", attempt_id="at", spans=spans, **head).SerializeToString(
            deterministic=True
        )
        parsed = view.FromString(original)
        assert list(parsed.spans) == bodies
        assert (parsed.rollout_id, parsed.attempt_id) == ("ro-ü", "at")
        assert parsed.SerializeToString(deterministic=True) == original
        fields = {(f.name, f.number) for f in message.DESCRIPTOR.fields}
        assert {(f.name, f.number) for f in view.DESCRIPTOR.fields} == fields
    assert (
        wire.AddSpansStreamRequestRaw.FromString(framing.stream_request(3, "r", "a", bodies)).spans == bodies
    )
    batch = wire.SpanBatch.FromString(
        framing.stream_request(3, "r", "a", bodies)
    )  # AddSpansStream's requests
    assert batch.data == framing.stream_request(3, "r", "a", bodies)
    assert (batch.batch_id, batch.rollout_id, batch.attempt_id, list(batch.spans)) == (3, "r", "a", bodies)
    assert wire.SpanBatch.DESCRIPTOR is wire.AddSpansStreamRequestRaw.DESCRIPTOR


def test_the_complete_attempt_view_keeps_spans_as_bytes_and_reads_its_other_messages() -> None:
    spans = [span(i) for i in range(2)]
    request = pb.CompleteAttemptRequest(rollout_id="ro-1", attempt_id="at-1", status=3, spans=spans)
    request.metadata.update({"score": 0.5, "tags": ["a"]})
    request.dequeue_next.worker_id = "w-1"
    request.dequeue_next.wait_timeout.FromMilliseconds(250)
    original = request.SerializeToString(deterministic=True)
    parsed = wire.CompleteAttemptRequestRaw.FromString(original)
    assert list(parsed.spans) == [s.SerializeToString(deterministic=True) for s in spans]
    assert parsed.HasField("metadata") and parsed.HasField("dequeue_next")
    assert convert.struct_to_dict(parsed.metadata) == {"score": 0.5, "tags": ["a"]}
    assert parsed.dequeue_next.worker_id == "w-1"
    assert (parsed.dequeue_next.wait_timeout.seconds, parsed.dequeue_next.wait_timeout.nanos) == (
        0,
        250_000_000,
    )
    assert parsed.SerializeToString(deterministic=True) == original
    bare = wire.CompleteAttemptRequestRaw.FromString(
        pb.CompleteAttemptRequest(rollout_id="ro-1", attempt_id="at-1", status=3).SerializeToString()
    )
    assert not bare.HasField("metadata") and not bare.HasField("dequeue_next") and not bare.spans


# ------------------------------------------------------------------ the map-entry view the store parses spans with


def _views_maps(descriptor: Any, seen: set[str] | None = None) -> list[str]:
    """The map fields of a message and of every message it holds."""
    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return []
    seen.add(descriptor.full_name)
    maps = [
        f.full_name for f in descriptor.fields if f.message_type and f.message_type.GetOptions().map_entry
    ]
    for f in descriptor.fields:
        if f.message_type is not None:
            maps += _views_maps(f.message_type, seen)
    return maps


def _rich_span() -> span_pb2.Span:
    s = span(3)
    s.attributes["nested"].kvlist_value.values.add(key="inner").value.array_value.values.add(string_value="ü")
    s.resource["service.name"].string_value = "agent"
    s.events.add(name="tool", time_unix_nano=5).attributes["ok"].bool_value = True
    s.links.add(trace_id="ab" * 16, span_id="cd" * 8).attributes["w"].double_value = 0.5
    s.status.code = span_pb2.SPAN_STATUS_CODE_ERROR
    return s


def test_the_map_entry_view_reads_the_contracts_bytes_with_no_map_left() -> None:
    view = framing.map_entry_view(pb.AddSpansStreamRequest.DESCRIPTOR)
    assert _views_maps(pb.AddSpansStreamRequest.DESCRIPTOR)  # the contract's span has maps
    assert _views_maps(view.DESCRIPTOR) == []
    request = pb.AddSpansStreamRequest(
        batch_id=9, rollout_id="ro", attempt_id="at", spans=[_rich_span(), span(1)]
    )
    original = request.SerializeToString()
    parsed = view.FromString(original)
    assert parsed.SerializeToString() == original  # entries kept in the order they came: the very bytes
    for mine, theirs in zip(parsed.spans, request.spans, strict=True):
        assert (mine.span_id, mine.trace_id, mine.name, mine.status.code) == (
            theirs.span_id,
            theirs.trace_id,
            theirs.name,
            theirs.status.code,
        )
        assert {e.key for e in mine.attributes} == set(theirs.attributes)


def _parses(message: Any, body: bytes) -> bool:
    try:
        message.FromString(body)
    except DecodeError:
        return False
    return True


def test_the_map_entry_view_refuses_what_the_contract_refuses() -> None:
    view = framing.map_entry_view(span_pb2.Span.DESCRIPTOR)
    good = span(1).SerializeToString()
    entry = framing.length_delimited
    refused = {
        "truncated": good[:-2],
        "bad UTF-8 key": good + entry(0x62, entry(0x0A, b"\xff")),
        "bad UTF-8 value": good + entry(0x62, entry(0x0A, b"k") + entry(0x12, entry(0x0A, b"\xc3\x28"))),
        "bad UTF-8 in an event's attribute": good
        + entry(0x6A, entry(0x1A, entry(0x0A, b"k") + entry(0x12, entry(0x0A, b"\xe2\x82")))),
        "a value that is not a message": good + entry(0x62, entry(0x0A, b"k") + entry(0x12, b"\xff\xff")),
        "an entry cut short": good + entry(0x62, b"\x0a\x05ab"),
    }
    read = {
        f"{case}, by {who}": body
        for case, body in refused.items()
        for who, message in (("the contract", span_pb2.Span), ("the view", view))
        if _parses(message, body)
    }
    assert not read, f"spans read that should not be: {sorted(read)}"
    twice = good + entry(0x62, entry(0x0A, b"n") + entry(0x12, b"\x18\x07"))  # "n" again, int_value 7
    contract, mine = span_pb2.Span.FromString(twice), view.FromString(twice)
    assert contract.attributes["n"].int_value == 7
    last = [e.value.int_value for e in mine.attributes if e.key == "n"][-1]
    assert last == 7  # the last entry for a key is the one the contract's map keeps


def test_span_records_read_a_stream_request_as_they_read_its_spans() -> None:
    bodies = [
        _rich_span().SerializeToString(),
        span(1, rollout_id="ro-own", sequence_id=4).SerializeToString(),
    ]
    request = framing.stream_request(7, "ro", "at", bodies)
    from_spans, from_request = (
        convert.span_records(bodies),
        convert.span_records(bodies, stream_request=request),
    )
    assert from_request == from_spans
    assert [(r.span_id, r.rollout_id, r.sequence_id, r.body) for r in from_request] == [
        (f"{4:016x}", "", 0, bodies[0]),
        (f"{2:016x}", "ro-own", 4, bodies[1]),
    ]
    bad = [bodies[0], bodies[1][:-2]]
    for stream_request in (None, framing.stream_request(7, "ro", "at", bad)):
        with pytest.raises(InvalidArgumentError) as refused:
            convert.span_records(bad, stream_request=stream_request)
        assert refused.value.field == "spans[1]"
