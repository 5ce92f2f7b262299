"""Health's List and reflection's FileContainingSymbol for a method, through real servers on 127.0.0.1.

grpcio-health-checking's servicer has no List (it answered UNIMPLEMENTED and logged a traceback per call),
and the upb descriptor pool finds no file for a method's full name (``grpcurl describe SERVICE.METHOD``
answered "Symbol not found"); ``server/health.py`` and ``server/app.py`` fill both gaps.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lightning_grpc.proxy import ProxyConfig
from lightning_grpc.server.app import RunningServer, ServerConfig
from lightning_grpc.server.proxy_app import start_proxy_server
from lightning_grpc.server.proxy_servicer import PROXY_SERVICE
from tests.helpers import serving

TOKEN = "admin-s3cret"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STORE = "lightning.v1.StoreService"
SERVED = {"", STORE, "lightning.v1.TrainerService", "opentelemetry.proto.collector.trace.v1.TraceService"}


@pytest_asyncio.fixture
async def plain() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=0.5)) as running:
        yield running


@pytest_asyncio.fixture
async def guarded() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=0.5, token=TOKEN)) as running:
        yield running


def problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log records at ERROR or above, or carrying a traceback (what the missing List logged per call)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def health_list(address: str) -> dict[str, int]:
    """``/grpc.health.v1.Health/List`` without any credential: service name -> status."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5)
    assert isinstance(reply, health_pb2.HealthListResponse)
    return {name: response.status for name, response in reply.statuses.items()}


# ---------------------------------------------------------------------- health: List


async def test_list_answers_every_served_service_serving(
    plain: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert await health_list(plain.address) == dict.fromkeys(SERVED, SERVING)
    assert set(plain.service_names) | {""} == SERVED
    assert not problems(caplog)


async def test_list_follows_the_statuses_set_and_the_drain(
    plain: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    await plain.health.set(STORE, NOT_SERVING)
    listed = await health_list(plain.address)
    assert listed[STORE] == NOT_SERVING
    assert {name: status for name, status in listed.items() if name != STORE} == dict.fromkeys(
        SERVED - {STORE}, SERVING
    )
    await plain.health.set(STORE, SERVING)
    assert await health_list(plain.address) == dict.fromkeys(SERVED, SERVING)
    await plain.health.enter_graceful_shutdown()  # what the drain does first
    assert await health_list(plain.address) == dict.fromkeys(SERVED, NOT_SERVING)
    assert not problems(caplog)


async def test_list_of_an_unknown_name_checked_adds_nothing(plain: RunningServer) -> None:
    async with grpc.aio.insecure_channel(plain.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="nope"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert set(await health_list(plain.address)) == SERVED


async def test_list_needs_no_credential_on_a_server_with_a_token(
    guarded: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert await health_list(guarded.address) == dict.fromkeys(SERVED, SERVING)
    async with grpc.aio.insecure_channel(guarded.address) as channel:  # while the services need one
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary(f"/{STORE}/GetStatistics")(b"", timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not problems(caplog)


async def test_the_proxys_own_server_lists_its_service_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    proxy = await start_proxy_server(ProxyConfig(port=0, backends=[]), token=TOKEN)
    try:
        assert await health_list(proxy.grpc_address) == {"": SERVING, PROXY_SERVICE: SERVING}
    finally:
        await proxy.stop(0.5)
    assert not problems(caplog)


# ---------------------------------------------------------------------- reflection: a method's file


async def reflect(address: str, *requests: reflection_pb2.ServerReflectionRequest) -> list[object]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        return [reply async for reply in stub.ServerReflectionInfo(iter(requests), timeout=5)]


def files_of(reply: object) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    assert isinstance(reply, reflection_pb2.ServerReflectionResponse)
    assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
    protos = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in reply.file_descriptor_response.file_descriptor_proto
    ]
    return {p.name: p for p in protos}


def declares(files: dict[str, descriptor_pb2.FileDescriptorProto], service: str, method: str) -> bool:
    package, _, name = service.rpartition(".")
    return any(
        p.package == package and m.name == method
        for p in files.values()
        for s in p.service
        if s.name == name
        for m in s.method
    )


@pytest.mark.parametrize(
    ("symbol", "service", "method"),
    [
        ("lightning.v1.StoreService.GetRollout", STORE, "GetRollout"),
        ("lightning.v1.TrainerService.GetBatch", "lightning.v1.TrainerService", "GetBatch"),
        ("grpc.health.v1.Health.Check", "grpc.health.v1.Health", "Check"),
        ("grpc.health.v1.Health.List", "grpc.health.v1.Health", "List"),
        (
            "grpc.reflection.v1alpha.ServerReflection.ServerReflectionInfo",
            "grpc.reflection.v1alpha.ServerReflection",
            "ServerReflectionInfo",
        ),
    ],
)
async def test_file_containing_a_method_is_the_file_of_its_service(
    guarded: RunningServer, symbol: str, service: str, method: str
) -> None:
    (reply,) = await reflect(
        guarded.address, reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
    )
    files = files_of(reply)
    assert declares(files, service, method), sorted(files)


async def test_services_messages_and_fields_resolve_as_before(plain: RunningServer) -> None:
    expected = {
        STORE: "lightning/v1/store_service.proto",
        "lightning.v1.Rollout": "lightning/v1/rollout.proto",
        "lightning.v1.Rollout.rollout_id": "lightning/v1/rollout.proto",
        "lightning.v1.RolloutStatus": "lightning/v1/rollout.proto",
        "grpc.health.v1.HealthListResponse": "grpc_health/v1/health.proto",
    }
    replies = await reflect(
        plain.address, *(reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in expected)
    )
    assert [next(iter(files_of(r))) for r in replies] == list(expected.values())  # the file, then its imports


@pytest.mark.parametrize(
    "symbol",
    [
        "lightning.v1.StoreService.NoSuchMethod",
        "lightning.v1.NoSuchService.GetRollout",
        "lightning.v1.Rollout.GetRollout",  # a message is no service
        "NoSuchSymbol",
        ".GetRollout",
        "",
    ],
)
async def test_an_unknown_symbol_is_still_not_found(
    plain: RunningServer, symbol: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    (reply,) = await reflect(
        plain.address, reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
    )
    assert isinstance(reply, reflection_pb2.ServerReflectionResponse)
    assert reply.WhichOneof("message_response") == "error_response"
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert reply.original_request.file_containing_symbol == symbol
    assert not problems(caplog)


async def test_a_request_asking_nothing_is_still_invalid_argument(plain: RunningServer) -> None:
    (reply,) = await reflect(plain.address, reflection_pb2.ServerReflectionRequest(host="x"))
    assert isinstance(reply, reflection_pb2.ServerReflectionResponse)
    assert reply.error_response.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


async def test_the_other_lookups_still_reach_the_default_pool(plain: RunningServer) -> None:
    by_name, extensions = await reflect(
        plain.address,
        reflection_pb2.ServerReflectionRequest(file_by_filename="lightning/v1/store_service.proto"),
        reflection_pb2.ServerReflectionRequest(all_extension_numbers_of_type="lightning.v1.Rollout"),
    )
    assert declares(files_of(by_name), STORE, "GetRollout")
    assert isinstance(extensions, reflection_pb2.ServerReflectionResponse)
    assert extensions.all_extension_numbers_response.base_type_name == "lightning.v1.Rollout"
