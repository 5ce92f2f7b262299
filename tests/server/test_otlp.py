"""OTLP/gRPC TraceService/Export on the Store's server: stock OpenTelemetry exporters, attribution,
partial success, size, auth, idempotent resends and errors on the wire."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_service
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.trace.v1 import trace_pb2 as otlp_trace

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from lightning_grpc.server.otlp import TRACE_SERVICE
from lightning_grpc.types import Span
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from tests.conftest import every_store_backend  # noqa: F401  (runs on PostgreSQL too)

# ------------------------------------------------------------------ a stock OpenTelemetry program
#: Runs in its own interpreter: only the OpenTelemetry SDK and its OTLP/gRPC exporter, configured
#: by the standard environment variables. Prints the exporter's results and the spans it sent.
EXPORTER_PROGRAM = r"""
import json
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, StatusCode


class Recording(SpanExporter):
    def __init__(self, inner):
        self.inner, self.results, self.spans = inner, [], []

    def export(self, spans):
        result = self.inner.export(spans)
        self.results.append(result.name)
        self.spans.extend(spans)
        return result

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis=30000):
        return self.inner.force_flush(timeout_millis)


recording = Recording(OTLPSpanExporter())
provider = TracerProvider()  # its resource comes from OTEL_RESOURCE_ATTRIBUTES
provider.add_span_processor(BatchSpanProcessor(recording))
tracer = provider.get_tracer("otlp-test-agent", "1.2.3")
with tracer.start_as_current_span("agent", kind=SpanKind.SERVER) as root:
    root.set_attribute("step", 7)
    with tracer.start_as_current_span("llm", kind=SpanKind.CLIENT) as llm:
        llm.set_attribute("lightning.llm.prompt_token_ids", [101, 2023, 102])
        llm.set_attribute("lightning.llm.response_logprobs", [-0.25, -1.5])
        llm.set_attribute("temperature", 0.7)
        llm.set_attribute("streamed", True)
        llm.set_attribute("tags", ["plan", "act"])
        llm.add_event("first_token", {"position": 1})
        with tracer.start_as_current_span("tool") as tool:
            tool.set_status(StatusCode.ERROR, "tool failed")
