"""Protobuf framing by hand, for the hot span paths that splice serialized spans without parsing them.

A serialized span is passed on as the bytes it arrived as: into a stored body, a span batch on the
stream, a ListSpans/TailSpans answer. Every field key used for that is computed here once, at import,
from the generated descriptors of the contract (``lightning.v1``), so the framing follows the contract
and a field whose number or type changes cannot be framed wrongly. ``tests/convert/test_framing.py`` checks
every hand-framed message against the generated classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as store_pb

_F = FieldDescriptor
_LENGTH_DELIMITED = frozenset({_F.TYPE_STRING, _F.TYPE_BYTES, _F.TYPE_MESSAGE})
_FIXED64 = frozenset({_F.TYPE_DOUBLE, _F.TYPE_FIXED64, _F.TYPE_SFIXED64})
_FIXED32 = frozenset({_F.TYPE_FLOAT, _F.TYPE_FIXED32, _F.TYPE_SFIXED32})


def varint(n: int) -> bytes:
    """A non-negative integer in Protobuf's varint encoding."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def field_key(message: Descriptor, name: str) -> bytes:
    """The encoded key (field number and wire type) of one field of a message, from its descriptor."""
    field = message.fields_by_name[name]
    if field.type in _LENGTH_DELIMITED:
        wire_type = 2
    elif field.is_repeated or field.type == _F.TYPE_GROUP:
        raise ValueError(f"{message.full_name}.{name} is not framed by hand (packed or group)")
    elif field.type in _FIXED64:
        wire_type = 1
    elif field.type in _FIXED32:
        wire_type = 5
    else:
        wire_type = 0
    return varint(field.number << 3 | wire_type)


def delimited(key: bytes, data: bytes) -> bytes:
    """A length-delimited field (string, bytes or embedded message) carrying ``data``."""
    return key + varint(len(data)) + data


def length_delimited(tag: int, data: bytes) -> bytes:
    """A length-delimited field whose key is one byte (``tag``, e.g. 0x0A for field 1) carrying ``data``."""
    return bytes((tag,)) + varint(len(data)) + data


# ------------------------------------------------------------------ the keys, once

_SPAN = span_pb2.Span.DESCRIPTOR
#: lightning.v1.Span: the ids the Store appends to a stored body.
SPAN_ROLLOUT_ID = field_key(_SPAN, "rollout_id")
SPAN_ATTEMPT_ID = field_key(_SPAN, "attempt_id")
SPAN_SEQUENCE_ID = field_key(_SPAN, "sequence_id")
#: ListSpansResponse and TailSpansResponse: ``repeated Span spans`` (the same key in both).
SPANS_RESPONSE_SPANS = field_key(store_pb.ListSpansResponse.DESCRIPTOR, "spans")
LIST_SPANS_NEXT_PAGE_TOKEN = field_key(store_pb.ListSpansResponse.DESCRIPTOR, "next_page_token")
LIST_SPANS_TOTAL_SIZE = field_key(store_pb.ListSpansResponse.DESCRIPTOR, "total_size")
#: AddSpansStreamRequest: ``repeated Span spans``.
STREAM_REQUEST_SPANS = field_key(store_pb.AddSpansStreamRequest.DESCRIPTOR, "spans")

if field_key(store_pb.TailSpansResponse.DESCRIPTOR, "spans") != SPANS_RESPONSE_SPANS:
    raise ImportError("ListSpansResponse.spans and TailSpansResponse.spans differ; spans_message serves both")


# ------------------------------------------------------------------ messages


def stored_span(body: bytes, rollout_id: str, attempt_id: str, sequence_id: int) -> bytes:
    """A stored span body with the Store's ids appended (in Protobuf the last value of a field wins)."""
    return (
        body
        + delimited(SPAN_ROLLOUT_ID, rollout_id.encode())
        + delimited(SPAN_ATTEMPT_ID, attempt_id.encode())
        + SPAN_SEQUENCE_ID
        + varint(sequence_id)
    )


