"""Inputs an attacker on the same machine could send, through real servers: undecodable requests to every
RPC of every service, values that would flood the log, intervals that would flood a watcher."""

from __future__ import annotations

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
