"""Least privilege, through a real server: every RPC of every service called with every kind of credential,
then the scoping of runner and attempt credentials (another worker's or attempt's work is refused and
nothing of it is recorded), expiry, secrets, and the OTLP receiver.

The proxy's HTTP routes are walked in ``tests/proxy/test_proxy_access.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import message_factory
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_service
from opentelemetry.proto.trace.v1 import trace_pb2 as otlp_trace

from lightning_grpc import semconv
from lightning_grpc.access import RULES, SESSION_CALLS, Credentials, Role, credential_claims
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.client.errors import status_lost_to_a_write
from lightning_grpc.errors import PermissionDeniedError, UnauthenticatedError
from lightning_grpc.proxy import ProxyConfig
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from lightning_grpc.server.proxy_app import start_with_store
from lightning_grpc.types import LLM, ProxyLLM, Span
from lightning_grpc.v1 import (
    proxy_service_pb2,
    rollout_pb2,
    store_service_pb2,
    store_service_pb2_grpc,
    trainer_service_pb2,
)
from tests.conftest import ROOT
from tests.helpers import serving_with_proxy

TOKEN = "admin-s3cret"
SERVICES = (
    store_service_pb2.DESCRIPTOR.services_by_name["StoreService"],
    trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"],
    proxy_service_pb2.DESCRIPTOR.services_by_name["ProxyService"],
    otlp_service.DESCRIPTOR.services_by_name["TraceService"],
)
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]


@pytest_asyncio.fixture
async def secured() -> AsyncIterator[RunningServer]:
    """The Store with TrainerService, OTLP and ProxyService on one port, with a token."""
    async with serving_with_proxy(ServerConfig(port=0, grace=0.5, token=TOKEN)) as running:
        yield running


def client(server: RunningServer, token: str | None) -> StoreClient:
    return StoreClient(ClientConfig(target=server.address, token=token, retry=None))


@dataclass
class World:
    """One rollout claimed by worker w1 (with its attempt credential) and one claimed by worker w2."""

    rollout_id: str
    attempt_id: str
    credential: str
    other_rollout_id: str
    other_attempt_id: str
    other_credential: str


async def make_world(server: RunningServer) -> World:
    creds = Credentials(TOKEN)
    admin = client(server, TOKEN)
    mine, theirs = client(server, creds.runner("w1")), client(server, creds.runner("w2"))
    try:
        await admin.enqueue_rollouts([{"input": {"n": 1}}, {"input": {"n": 2}}])
        [a] = await mine.dequeue_rollouts(worker_id="w1")
        [b] = await theirs.dequeue_rollouts(worker_id="w2")
    finally:
        for c in (admin, mine, theirs):
            await c.close()
    assert a.latest_attempt is not None and b.latest_attempt is not None
    return World(
        a.rollout_id,
        a.latest_attempt.attempt_id,
        a.latest_attempt.credential,
        b.rollout_id,
        b.latest_attempt.attempt_id,
        b.latest_attempt.credential,
    )


def request_for(method: Any, world: World) -> bytes:
    """A request naming the world's first attempt (and worker w1) in whichever id fields it has."""
    message = message_factory.GetMessageClass(method.input_type)()
    values = {"rollout_id": world.rollout_id, "attempt_id": world.attempt_id, "worker_id": "w1"}
    for name, value in values.items():
        if name in method.input_type.fields_by_name:
            setattr(message, name, value)
    return bytes(message.SerializeToString())


async def call(
    server: RunningServer, path: str, method: Any, payload: bytes, bearer: str | None
) -> grpc.RpcError | None:
    """Call ``path`` with raw bytes; the error it ends with (None when it answered, or was still running).

    A client stream refused before its first message went out can end on the client's side with grpc.aio's
    INTERNAL instead of the server's status (the send lost the race with the server's answer,
    :func:`~lightning_grpc.client.errors.status_lost_to_a_write`); it is asked again, up to 5 times."""
    error = await call_once(server, path, method, payload, bearer)
    for _ in range(4):
        if error is None or not method.client_streaming or not status_lost_to_a_write(error):
            break
        error = await call_once(server, path, method, payload, bearer)
    return error


