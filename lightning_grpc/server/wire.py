"""Wire-level views of the span messages, for the hot paths of the Store.

A span batch arrives as ``AddSpansRequest`` (or with an attempt's outcome, ``CompleteAttemptRequest``,
on its own or inside a ``RunnerSessionRequest``); these messages read the same bytes with ``repeated Span
spans`` as ``repeated bytes`` (the wire format of an embedded message and of bytes is the same), so each
span's bytes can be stored exactly as the client sent them, without being serialized again. They are
copies of the contract's messages (see :func:`lightning_grpc.convert.framing.bytes_views`) in a private
descriptor pool. Reads are answered the same way: stored bytes with the store's ids appended, framed by
:mod:`lightning_grpc.convert.framing`.
"""

from __future__ import annotations

from typing import Any

from lightning_grpc.convert.framing import bytes_views, spans_message, stored_span
from lightning_grpc.v1 import store_service_pb2 as pb

_VIEWS = bytes_views(
    "lightning_grpc.wire",
    pb.AddSpansRequest.DESCRIPTOR,
    pb.AddSpansStreamRequest.DESCRIPTOR,
    pb.CompleteAttemptRequest.DESCRIPTOR,
    pb.RunnerSessionRequest.DESCRIPTOR,
)
AddSpansRequestRaw: Any = _VIEWS["AddSpansRequestRaw"]
AddSpansStreamRequestRaw: Any = _VIEWS["AddSpansStreamRequestRaw"]
CompleteAttemptRequestRaw: Any = _VIEWS["CompleteAttemptRequestRaw"]
#: Its complete_attempt is a CompleteAttemptRequestRaw.
RunnerSessionRequestRaw: Any = _VIEWS["RunnerSessionRequestRaw"]


class SpanBatch:
    """An AddSpansStreamRequest as it arrived: its bytes, and the same bytes read by its view (``view``).

    It reads as the view does (``batch.rollout_id``, ``batch.spans``...), and the batch's records are read
    from ``data`` as it is (``convert.span_records(..., stream_request=data)``), so no batch is built again
    from the spans to parse them. It stands for the request class where the server registers its
    deserializer (``FromString`` and ``DESCRIPTOR``, as a message class has).
    """

    __slots__ = ("data", "view")
    DESCRIPTOR = AddSpansStreamRequestRaw.DESCRIPTOR

    def __init__(self, data: bytes, view: Any) -> None:
        self.data = data
        self.view = view

    def __getattr__(self, name: str) -> Any:
        return getattr(self.view, name)

    @classmethod
    def FromString(cls, data: bytes) -> SpanBatch:
        return cls(data, AddSpansStreamRequestRaw.FromString(data))


__all__ = [
    "AddSpansRequestRaw",
    "AddSpansStreamRequestRaw",
    "CompleteAttemptRequestRaw",
    "RunnerSessionRequestRaw",
    "SpanBatch",
    "spans_message",
    "stored_span",
]
