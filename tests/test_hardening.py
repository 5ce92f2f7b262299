"""Inputs an attacker on the same machine could send, through real servers: undecodable requests to every
RPC of every service, values that would flood the log, intervals that would flood a watcher."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_service

from lightning_grpc.proxy import ProxyConfig
from lightning_grpc.server.app import RunningServer, ServerConfig
from lightning_grpc.server.proxy_app import start_with_store
from lightning_grpc.v1 import proxy_service_pb2, store_service_pb2, trainer_service_pb2

SERVICES = (
    store_service_pb2.DESCRIPTOR.services_by_name["StoreService"],
    trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"],
    proxy_service_pb2.DESCRIPTOR.services_by_name["ProxyService"],
    otlp_service.DESCRIPTOR.services_by_name["TraceService"],
)
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]
#: Not a protobuf message: a field key promising a length-delimited field longer than what follows.
GARBAGE = b"\x0a\xff\xff\xff\x0f\x01"


@pytest_asyncio.fixture
async def everything() -> AsyncIterator[RunningServer]:
    running, proxy = await start_with_store(ServerConfig(port=0, grace=0.5), ProxyConfig(port=0, backends=[]))
    try:
        yield running
    finally:
        await proxy.stop(1)
        await running.stop()


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
