"""Inputs an attacker on the same machine could send, through real servers: undecodable requests to every
RPC of every service, values that would flood the log, intervals that would flood a watcher."""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_service

from lightning_grpc import semconv
from lightning_grpc.logs import OneLineFormatter
from lightning_grpc.server.app import RunningServer, ServerConfig
from lightning_grpc.v1 import proxy_service_pb2, store_service_pb2, trainer_service_pb2
from tests.helpers import serving_with_proxy

SERVICES = (
    store_service_pb2.DESCRIPTOR.services_by_name["StoreService"],
    trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"],
    proxy_service_pb2.DESCRIPTOR.services_by_name["ProxyService"],
    otlp_service.DESCRIPTOR.services_by_name["TraceService"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
)
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]
#: Not a protobuf message: a field key promising a length-delimited field longer than what follows.
GARBAGE = b"\x0a\xff\xff\xff\x0f\x01"


@pytest_asyncio.fixture
async def everything() -> AsyncIterator[RunningServer]:
    async with serving_with_proxy(ServerConfig(port=0, grace=0.5)) as running:
        yield running


async def send(address: str, path: str, method: Any, payload: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            if method.client_streaming:
                async for _ in channel.stream_stream(path)(iter([payload]), timeout=5):
                    pass
            elif method.server_streaming:
                async for _ in channel.unary_stream(path)(payload, timeout=5):
                    pass
            else:
                await channel.unary_unary(path)(payload, timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc
    raise AssertionError(f"{path} took undecodable bytes")


@pytest.mark.parametrize(("path", "method"), METHODS, ids=[p for p, _ in METHODS])
async def test_undecodable_bytes_get_invalid_argument_with_error_info_on_every_rpc(
    everything: RunningServer, path: str, method: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    error = await send(everything.address, path, method, GARBAGE)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details and status.details[0].Unpack(info)
    assert info.reason == "INVALID_ARGUMENT" and info.metadata["field"] == "request"
    assert (error.details() or "").startswith("request: is not a valid ")  # no Python exception name
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("interval", [1e-9, 0.05])
async def test_a_watcher_cannot_ask_for_progress_messages_faster_than_ten_a_second(
    everything: RunningServer, interval: float
) -> None:
    request = store_service_pb2.WatchRolloutsRequest()
    request.progress_interval.FromNanoseconds(int(interval * 1e9))
    async with grpc.aio.insecure_channel(everything.address) as channel:
        call = channel.unary_stream(
            "/lightning.v1.StoreService/WatchRollouts",
            request_serializer=store_service_pb2.WatchRolloutsRequest.SerializeToString,
            response_deserializer=store_service_pb2.WatchRolloutsResponse.FromString,
        )(request, timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("progress_interval: must be at least 0.1 s")


async def test_the_shortest_progress_interval_allowed_paces_the_watcher(everything: RunningServer) -> None:
    from lightning_grpc.client import StoreClient

    async with StoreClient(everything.address) as client:
        count = 0
        started = asyncio.get_running_loop().time()
        async for event in client.watch_rollouts(include_progress=True, progress_interval=0.1):
            assert event.rollout is None
            count += 1
            if asyncio.get_running_loop().time() - started > 1.0:
                break
    assert 5 <= count <= 15, count  # about ten a second, the first at once


# ---------------------------------------------------------------------- logs a caller cannot flood or forge


def fields(line: str) -> list[str]:
    """The keys of a log line's ``key=value`` fields, read as logfmt (a quoted value is one value)."""
    message = line.split(" ", 4)[-1]  # after the date, time, level and logger
    return [token.split("=", 1)[0] for token in shlex.split(message) if "=" in token]


def formatted(records: list[logging.LogRecord]) -> list[str]:
    formatter = OneLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    return [formatter.format(r) for r in records]


def otlp_export(rollout_id: str, attempt_id: str) -> bytes:
    request = otlp_service.ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = "s", b"\x01" * 16, b"\x02" * 8
    for key, value in ((semconv.ROLLOUT_ID, rollout_id), (semconv.ATTEMPT_ID, attempt_id)):
        attr = span.attributes.add()
        attr.key, attr.value.string_value = key, value
    return bytes(request.SerializeToString())


@pytest.mark.parametrize(
    "rollout_id",
    [
        "ro-" + "x" * (1 << 20),
        "ro-1\n2026-11-24 00:00:00 ERROR lightning_grpc.server event=forged",
        "ro-%0Aevent=forged",
    ],
    ids=["one-mebibyte", "newline", "field"],
)
async def test_an_otlp_export_with_a_hostile_id_writes_a_short_honest_log(
    everything: RunningServer, rollout_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lightning_grpc")
    path = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    async with grpc.aio.insecure_channel(
        everything.address, options=[("grpc.max_send_message_length", 8 << 20)]
    ) as ch:
        reply = otlp_service.ExportTraceServiceResponse.FromString(
            await ch.unary_unary(path)(otlp_export(rollout_id, "at-1"), timeout=10)
        )
    assert reply.partial_success.rejected_spans == 1  # an unknown attempt
    assert len(reply.partial_success.error_message) < 2000
    lines = formatted([r for r in caplog.records if r.name.startswith("lightning_grpc")])
    assert lines and sum(len(line) for line in lines) < 4000, [len(line) for line in lines]
    for line in lines:
        assert "\n" not in line
        assert fields(line).count("event") == 1, line  # the id cannot pass for a field of its own


async def test_a_proxy_pause_reason_and_a_model_name_cannot_flood_the_log(
    everything: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    import aiohttp

    from lightning_grpc.client import ProxyClient

    caplog.set_level(logging.INFO, logger="lightning_grpc")
    huge = "r" * (1 << 20) + "\nevent=forged"
    async with ProxyClient(everything.address) as control:
        await control.pause(huge)
        status = await control.status()
        await control.resume()
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{status.http_address}/v1/chat/completions", json={"model": "m" * (1 << 20), "messages": []}
        ) as resp,
    ):
        body = await resp.text()
    assert resp.status == 404 and len(body) < 2000
    lines = formatted([r for r in caplog.records if r.name.startswith("lightning_grpc")])
    assert lines and max(len(line) for line in lines) < 1000
    assert all("\n" not in line and fields(line).count("event") == 1 for line in lines)