def spans_message(records: Any, next_page_token: str = "", total_size: int = 0) -> bytes:
    """A serialized ListSpansResponse / TailSpansResponse of stored spans (``records``: SpanRecords).

    ``total_size`` is ListSpansResponse's (leave it 0 for TailSpansResponse, which has no such field).
    """
    parts = [
        delimited(SPANS_RESPONSE_SPANS, stored_span(r.body, r.rollout_id, r.attempt_id, r.sequence_id))
        for r in records
    ]
    if next_page_token:
        parts.append(delimited(LIST_SPANS_NEXT_PAGE_TOKEN, next_page_token.encode()))
    if total_size:
        parts.append(LIST_SPANS_TOTAL_SIZE + varint(total_size))
    return b"".join(parts)


def stream_request(batch_id: int, rollout_id: str, attempt_id: str, spans: Sequence[bytes]) -> bytes:
    """A serialized AddSpansStreamRequest of serialized ``lightning.v1.Span`` messages."""
    head = store_pb.AddSpansStreamRequest(batch_id=batch_id, rollout_id=rollout_id, attempt_id=attempt_id)
    return head.SerializeToString() + b"".join([delimited(STREAM_REQUEST_SPANS, s) for s in spans])


# ------------------------------------------------------------------ views that keep spans as bytes


def bytes_views(package: str, *messages: Descriptor, field: str = "spans") -> dict[str, Any]:
    """Copies of messages of the contract that read one repeated message field as ``repeated bytes``.

    The wire format of an embedded message and of bytes is the same, so a view parses the very bytes
    of the original message, leaving each embedded message serialized. The views live in a private
    descriptor pool (``package``), outside the ``lightning.v1`` contract; each is named after its
    message with ``Raw`` appended. Their other fields are read as the contract declares them: a message
    field is parsed into a copy of its message held in the same private pool, or into its view when its
    message is one of ``messages`` (a RunnerSessionRequest's CompleteAttemptRequest keeps its spans as bytes).
    """
    file = descriptor_pb2.FileDescriptorProto(
        name=f"{package.replace('.', '/')}.proto", package=package, syntax="proto3"
    )
    pool = descriptor_pool.DescriptorPool()
    viewed = {f".{m.full_name}": f".{package}.{m.name}Raw" for m in messages}
    for message in messages:
        _add_with_dependencies(pool, message.file)
        if message.file.name not in file.dependency:
            file.dependency.append(message.file.name)
        view = file.message_type.add()
        message.CopyToProto(view)
        view.name = f"{message.name}Raw"
        for f in view.field:
            if f.name == field:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                f.ClearField("type_name")
            elif f.type_name in viewed:
                f.type_name = viewed[f.type_name]
    pool.Add(file)
    return {
        f"{m.name}Raw": message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{m.name}Raw"))
        for m in messages
    }


def _add_with_dependencies(
    pool: descriptor_pool.DescriptorPool,
    file: FileDescriptor,
    change: Callable[[descriptor_pb2.FileDescriptorProto], None] | None = None,
) -> None:
    """Add ``file`` to ``pool`` after the files it imports, each once, each changed by ``change`` if given."""
    try:
        pool.FindFileByName(file.name)
        return
    except KeyError:
        pass
    for dependency in file.dependencies:
        _add_with_dependencies(pool, dependency, change)
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    if change is not None:
        change(proto)
    pool.Add(proto)


# ------------------------------------------------------------------ views that read maps as their entries


def map_entry_view(message: Descriptor) -> Any:
    """A copy of ``message`` whose map fields (its own and those of every message it holds) are read as
    the repeated entry messages they are on the wire.

    A map and ``repeated`` of its entry message have the same wire format, so the view accepts exactly the
    bytes the contract's message accepts, every nested field parsed and checked as the contract declares
    it (UTF-8 strings included), without building a hash table for each map. It is for checking that a message
    parses and reading its plain fields; a map's last entry for a key is the one the contract would keep.
    The view and copies of the files it depends on live in a private descriptor pool under their own names.
    """
    pool = descriptor_pool.DescriptorPool()
    _add_with_dependencies(pool, message.file, _entries_not_maps)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(message.full_name))


def _entries_not_maps(proto: descriptor_pb2.FileDescriptorProto) -> None:
    pending = list(proto.message_type)
    while pending:
        m = pending.pop()
        if m.options.map_entry:
            m.options.ClearField("map_entry")
        pending.extend(m.nested_type)