async def call_once(
    server: RunningServer, path: str, method: Any, payload: bytes, bearer: str | None
) -> grpc.aio.AioRpcError | None:
    metadata = (("authorization", f"Bearer {bearer}"),) if bearer is not None else ()
    async with grpc.aio.insecure_channel(server.address) as channel:
        try:
            if method.client_streaming:
                stream = channel.stream_stream(path)(iter([payload]), metadata=metadata, timeout=1.5)
                async for _ in stream:
                    break
                if not method.server_streaming:
                    stream.cancel()
            elif method.server_streaming:
                async for _ in channel.unary_stream(path)(payload, metadata=metadata, timeout=1.5):
                    break
            else:
                await channel.unary_unary(path)(payload, metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return None  # admitted: it was waiting for something to answer
            return exc
    return None


def reason_of(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    raise AssertionError(f"no ErrorInfo in {error}")


def test_the_table_names_every_rpc_of_every_service_and_nothing_else() -> None:
    assert sorted(RULES) == sorted(path for path, _ in METHODS)
    for path, rule in RULES.items():
        assert Role.ADMIN in rule.roles, path  # the admin token can do everything


def test_the_session_table_is_the_contracts_oneof_of_calls() -> None:
    """Each field of RunnerSessionRequest's ``call`` carries the request of the RPC SESSION_CALLS names for it."""
    pb = store_service_pb2
    request, response = pb.RunnerSessionRequest.DESCRIPTOR, pb.RunnerSessionResponse.DESCRIPTOR
    rpcs = {m.name: m for m in pb.DESCRIPTOR.services_by_name["StoreService"].methods}
    calls = request.oneofs_by_name["call"].fields
    assert sorted(SESSION_CALLS) == sorted(f.name for f in calls)
    for field in calls:
        rpc = rpcs[SESSION_CALLS[field.name]]
        assert field.message_type is rpc.input_type, field.name
        assert response.fields_by_name[field.name].message_type is rpc.output_type, field.name


@pytest.mark.parametrize(
    "caller", ["admin", "runner", "attempt", "none", "forged", "admin-of-another-server"]
)
async def test_every_rpc_is_allowed_to_the_roles_its_rule_names_and_refused_to_the_rest(
    secured: RunningServer, caller: str
) -> None:
    refused_by_role: list[str] = []
    admitted: list[str] = []
    for path, method in METHODS:
        world = await make_world(secured)
        bearer = {
            "admin": TOKEN,
            "runner": Credentials(TOKEN).runner("w1"),
            "attempt": world.credential,
            "none": None,
            "forged": Credentials("another token").attempt(world.rollout_id, world.attempt_id),
            "admin-of-another-server": "another token",
        }[caller]
        error = await call(secured, path, method, request_for(method, world), bearer)
        code = error.code() if error is not None else grpc.StatusCode.OK
        if caller in ("none", "forged", "admin-of-another-server"):
            assert code == grpc.StatusCode.UNAUTHENTICATED, (path, error)
            assert error is not None and reason_of(error) == "BAD_TOKEN"
            continue
        if Role(caller) in RULES[path].roles:
            assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), (
                path,
                error,
            )
            admitted.append(path)
        else:
            assert code == grpc.StatusCode.PERMISSION_DENIED, (path, error)
            assert error is not None and reason_of(error) == "ROLE_NOT_ALLOWED"
            assert Role(caller).value in (error.details() or ""), error.details()
            refused_by_role.append(path)
    if caller == "admin":
        assert len(admitted) == len(METHODS)
    elif caller in (
        "runner",
        "attempt",
    ):  # both lists are non-empty: a runner and an attempt can do some things and not others
        assert admitted and refused_by_role
        assert "/lightning.v1.StoreService/EnqueueRollouts" in refused_by_role
        assert "/lightning.v1.StoreService/HeartbeatAttempt" in admitted


async def list_services(address: str) -> list[str] | grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        try:
            async for reply in stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            ):
                return [s.name for s in reply.list_services_response.service]
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return []


