"""Wire-level views of the span messages, for the hot paths of the Store.

A span batch arrives as ``AddSpansRequest``; these messages read the same bytes with
``repeated Span spans`` as ``repeated bytes`` (the wire format of an embedded message and of bytes
is the same), so each span's bytes can be stored exactly as the client sent them, without being
serialized again. They live in a private descriptor pool, outside the ``lightning.v1`` contract.
Reads are answered the same way: stored bytes with the store's ids appended.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from lightning_grpc.convert import length_delimited, varint

_F = descriptor_pb2.FieldDescriptorProto
_STRING, _BYTES, _INT64, _UINT64, _FIXED64 = (
    _F.TYPE_STRING,
    _F.TYPE_BYTES,
    _F.TYPE_INT64,
    _F.TYPE_UINT64,
    _F.TYPE_FIXED64,
)
_ONE, _MANY = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED

# Field numbers are those of lightning.v1.Span, AddSpansRequest and AddSpansStreamRequest.
_MESSAGES: dict[str, list[tuple[int, str, int, int]]] = {
    "AddSpansRequestRaw": [
        (1, "rollout_id", _STRING, _ONE),
        (2, "attempt_id", _STRING, _ONE),
        (3, "spans", _BYTES, _MANY),
    ],
    "AddSpansStreamRequestRaw": [
        (1, "batch_id", _UINT64, _ONE),
        (2, "rollout_id", _STRING, _ONE),
        (3, "attempt_id", _STRING, _ONE),
        (4, "spans", _BYTES, _MANY),
    ],
}


def _build() -> dict[str, Any]:
    file = descriptor_pb2.FileDescriptorProto(
        name="lightning_grpc/server/wire.proto", package="lightning_grpc.wire", syntax="proto3"
    )
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        for number, field_name, kind, label in fields:
            message.field.add(name=field_name, number=number, type=kind, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"lightning_grpc.wire.{name}"))
        for name in _MESSAGES
    }


_CLASSES = _build()
AddSpansRequestRaw: Any = _CLASSES["AddSpansRequestRaw"]
AddSpansStreamRequestRaw: Any = _CLASSES["AddSpansStreamRequestRaw"]


def stored_span(body: bytes, rollout_id: str, attempt_id: str, sequence_id: int) -> bytes:
    """A stored span body with the store's ids appended (in Protobuf the last value of a field wins)."""
    return (
        body
        + length_delimited(0x0A, rollout_id.encode())
        + length_delimited(0x12, attempt_id.encode())
        + b"\x18"
        + varint(sequence_id)
    )


def spans_message(records: Any, next_page_token: str = "") -> bytes:
    """Serialized ListSpansResponse / TailSpansResponse: ``repeated Span spans = 1`` (+ token = 2)."""
    parts = [
        length_delimited(0x0A, stored_span(r.body, r.rollout_id, r.attempt_id, r.sequence_id))
        for r in records
    ]
    if next_page_token:
        parts.append(length_delimited(0x12, next_page_token.encode()))
    return b"".join(parts)
