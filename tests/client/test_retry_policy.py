"""The clients' retry policy comes from the contract: the rpcs of proto/lightning/v1 marked
NO_SIDE_EFFECTS or IDEMPOTENT, and those only, are sent again when the server could not take them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pb2

from lightning_grpc.client.channel import make_channel
from lightning_grpc.client.config import RETRYABLE_METHODS, ClientConfig, RetryConfig
from lightning_grpc.v1 import rollout_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
SAFE = {descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS, descriptor_pb2.MethodOptions.IDEMPOTENT}
STORE = "lightning.v1.StoreService"


@pytest.fixture(scope="module")
def proto_files(tmp_path_factory: pytest.TempPathFactory) -> list[descriptor_pb2.FileDescriptorProto]:
    """The contract compiled from the .proto sources (not from the generated stubs)."""
    out = tmp_path_factory.mktemp("contract") / "contract.binpb"
    sources = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--descriptor_set_out={out}", *sources],
        check=True,
        cwd=ROOT,
    )
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return [f for f in files if f.package == "lightning.v1"]


def marked(files: list[descriptor_pb2.FileDescriptorProto]) -> set[tuple[str, str]]:
    return {
        (f"{f.package}.{service.name}", method.name)
        for f in files
        for service in f.service
        for method in service.method
        if method.options.idempotency_level in SAFE
    }


def service_config_names(config: ClientConfig) -> set[tuple[str, str]]:
    (method_config,) = json.loads(config.service_config())["methodConfig"]
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    return {(name["service"], name["method"]) for name in method_config["name"]}


def test_retried_methods_are_the_ones_the_proto_marks(
    proto_files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    expected = marked(proto_files)
    assert expected, "the contract marks no rpc as safe to retry"
    assert set(RETRYABLE_METHODS) == expected
    assert service_config_names(ClientConfig()) == expected


def test_reads_are_retried_and_start_attempt_is_not(
    proto_files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    retried = set(RETRYABLE_METHODS)
    for method in (
        "StartAttempt",
        "RetryRollout",
        "UpdateResources",
        "DeleteRollouts",
        "GetNextSpanSequenceId",
    ):
        assert (STORE, method) not in retried
    for method in ("GetRollout", "ListRollouts", "DequeueRollouts", "CompleteAttempt", "AddSpans"):
        assert (STORE, method) in retried
    # every unary rpc named Get* or List* is a read, so marked (GetNextSpanSequenceId reserves ids)
    for f in proto_files:
        for service in f.service:
            for rpc in service.method:
                if rpc.name == "GetNextSpanSequenceId":
                    continue
                if rpc.name.startswith(("Get", "List")) and not rpc.server_streaming:
                    assert (f"{f.package}.{service.name}", rpc.name) in retried, rpc.name


def test_no_retry_config_retries_nothing() -> None:
    assert json.loads(ClientConfig(retry=None).service_config()) == {"methodConfig": []}


class FlakyStore(pb_grpc.StoreServiceServicer):
    """A real StoreService that cannot take the first GetRollout, and never takes StartAttempt."""

    def __init__(self) -> None:
        self.calls = {"GetRollout": 0, "StartAttempt": 0}

    async def GetRollout(
        self, request: pb.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRolloutResponse:
        self.calls["GetRollout"] += 1
        if self.calls["GetRollout"] == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready yet")
        return pb.GetRolloutResponse(rollout=rollout_pb2.Rollout(rollout_id=request.rollout_id))

    async def StartAttempt(
        self, request: pb.StartAttemptRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartAttemptResponse:
        self.calls["StartAttempt"] += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready yet")
        raise AssertionError("abort returned")


@pytest_asyncio.fixture
async def flaky() -> AsyncIterator[tuple[FlakyStore, str]]:
    servicer = FlakyStore()  # type: ignore[abstract]  # only the two rpcs the tests call
    server = grpc.aio.server()
    pb_grpc.add_StoreServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_unavailable_read_is_retried_transparently(flaky: tuple[FlakyStore, str]) -> None:
    servicer, target = flaky
    retry = RetryConfig(initial_backoff=0.01, max_backoff=0.05)
    channel = make_channel(ClientConfig(target=target, retry=retry))
    try:
        stub = pb_grpc.StoreServiceStub(channel)
        res = await stub.GetRollout(pb.GetRolloutRequest(rollout_id="ro-1"), timeout=10)
        assert res.rollout.rollout_id == "ro-1"
        assert servicer.calls["GetRollout"] == 2
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.StartAttempt(pb.StartAttemptRequest(rollout_id="ro-1"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert servicer.calls["StartAttempt"] == 1
    finally:
        await channel.close()


async def test_without_retry_config_a_read_is_not_retried(flaky: tuple[FlakyStore, str]) -> None:
    servicer, target = flaky
    channel = make_channel(ClientConfig(target=target, retry=None))
    try:
        stub = pb_grpc.StoreServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetRollout(pb.GetRolloutRequest(rollout_id="ro-1"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert servicer.calls["GetRollout"] == 1
    finally:
        await channel.close()