provider.force_flush()
provider.shutdown()
print(json.dumps({
    "results": recording.results,
    "spans": {
        s.name: {
            "trace_id": format(s.context.trace_id, "032x"),
            "span_id": format(s.context.span_id, "016x"),
            "parent_span_id": format(s.parent.span_id, "016x") if s.parent else "",
        }
        for s in recording.spans
    },
}))
"""


def otel_env(port: int, rollout_id: str, attempt_id: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_EXPORTER_OTLP_COMPRESSION="gzip",
        OTEL_EXPORTER_OTLP_TIMEOUT="10",
        OTEL_SERVICE_NAME="otlp-test",
        OTEL_RESOURCE_ATTRIBUTES=f"{semconv.ROLLOUT_ID}={rollout_id},{semconv.ATTEMPT_ID}={attempt_id}",
        **extra,
    )
    return env


async def run_exporter(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run the program in a subprocess without blocking the loop that serves it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        EXPORTER_PROGRAM,
        env=env,
        cwd=cwd,  # nothing of this project on its path
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    report["stderr"] = err.decode()
    return report


# ------------------------------------------------------------------ raw OTLP requests


def kv(key: str, value: Any) -> otlp_common.KeyValue:
    out = otlp_common.KeyValue(key=key)
    _set(out.value, value)
    return out


def _set(out: otlp_common.AnyValue, value: Any) -> None:
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, bytes):
        out.bytes_value = value
    elif isinstance(value, dict):
        out.kvlist_value.SetInParent()
        out.kvlist_value.values.extend(kv(k, v) for k, v in value.items())
    elif isinstance(value, list):
        out.array_value.SetInParent()
        for item in value:
            _set(out.array_value.values.add(), item)


def ids(rollout_id: str, attempt_id: str) -> dict[str, str]:
    return {semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id}


def otlp_span(
    name: str, attributes: dict[str, Any] | None = None, *, trace: bytes | None = None, **fields: Any
) -> otlp_trace.Span:
    span = otlp_trace.Span(
        trace_id=trace or uuid.uuid4().bytes,
        span_id=fields.pop("span_id", None) or uuid.uuid4().bytes[:8],
        name=name,
        start_time_unix_nano=1_700_000_000_000_000_000,
        end_time_unix_nano=1_700_000_000_500_000_000,
        **fields,
    )
    span.attributes.extend(kv(k, v) for k, v in (attributes or {}).items())
    return span


def resource_spans(spans: Sequence[otlp_trace.Span], resource: dict[str, Any] | None = None) -> Any:
    rs = otlp_trace.ResourceSpans()
    rs.resource.attributes.extend(kv(k, v) for k, v in (resource or {}).items())
    scope = rs.scope_spans.add()
    scope.scope.name = "raw-test"
    scope.spans.extend(spans)
    return rs


def export_request(*groups: Any) -> otlp_service.ExportTraceServiceRequest:
    return otlp_service.ExportTraceServiceRequest(resource_spans=list(groups))


@pytest_asyncio.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture
def trace_stub(channel: grpc.aio.Channel) -> otlp_grpc.TraceServiceStub:
    return otlp_grpc.TraceServiceStub(channel)


async def new_attempt(client: StoreClient) -> tuple[str, str]:
    rollout = await client.start_rollout({"task": uuid.uuid4().hex})
    assert rollout.latest_attempt is not None
    return rollout.rollout_id, rollout.latest_attempt.attempt_id


async def stored(client: StoreClient, rollout_id: str, attempt_id: str) -> dict[str, Span]:
    return {s.name: s for s in await client.query_spans(rollout_id, attempt_id)}


async def raw_spans(client: StoreClient, rollout_id: str, attempt_id: str) -> dict[str, span_pb2.Span]:
    selector = pb.SpanSelector(rollout_id=rollout_id, attempt_id=attempt_id)
    resp = await client.stub.ListSpans(pb.ListSpansRequest(selector=selector))
    return {s.name: s for s in resp.spans}


# ------------------------------------------------------------------ a stock SDK exporter


async def test_stock_sdk_exporter_configured_by_environment(
    server: RunningServer, client: StoreClient, tmp_path: Path
) -> None:
    rollout_id, attempt_id = await new_attempt(client)
    report = await run_exporter(otel_env(server.port, rollout_id, attempt_id), tmp_path)
    assert report["results"] == ["SUCCESS"], report["stderr"]
    sent = report["spans"]

    spans = await stored(client, rollout_id, attempt_id)
    assert sorted(spans) == ["agent", "llm", "tool"]
    for name, span in spans.items():
        assert (span.rollout_id, span.attempt_id) == (rollout_id, attempt_id)
        assert span.trace_id == sent[name]["trace_id"] and span.span_id == sent[name]["span_id"]
        assert span.parent_span_id == sent[name]["parent_span_id"]
        assert span.sequence_id > 0
        assert span.resource[semconv.ROLLOUT_ID] == rollout_id
        assert span.resource["service.name"] == "otlp-test"
        assert span.attributes["otel.scope.name"] == "otlp-test-agent"
        assert span.attributes["otel.scope.version"] == "1.2.3"
    agent, llm, tool = spans["agent"], spans["llm"], spans["tool"]
    assert agent.parent_span_id == "" and llm.parent_span_id == agent.span_id
    assert tool.parent_span_id == llm.span_id
    assert agent.trace_id == llm.trace_id == tool.trace_id
    assert len({s.sequence_id for s in spans.values()}) == 3
    assert agent.kind == span_pb2.SPAN_KIND_SERVER and llm.kind == span_pb2.SPAN_KIND_CLIENT
    assert tool.kind == span_pb2.SPAN_KIND_INTERNAL
    assert (tool.status_code, tool.status_message) == (span_pb2.SPAN_STATUS_CODE_ERROR, "tool failed")
    assert agent.start_time_unix_nano <= llm.start_time_unix_nano < llm.end_time_unix_nano
    assert agent.end_time_unix_nano > 1_600_000_000 * 10**9  # unix nanos, not rebased

    attrs = llm.attributes
    assert attrs[semconv.LLM_PROMPT_TOKEN_IDS] == [101, 2023, 102]
    assert attrs[semconv.LLM_RESPONSE_LOGPROBS] == [-0.25, -1.5]
    assert attrs["temperature"] == 0.7 and type(attrs["temperature"]) is float
    assert attrs["streamed"] is True and attrs["tags"] == ["plan", "act"]
    assert agent.attributes["step"] == 7 and type(agent.attributes["step"]) is int
    assert [(e.name, e.attributes) for e in llm.events] == [("first_token", {"position": 1})]

    raw = (await raw_spans(client, rollout_id, attempt_id))["llm"]
    assert raw.attributes[semconv.LLM_PROMPT_TOKEN_IDS].WhichOneof("value") == "int_array_value"
    assert raw.attributes[semconv.LLM_RESPONSE_LOGPROBS].WhichOneof("value") == "double_array_value"
    assert raw.attributes["temperature"].WhichOneof("value") == "double_value"
    assert raw.attributes["tags"].WhichOneof("value") == "array_value"


async def test_values_events_and_links_convert_without_loss(
    client: StoreClient, trace_stub: otlp_grpc.TraceServiceStub
) -> None:
    rollout_id, attempt_id = await new_attempt(client)
    linked_trace, linked_span = bytes(range(16)), bytes(range(8, 16))
    span = otlp_span(
        "values",
        {
            "nested": {"a": 1, "b": [True, "x", 2.5], "c": {"d": b"\x00\xff"}},
            "mixed": [1, 2.0],
            "empty": [],
            "negatives": [-1, 0, 2**62],
            semconv.SPAN_SEQUENCE_ID: 42,
        },
        kind=otlp_trace.Span.SPAN_KIND_PRODUCER,
        status=otlp_trace.Status(code=otlp_trace.Status.STATUS_CODE_OK),
        parent_span_id=bytes(8),  # all zeros: no parent
    )
    span.attributes.append(otlp_common.KeyValue(key="unset"))
    event = span.events.add(name="ev", time_unix_nano=1_700_000_000_100_000_000)
    event.attributes.append(kv("k", "v"))
    link = span.links.add(trace_id=linked_trace, span_id=linked_span)
    link.attributes.append(kv("why", "retry"))
    resp = await trace_stub.Export(export_request(resource_spans([span], ids(rollout_id, attempt_id))))
    assert not resp.HasField("partial_success")

    got = (await stored(client, rollout_id, attempt_id))["values"]
    assert got.sequence_id == 42 and got.parent_span_id == ""
    assert got.attributes["nested"] == {"a": 1, "b": [True, "x", 2.5], "c": {"d": b"\x00\xff"}}
    assert got.attributes["mixed"] == [1, 2.0] and got.attributes["empty"] == []
    assert got.attributes["negatives"] == [-1, 0, 2**62]
    assert got.attributes["unset"] is None
    assert got.kind == span_pb2.SPAN_KIND_PRODUCER and got.status_code == span_pb2.SPAN_STATUS_CODE_OK
    assert [(e.name, e.time_unix_nano, e.attributes) for e in got.events] == [
        ("ev", 1_700_000_000_100_000_000, {"k": "v"})
    ]
    assert [(k.trace_id, k.span_id, k.attributes) for k in got.links] == [
        (linked_trace.hex(), linked_span.hex(), {"why": "retry"})
    ]
    assert got.start_time_unix_nano == 1_700_000_000_000_000_000


# ------------------------------------------------------------------ attribution


async def test_span_attribute_beats_resource_attribute_beats_header(
    client: StoreClient, trace_stub: otlp_grpc.TraceServiceStub
) -> None:
    by_header, by_resource, by_span, by_legacy = [await new_attempt(client) for _ in range(4)]
    legacy = {semconv.LEGACY_ROLLOUT_ID: by_legacy[0], semconv.LEGACY_ATTEMPT_ID: by_legacy[1]}
    request = export_request(
        resource_spans(
            [otlp_span("span-wins", ids(*by_span)), otlp_span("resource-wins"), otlp_span("legacy", legacy)],
            ids(*by_resource),
        ),
        resource_spans([otlp_span("header-wins")]),
        # Each id is looked up on its own: the attempt from the span, the rollout from the resource.
        resource_spans(
            [otlp_span("mixed", {semconv.ATTEMPT_ID: by_span[1]})], {semconv.ROLLOUT_ID: by_span[0]}
        ),
    )
    headers = ((semconv.ROLLOUT_ID_HEADER, by_header[0]), (semconv.ATTEMPT_ID_HEADER, by_header[1]))
    resp = await trace_stub.Export(request, metadata=headers)
    assert not resp.HasField("partial_success"), resp

    assert sorted(await stored(client, *by_span)) == ["mixed", "span-wins"]
    assert sorted(await stored(client, *by_resource)) == ["resource-wins"]
    assert sorted(await stored(client, *by_header)) == ["header-wins"]
    assert sorted(await stored(client, *by_legacy)) == ["legacy"]


# ------------------------------------------------------------------ partial success


async def test_unattributable_and_unknown_spans_are_counted_and_the_rest_stored(
    client: StoreClient, trace_stub: otlp_grpc.TraceServiceStub
) -> None:
    rollout_id, attempt_id = await new_attempt(client)
    request = export_request(
        resource_spans([otlp_span("kept-1"), otlp_span("kept-2")], ids(rollout_id, attempt_id)),
        resource_spans([otlp_span(f"anonymous-{i}") for i in range(3)]),
        resource_spans([otlp_span("lost-attempt", ids(rollout_id, "at-x")) for _ in range(2)]),
        resource_spans([otlp_span("lost-rollout", ids("ro-nowhere", attempt_id))]),
        resource_spans(
            [
                otlp_span("short-id", span_id=b"\x01\x02\x03\x04"),
                otlp_span("zero-trace", trace=bytes(16)),
                otlp_span("bad-sequence", {semconv.SPAN_SEQUENCE_ID: "seven"}),
            ],
            ids(rollout_id, attempt_id),
        ),
    )
    resp = await trace_stub.Export(request)
    assert resp.partial_success.rejected_spans == 9
    message = resp.partial_success.error_message
    assert f"3 spans had no {semconv.ROLLOUT_ID}/{semconv.ATTEMPT_ID}" in message
    assert f"2 spans named unknown attempt at-x of rollout {rollout_id}" in message
    assert "1 span named unknown rollout ro-nowhere" in message
    assert "2 spans had malformed ids" in message
    assert f"1 span had a {semconv.SPAN_SEQUENCE_ID} that is not a non-negative integer" in message
    assert sorted(await stored(client, rollout_id, attempt_id)) == ["kept-1", "kept-2"]


async def test_a_span_the_store_refuses_costs_only_itself(tmp_path: Path) -> None:
    running = await start_server(ServerConfig(port=0, max_span_bytes=4096, grace=1.0))
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            rollout_id, attempt_id = await new_attempt(client)
            spans = [otlp_span(f"ok-{i}") for i in range(6)]
            spans.insert(2, otlp_span("too-big", {"blob": "x" * 10_000}))
            spans.append(otlp_span("seq-a", {semconv.SPAN_SEQUENCE_ID: 1000}))
            spans.append(otlp_span("seq-b", {semconv.SPAN_SEQUENCE_ID: 1000}))
            async with grpc.aio.insecure_channel(running.address) as ch:
                resp = await otlp_grpc.TraceServiceStub(ch).Export(
                    export_request(resource_spans(spans, ids(rollout_id, attempt_id)))
                )
            assert resp.partial_success.rejected_spans == 2, resp
            message = resp.partial_success.error_message
            assert "1 span exceeded the store's limit of 4096 bytes per span" in message
            assert "1 span could not be stored: sequence_id: 1000 is already used in attempt" in message
            names = await stored(client, rollout_id, attempt_id)
            assert sorted(names) == sorted([f"ok-{i}" for i in range(6)] + ["seq-a"])
            assert names["seq-a"].sequence_id == 1000
    finally:
        await running.stop()


# ------------------------------------------------------------------ size, auth, resends, errors


async def test_twenty_mebibyte_gzip_request(
    client: StoreClient, trace_stub: otlp_grpc.TraceServiceStub
) -> None:
    rollout_id, attempt_id = await new_attempt(client)
    trace = uuid.uuid4().bytes
    spans = [
        otlp_span(
            f"big-{i}",
            {"payload": uuid.uuid4().hex * 400, "token_ids": list(range(i, i + 256))},
            trace=trace,
        )
        for i in range(1700)
    ]
    request = export_request(resource_spans(spans, ids(rollout_id, attempt_id)))
    assert request.ByteSize() > 20 * 1024 * 1024
    resp = await trace_stub.Export(request, compression=grpc.Compression.Gzip, timeout=120)
    assert not resp.HasField("partial_success")
    assert (await client.statistics()).total_spans == 1700
    [one] = await client.query_spans(rollout_id, attempt_id, name="big-1699")
    assert one.attributes["token_ids"] == list(range(1699, 1955))
    assert len(one.attributes["payload"]) == 32 * 400


async def test_bearer_token_is_required_from_exporters(tmp_path: Path) -> None:
    running = await start_server(ServerConfig(port=0, token="tok", grace=1.0))
    try:
        async with StoreClient(f"127.0.0.1:{running.port}", token="tok") as client:
            rollout_id, attempt_id = await new_attempt(client)
            env = otel_env(running.port, rollout_id, attempt_id)
            refused = await run_exporter(env, tmp_path)
            assert refused["results"] == ["FAILURE"]
            assert await client.query_spans(rollout_id, attempt_id) == []
            env["OTEL_EXPORTER_OTLP_HEADERS"] = "authorization=Bearer%20tok"
            accepted = await run_exporter(env, tmp_path)
            assert accepted["results"] == ["SUCCESS"], accepted["stderr"]
            assert sorted(await stored(client, rollout_id, attempt_id)) == ["agent", "llm", "tool"]
    finally:
        await running.stop()


async def test_resending_an_export_stores_nothing_twice(
    client: StoreClient, trace_stub: otlp_grpc.TraceServiceStub
) -> None:
    rollout_id, attempt_id = await new_attempt(client)
    request = export_request(
        resource_spans(
            [otlp_span("a"), otlp_span("b"), otlp_span("numbered", {semconv.SPAN_SEQUENCE_ID: 50})],
            ids(rollout_id, attempt_id),
        )
    )
    first = await trace_stub.Export(request, compression=grpc.Compression.Gzip)
    before = await client.query_spans(rollout_id, attempt_id)
    second = await trace_stub.Export(request)
    after = await client.query_spans(rollout_id, attempt_id)
    assert not first.HasField("partial_success") and not second.HasField("partial_success")
    assert len(after) == 3 and after == before
    assert (await client.statistics()).total_spans == 3


async def test_malformed_and_empty_requests(client: StoreClient, channel: grpc.aio.Channel) -> None:
    export = channel.unary_unary(f"/{TRACE_SERVICE}/Export")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await export(b"\x0a\xff\xff\xff\xff\x0f")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ExportTraceServiceRequest" in (err.value.details() or "")
    empty = await otlp_grpc.TraceServiceStub(channel).Export(otlp_service.ExportTraceServiceRequest())
    assert not empty.HasField("partial_success")


async def test_a_closed_store_answers_unavailable_so_exporters_retry(tmp_path: Path) -> None:
    running = await start_server(ServerConfig(port=0, grace=1.0))
    try:
        async with StoreClient(running.address) as client:
            rollout_id, attempt_id = await new_attempt(client)
        await running.store.close()
        async with grpc.aio.insecure_channel(running.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await otlp_grpc.TraceServiceStub(ch).Export(
                    export_request(resource_spans([otlp_span("late")], ids(rollout_id, attempt_id)))
                )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop()


async def test_health_and_reflection_list_the_trace_service(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    assert TRACE_SERVICE == "opentelemetry.proto.collector.trace.v1.TraceService"
    assert TRACE_SERVICE in server.service_names
    health = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=TRACE_SERVICE)
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=TRACE_SERVICE)

    answers = [a async for a in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(ask())]
    assert TRACE_SERVICE in {s.name for s in answers[0].list_services_response.service}
    assert answers[1].file_descriptor_response.file_descriptor_proto
