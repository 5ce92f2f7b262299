"""Robustness of the server's wire: the boundary cases of tests/store/test_store_robustness.py that
the gRPC layer decides (bytes that are no valid message, waits against the caller's deadline), against
an in-process server of each backend.
"""

from __future__ import annotations

from typing import Any

import grpc

from lightning_grpc.server.app import RunningServer
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc
from tests import robustness_helpers
from tests.conftest import every_store_backend  # noqa: F401  (runs on PostgreSQL too)
from tests.robustness_helpers import (
    INVALID,
    OK,
    TRACE_ID,
    outcome,
    started_attempt,
)

# The in-process server of each backend, with the small span limit, and a raw stub to it.
server_config = robustness_helpers.server_config
stub = robustness_helpers.stub


async def test_out_of_range_waits_are_refused_whatever_the_deadline(stub: Any) -> None:
    """The contract's limits on a wait (0..3600 s) do not depend on whether the caller set a deadline."""
    failures = []
    for method in ("DequeueRollouts", "WaitForRollouts"):
        for wait in [(-1, 0), (0, -1), (3601, 0)]:
            if method == "DequeueRollouts":
                request: Any = pb.DequeueRolloutsRequest()
                request.wait_timeout.seconds, request.wait_timeout.nanos = wait
            else:
                request = pb.WaitForRolloutsRequest()
                request.timeout.seconds, request.timeout.nanos = wait
            without, _ = await outcome(getattr(stub, method)(request))
            with_deadline, _ = await outcome(getattr(stub, method)(request, timeout=1))
            if (without, with_deadline) != (INVALID, INVALID):
                failures.append(
                    f"{method} waiting {wait}: {without} without a deadline, {with_deadline} with one"
                )
    assert not failures, "\n".join(failures)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes([tag]) + _varint(len(payload)) + payload


def _deep_value(depth: int) -> bytes:
    value = _field(0x1A, b"x")  # Value.string_value
    for _ in range(depth):
        value = _field(0x32, _field(0x0A, value))  # Value.list_value.values[0]
    return value


def _span_bytes(**fields: Any) -> bytes:
    return span_pb2.Span(trace_id=TRACE_ID, **fields).SerializeToString()


MALFORMED_SPANS = {
    "truncated": _span_bytes(span_id="00000000000000d1", name="cut")[:-2],
    "bad-utf8-name": _span_bytes(span_id="00000000000000d2") + _field(0x3A, b"\xff\xfe"),
    "garbage-attributes": _span_bytes(span_id="00000000000000d3") + _field(0x62, b"\xff\xff\xff"),
    "bad-utf8-attribute": _span_bytes(span_id="00000000000000d4")
    + _field(0x62, _field(0x0A, b"k") + _field(0x12, _field(0x0A, b"\xc3\x28"))),
}


async def test_malformed_span_bytes_are_refused_and_never_stored(server: RunningServer) -> None:
    """A span whose bytes are not a valid ``lightning.v1.Span`` is INVALID_ARGUMENT (a refused batch
    on the stream, which goes on), is not stored, and never makes the rollout's spans unreadable."""
    failures = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.StoreServiceStub(channel)
        add_spans = channel.unary_unary("/lightning.v1.StoreService/AddSpans")
        stream = channel.stream_stream("/lightning.v1.StoreService/AddSpansStream")
        list_spans = channel.unary_unary("/lightning.v1.StoreService/ListSpans")
        for n, (case, body) in enumerate(MALFORMED_SPANS.items()):
            rid = f"ro-bytes-{n}"
            aid = await started_attempt(stub, rid)
            # AddSpansRequest: rollout_id = 1, attempt_id = 2, spans = 3.
            request = _field(0x0A, rid.encode()) + _field(0x12, aid.encode()) + _field(0x1A, body)
            code, _ = await outcome(add_spans(request, timeout=5))
            if code != INVALID:
                failures.append(f"AddSpans with a {case} span: {code}")
            # AddSpansStreamRequest: batch_id = 1, rollout_id = 2, attempt_id = 3, spans = 4.
            ids = _field(0x12, rid.encode()) + _field(0x1A, aid.encode())
            good = _span_bytes(span_id="00000000000000e1", name="fine")
            batches = [b"\x08\x01" + ids + _field(0x22, body), b"\x08\x02" + ids + _field(0x22, good)]
            acks: list[Any] = []

            async def read_acks(call: Any, into: list[Any] = acks) -> None:
                async for raw in call:
                    into.append(pb.AddSpansStreamResponse.FromString(raw))

            code, _ = await outcome(read_acks(stream(iter(batches), timeout=5)))
            if code != OK:
                failures.append(f"a {case} span ended the whole AddSpansStream with {code}")
            elif [(a.batch_id, a.error.code) for a in acks] != [(1, 3), (2, 0)]:
                failures.append(
                    f"AddSpansStream with a {case} span acknowledged {[(a.batch_id, a.error.code) for a in acks]}"
                )
            selector = pb.SpanSelector(rollout_id=rid)
            raw = await list_spans(pb.ListSpansRequest(selector=selector).SerializeToString(), timeout=5)
            try:
                listed = [s.span_id for s in pb.ListSpansResponse.FromString(raw).spans]
            except Exception as exc:
                failures.append(f"after a {case} span, ListSpans answers bytes no client can parse: {exc}")
                continue
            if listed not in ([], ["00000000000000e1"]):
                failures.append(f"after a {case} span, the rollout holds spans {listed}")
    assert not failures, "\n".join(failures)


async def test_undecodable_requests_are_invalid_argument(server: RunningServer) -> None:
    """Bytes that are not a request message are the client's mistake: INVALID_ARGUMENT with an
    ErrorInfo, not UNKNOWN or INTERNAL naming a Python exception class."""
    bodies = {
        "truncated": b"\x0a\xff\xff\xff\xff\x0f",
        "bad wire type": b"\x0b",
        "nested 120 deep": _field(0x0A, _field(0x0A, b"ro-deep") + _field(0x12, _deep_value(120))),
    }
    failures = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        enqueue = channel.unary_unary("/lightning.v1.StoreService/EnqueueRollouts")
        for case, body in bodies.items():
            code, _ = await outcome(enqueue(body, timeout=5))
            if code != INVALID:
                failures.append(f"EnqueueRollouts with {case} bytes: {code}")
        stub = pb_grpc.StoreServiceStub(channel)
        assert (await stub.GetStatistics(pb.GetStatisticsRequest())).total_rollouts == 0
    assert not failures, "\n".join(failures)