async def reflection_status(address: str) -> grpc.StatusCode | None:
    """How the server ends a reflection stream the client writes nothing to (None: it keeps it open).

    Writing a request to a method the server does not have races the server's answer in grpc's asyncio
    client, which then reports INTERNAL about half the time (grpc/grpc#36066); without a write it cannot."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        try:
            return await asyncio.wait_for(call.code(), 5)
        except TimeoutError:
            call.cancel()
            return None


async def test_health_and_reflection_stay_open_and_reflection_can_be_turned_off(
    secured: RunningServer,
) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    listed = await list_services(secured.address)
    assert isinstance(listed, list) and "lightning.v1.StoreService" in listed
    quiet = await start_server(ServerConfig(port=0, grace=0.5, token=TOKEN, reflection=False))
    try:
        assert await reflection_status(quiet.address) == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await quiet.stop()


# ---------------------------------------------------------------------- scoping


ATTEMPT_SCOPED = (
    "HeartbeatAttempt",
    "CompleteAttempt",
    "AddSpans",
    "AddSpansStream",
    "GetNextSpanSequenceId",
)


@pytest.mark.parametrize("name", [*ATTEMPT_SCOPED, "GetRollout", "GetLatestAttempt"])
async def test_a_runner_credential_cannot_touch_another_workers_attempt(
    secured: RunningServer, name: str
) -> None:
    world = await make_world(secured)
    path = f"/lightning.v1.StoreService/{name}"
    method = dict(METHODS)[path]
    theirs = World(world.other_rollout_id, world.other_attempt_id, "", "", "", "")
    error = await call(secured, path, method, request_for(method, theirs), Credentials(TOKEN).runner("w1"))
    assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    assert reason_of(error) == "WRONG_WORKER"
    assert world.other_attempt_id in (error.details() or "") or world.other_rollout_id in (
        error.details() or ""
    )
    # its own attempt is fine
    error = await call(secured, path, method, request_for(method, world), Credentials(TOKEN).runner("w1"))
    assert error is None or error.code() not in (
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    )


@pytest.mark.parametrize("name", [*ATTEMPT_SCOPED, "GetRollout", "GetLatestAttempt"])
async def test_an_attempt_credential_works_for_its_attempt_alone(secured: RunningServer, name: str) -> None:
    world = await make_world(secured)
    path = f"/lightning.v1.StoreService/{name}"
    method = dict(METHODS)[path]
    theirs = World(world.other_rollout_id, world.other_attempt_id, "", "", "", "")
    error = await call(secured, path, method, request_for(method, theirs), world.credential)
    assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    assert reason_of(error) == "WRONG_ATTEMPT"


async def test_a_runner_acts_only_as_its_own_worker(secured: RunningServer) -> None:
    creds = Credentials(TOKEN)
    w1 = client(secured, creds.runner("w1"))
    try:
        for action in (
            lambda: w1.dequeue_rollouts(worker_id="w2"),
            lambda: w1.dequeue_rollouts(worker_id=""),
            lambda: w1.update_worker("w2", {"load": 1}),
        ):
            with pytest.raises(PermissionDeniedError) as refused:
                await action()
            assert refused.value.reason == "WRONG_WORKER"
        await w1.update_worker("w1", {"load": 1})
        with pytest.raises(PermissionDeniedError) as refused:
            await w1.enqueue_rollouts([{"input": 1}])
        assert refused.value.reason == "ROLE_NOT_ALLOWED"
    finally:
        await w1.close()


async def test_spans_sent_with_the_wrong_attempts_credential_are_refused_and_not_recorded(
    secured: RunningServer,
) -> None:
    world = await make_world(secured)
    admin = client(secured, TOKEN)
    intruder = client(secured, world.credential)
    try:
        span = Span(name="forged", trace_id="ab" * 16, span_id="cd" * 8)
        with pytest.raises(PermissionDeniedError):
            await intruder.add_spans(
                [span], rollout_id=world.other_rollout_id, attempt_id=world.other_attempt_id
            )
        with pytest.raises(PermissionDeniedError):  # nor end it as SUCCEEDED
            await intruder.complete_attempt(world.other_rollout_id, world.other_attempt_id, "succeeded")
        assert await admin.query_spans(world.other_rollout_id) == []
        other = await admin.get_rollout(world.other_rollout_id)
        assert other.latest_attempt is not None and other.latest_attempt.status.is_active
        # the same credential writes its own attempt's spans
        await intruder.add_spans([span], rollout_id=world.rollout_id, attempt_id=world.attempt_id)
        assert [s.name for s in await admin.query_spans(world.rollout_id)] == ["forged"]
    finally:
        await admin.close()
        await intruder.close()


def otlp_request(attribution: tuple[str, str] | None) -> bytes:
    span = otlp_trace.Span(name="otlp-span", trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    if attribution is not None:
        for key, value in zip((semconv.ROLLOUT_ID, semconv.ATTEMPT_ID), attribution, strict=True):
            attr = span.attributes.add()
            attr.key, attr.value.string_value = key, value
    request = otlp_service.ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.append(span)
    return bytes(request.SerializeToString())


async def test_otlp_export_is_scoped_by_the_credential(secured: RunningServer) -> None:
    world = await make_world(secured)
    path = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    method = dict(METHODS)[path]
    admin = client(secured, TOKEN)
    try:
        # another attempt, named by span attributes or by headers: refused, nothing stored
        error = await call(
            secured,
            path,
            method,
            otlp_request((world.other_rollout_id, world.other_attempt_id)),
            world.credential,
        )
        assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED
        runner_error = await call(
            secured,
            path,
            method,
            otlp_request((world.other_rollout_id, world.other_attempt_id)),
            Credentials(TOKEN).runner("w1"),
        )
        assert runner_error is not None and runner_error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert await admin.query_spans(world.other_rollout_id) == []
        # no attribution at all: an attempt credential's spans are its attempt's
        assert await call(secured, path, method, otlp_request(None), world.credential) is None
        assert [s.name for s in await admin.query_spans(world.rollout_id)] == ["otlp-span"]
    finally:
        await admin.close()


async def test_an_attempt_credential_expires_when_its_attempt_ends(secured: RunningServer) -> None:
    world = await make_world(secured)
    agent = client(secured, world.credential)
    try:
        await agent.heartbeat_attempt(world.rollout_id, world.attempt_id)
        await agent.complete_attempt(world.rollout_id, world.attempt_id, "succeeded")
        with pytest.raises(UnauthenticatedError) as expired:
            await agent.heartbeat_attempt(world.rollout_id, world.attempt_id)
        assert expired.value.reason == "CREDENTIAL_EXPIRED"
        assert world.attempt_id in expired.value.message
        with pytest.raises(UnauthenticatedError):
            await agent.add_spans(
                [Span(name="late", trace_id="ab" * 16, span_id="cd" * 8)],
                rollout_id=world.rollout_id,
                attempt_id=world.attempt_id,
            )
        # nor does it read anything any more
        for read in (
            lambda: agent.get_rollout(world.rollout_id),
            lambda: agent.get_latest_attempt(world.rollout_id),
            lambda: agent.get_latest_resources(),
        ):
            with pytest.raises(UnauthenticatedError) as expired:
                await read()
            assert expired.value.reason == "CREDENTIAL_EXPIRED"
    finally:
        await agent.close()


async def test_credentials_carry_an_expiry_and_a_signature_that_cannot_be_edited(
    secured: RunningServer,
) -> None:
    creds = Credentials(TOKEN)
    expired = client(secured, creds.runner("w1", ttl=-10))
    try:
        with pytest.raises(UnauthenticatedError) as refused:
            await expired.update_worker("w1", {})
        assert refused.value.reason == "CREDENTIAL_EXPIRED"
    finally:
        await expired.close()
    # a runner credential edited to name another worker no longer verifies
    head, _, signature = creds.runner("w1").split(".")
    edited = creds.runner("w2").split(".")[1]
    forged = client(secured, f"{head}.{edited}.{signature}")
    try:
        with pytest.raises(UnauthenticatedError) as refused:
            await forged.update_worker("w2", {})
        assert refused.value.reason == "BAD_TOKEN"
    finally:
        await forged.close()
    assert credential_claims(creds.runner("w1")) == {"role": "runner", "worker_id": "w1"}


async def test_secrets_in_resources_are_write_only_for_every_role_but_admin(secured: RunningServer) -> None:
    world = await make_world(secured)
    admin = client(secured, TOKEN)
    runner = client(secured, Credentials(TOKEN).runner("w1"))
    agent = client(secured, world.credential)
    try:
        update = await admin.add_resources(
            {
                "main_llm": LLM(endpoint="http://backend/v1", model="m", api_key="sk-backend"),
                "proxied": ProxyLLM(endpoint="http://proxy/v1", model="m", api_key="sk-proxy"),
            }
        )
        got = await admin.get_resources(update.resources_id)
        assert got.resources["main_llm"].api_key == "sk-backend"  # type: ignore[union-attr]
        for reader in (runner, agent):
            for seen in (
                await reader.get_resources(update.resources_id),
                await reader.get_latest_resources(),
            ):
                assert seen is not None
                assert seen.resources["main_llm"].api_key == ""  # type: ignore[union-attr]
                assert seen.resources["proxied"].api_key == ""  # type: ignore[union-attr]
                assert seen.resources["main_llm"].endpoint == "http://backend/v1"  # type: ignore[union-attr]
        assert "sk-backend" not in repr(got.resources["main_llm"])
    finally:
        for c in (admin, runner, agent):
            await c.close()


async def test_dequeue_start_and_start_attempt_answers_carry_the_attempts_credential(
    secured: RunningServer,
) -> None:
    admin = client(secured, TOKEN)
    try:
        started = await admin.start_rollout({"n": 3}, worker_id="w9")
        assert started.latest_attempt is not None
        claims = credential_claims(started.latest_attempt.credential)
        assert claims is not None
        assert (claims["role"], claims["rollout_id"], claims["attempt_id"]) == (
            "attempt",
            started.rollout_id,
            started.latest_attempt.attempt_id,
        )
        # reads never carry it
        read = await admin.get_rollout(started.rollout_id)
        assert read.latest_attempt is not None and read.latest_attempt.credential == ""
    finally:
        await admin.close()


async def test_without_a_token_nothing_changes_and_no_credential_is_minted() -> None:
    running, proxy = await start_with_store(ServerConfig(port=0, grace=0.5), ProxyConfig(port=0, backends=[]))
    plain = StoreClient(running.address)
    try:
        started = await plain.start_rollout({"n": 1})
        assert started.latest_attempt is not None and started.latest_attempt.credential == ""
        await plain.enqueue_rollouts([{"input": 1}])
        [claimed] = await plain.dequeue_rollouts(worker_id="anyone")
        assert claimed.latest_attempt is not None and claimed.latest_attempt.credential == ""
    finally:
        await plain.close()
        await proxy.stop(1)
        await running.stop()


async def test_many_runner_calls_are_checked_concurrently_without_mixing_callers(
    secured: RunningServer,
) -> None:
    """Each call's caller is its own: concurrent calls of two runners never borrow each other's rights."""
    world = await make_world(secured)
    creds = Credentials(TOKEN)
    w1, w2 = client(secured, creds.runner("w1")), client(secured, creds.runner("w2"))
    try:
        outcomes = await asyncio.gather(
            *[w1.heartbeat_attempt(world.rollout_id, world.attempt_id) for _ in range(40)],
            *[w2.heartbeat_attempt(world.rollout_id, world.attempt_id) for _ in range(40)],
            return_exceptions=True,
        )
        assert all(not isinstance(o, Exception) for o in outcomes[:40])
        assert all(isinstance(o, PermissionDeniedError) for o in outcomes[40:])
    finally:
        await w1.close()
        await w2.close()


# ---------------------------------------------------------------------- credentials for a fleet

CLI = [sys.executable, "-m", "lightning_grpc.cli.main"]


def test_the_credential_command_mints_a_runner_credential_from_the_admin_token() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")}
    done = subprocess.run(
        [*CLI, "credential", "runner", "--worker-id", "gpu-node-7", "--ttl", "2h"],
        env={**env, "LIGHTNING_GRPC_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    minted = done.stdout.strip()
    principal = Credentials(TOKEN).principal(f"Bearer {minted}")
    assert (principal.role, principal.worker_id) == (Role.RUNNER, "gpu-node-7")
    assert 7000 < principal.expires - time.time() <= 7201
    missing = subprocess.run(
        [*CLI, "credential", "runner", "--worker-id", "w"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "admin token" in missing.stderr and "Traceback" not in missing.stderr


async def test_a_fleet_started_with_the_admin_token_gives_each_process_its_own_runner_credential(
    secured: RunningServer,
) -> None:
    admin = client(secured, TOKEN)
    try:
        ids = [r.rollout_id for r in await admin.enqueue_rollouts([{"input": {"i": i}} for i in range(6)])]
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            "runner",
            "tests.runner_agents:sync_counter",
            "--store",
            secured.address,
            "--token",
            TOKEN,
            "--processes",
            "2",
            "--max-rollouts",
            "3",
            "--poll-wait",
            "0.2",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, out.decode()[-3000:]
        done = await admin.wait_for_rollouts(ids, timeout=10)
        assert {r.status.name for r in done} == {"SUCCEEDED"}
        workers = {r.latest_attempt.worker_id for r in done if r.latest_attempt is not None}
        assert len(workers) == 2 and all(w.endswith(("-0", "-1")) for w in workers), workers
    finally:
        await admin.close()


# ---------------------------------------------------------------------- ids inside messages


def forged_span(world: World) -> Any:
    """A span that names the other worker's attempt in its own ids (they win over the request's)."""
    from lightning_grpc.v1 import span_pb2

    return span_pb2.Span(
        name="forged",
        trace_id="ab" * 16,
        span_id="cd" * 8,
        rollout_id=world.other_rollout_id,
        attempt_id=world.other_attempt_id,
    )


async def span_write_error(
    server: RunningServer, rpc: str, world: World, request_ids: tuple[str, str], bearer: str
) -> tuple[grpc.StatusCode, str]:
    """Send one forged span by ``rpc`` with ``request_ids`` on the request: the status and reason it got
    (a span stream answers a refused batch in its acknowledgement)."""
    rollout_id, attempt_id = request_ids
    metadata = (("authorization", f"Bearer {bearer}"),)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = store_service_pb2_grpc.StoreServiceStub(channel)
        try:
            if rpc == "AddSpans":
                request = store_service_pb2.AddSpansRequest(rollout_id=rollout_id, attempt_id=attempt_id)
                request.spans.append(forged_span(world))
                await stub.AddSpans(request, metadata=metadata, timeout=5)
            elif rpc == "CompleteAttempt":
                complete = store_service_pb2.CompleteAttemptRequest(
                    rollout_id=rollout_id, attempt_id=attempt_id, status=rollout_pb2.ATTEMPT_STATUS_SUCCEEDED
                )
                complete.spans.append(forged_span(world))
                await stub.CompleteAttempt(complete, metadata=metadata, timeout=5)
            else:
                batch = store_service_pb2.AddSpansStreamRequest(
                    batch_id=1, rollout_id=rollout_id, attempt_id=attempt_id
                )
                batch.spans.append(forged_span(world))
                async for ack in stub.AddSpansStream(iter([batch]), metadata=metadata, timeout=5):
                    assert ack.batch_id == 1
                    return grpc.StatusCode(
                        next(c for c in grpc.StatusCode if c.value[0] == ack.error.code)
                    ), ack.error.reason
        except grpc.aio.AioRpcError as exc:
            return exc.code(), reason_of(exc)
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("rpc", ["AddSpans", "AddSpansStream", "CompleteAttempt"])
@pytest.mark.parametrize("caller", ["runner", "attempt"])
@pytest.mark.parametrize("request_ids", ["own", "empty"])
async def test_ids_inside_spans_are_scoped_like_the_requests_and_nothing_of_a_refused_write_is_stored(
    secured: RunningServer, rpc: str, caller: str, request_ids: str
) -> None:
    """A span's own rollout and attempt ids name another worker's attempt: refused whatever the request names,
    and that attempt is untouched (still PREPARING, no heartbeat, no span, no sequence id used up)."""
    world = await make_world(secured)
    bearer = Credentials(TOKEN).runner("w1") if caller == "runner" else world.credential
    ids = (world.rollout_id, world.attempt_id) if request_ids == "own" else ("", "")
    code, reason = await span_write_error(secured, rpc, world, ids, bearer)
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, reason)
    assert reason in ("WRONG_WORKER", "WRONG_ATTEMPT")
    admin = client(secured, TOKEN)
    try:
        other = await admin.get_rollout(world.other_rollout_id)
        assert other.latest_attempt is not None
        assert other.latest_attempt.status.name == "PREPARING"
        assert not other.latest_attempt.last_heartbeat_time
        assert await admin.query_spans(world.other_rollout_id) == []
        mine = await admin.get_rollout(world.rollout_id)
        assert mine.latest_attempt is not None and mine.latest_attempt.status.is_active  # not completed
        stored = await admin.add_spans(
            [Span(name="first", trace_id="ef" * 16, span_id="01" * 8)],
            rollout_id=world.other_rollout_id,
            attempt_id=world.other_attempt_id,
        )
        assert stored.sequence_ids == [1]
    finally:
        await admin.close()


async def test_span_ids_naming_the_callers_own_attempt_are_taken(secured: RunningServer) -> None:
    world = await make_world(secured)
    runner = client(secured, Credentials(TOKEN).runner("w1"))
    admin = client(secured, TOKEN)
    try:
        own = Span(
            name="own",
            trace_id="ab" * 16,
            span_id="cd" * 8,
            rollout_id=world.rollout_id,
            attempt_id=world.attempt_id,
        )
        await runner.add_spans([own], rollout_id="", attempt_id="")
        assert [s.name for s in await admin.query_spans(world.rollout_id)] == ["own"]
    finally:
        await runner.close()
        await admin.close()


def completion_with_dequeue(world: World, worker_id: str) -> store_service_pb2.CompleteAttemptRequest:
    request = store_service_pb2.CompleteAttemptRequest(
        rollout_id=world.rollout_id, attempt_id=world.attempt_id, status=rollout_pb2.ATTEMPT_STATUS_SUCCEEDED
    )
    request.dequeue_next.worker_id = worker_id
    request.dequeue_next.max_rollouts = 1
    return request


@pytest.mark.parametrize(
    ("caller", "worker_id", "reason"),
    [
        ("attempt", "w1", "ROLE_NOT_ALLOWED"),  # an attempt credential may not dequeue at all
        ("attempt", "w2", "ROLE_NOT_ALLOWED"),
        ("runner", "w2", "WRONG_WORKER"),  # a runner claims only as its own worker
        ("runner", "", "WRONG_WORKER"),
    ],
)
async def test_complete_attempts_dequeue_next_is_scoped_like_dequeue_rollouts(
    secured: RunningServer, caller: str, worker_id: str, reason: str
) -> None:
    world = await make_world(secured)
    admin = client(secured, TOKEN)
    try:
        [queued] = await admin.enqueue_rollouts([{"input": {"n": 3}}])
        bearer = Credentials(TOKEN).runner("w1") if caller == "runner" else world.credential
        metadata = (("authorization", f"Bearer {bearer}"),)
        async with grpc.aio.insecure_channel(secured.address) as channel:
            stub = store_service_pb2_grpc.StoreServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.CompleteAttempt(
                    completion_with_dequeue(world, worker_id), metadata=metadata, timeout=5
                )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert reason_of(refused.value) == reason
        # nothing happened: the queued rollout is unclaimed, the caller's own attempt not completed
        assert (await admin.get_rollout(queued.rollout_id)).status.name == "QUEUING"
        mine = await admin.get_rollout(world.rollout_id)
        assert mine.latest_attempt is not None and mine.latest_attempt.status.is_active
    finally:
        await admin.close()


@pytest.mark.parametrize("caller", ["runner", "admin"])
async def test_rollouts_claimed_by_dequeue_next_carry_their_attempt_credential(
    secured: RunningServer, caller: str
) -> None:
    world = await make_world(secured)
    admin = client(secured, TOKEN)
    completing = client(secured, Credentials(TOKEN).runner("w1") if caller == "runner" else TOKEN)
    try:
        await admin.enqueue_rollouts([{"input": {"n": 3}}])
        _, done, [claimed] = await completing.complete_and_dequeue(
            world.rollout_id, world.attempt_id, "succeeded", worker_id="w1"
        )
        assert done.latest_attempt is not None and done.latest_attempt.credential == ""  # ended: none
        attempt = claimed.latest_attempt
        assert attempt is not None and attempt.worker_id == "w1"
        claims = credential_claims(attempt.credential)
        assert claims is not None
        assert (claims["rollout_id"], claims["attempt_id"]) == (claimed.rollout_id, attempt.attempt_id)
        agent = client(secured, attempt.credential)  # and it works
        try:
            beat = await agent.heartbeat_attempt(claimed.rollout_id, attempt.attempt_id)
            assert not beat.should_stop
        finally:
            await agent.close()
    finally:
        await completing.close()
        await admin.close()
