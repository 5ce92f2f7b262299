"""The dashboard's Connect gateway, through a real server on 127.0.0.1 and real HTTP calls.

What a browser sends with ``@connectrpc/connect-web`` (unary JSON and binary, enveloped server streams),
what it gets back (messages, Connect errors with the server's ErrorInfo, end-of-stream messages), the
same credentials as the gRPC port, the dashboard's files, and ``serve``'s flags.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import ssl
import struct
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import trustme
from google.rpc import error_details_pb2

from lightning_grpc.access import Credentials
from lightning_grpc.batching import RunInterruption
from lightning_grpc.client import StoreClient, TrainerClient
from lightning_grpc.dashboard import DashboardConfig, RunningDashboard, companion, start_dashboard
from lightning_grpc.dashboard.app import grpc_target
from lightning_grpc.dashboard.connect import Procedure
from lightning_grpc.server.app import RunningServer, ServerConfig, TlsFiles, start_server
from lightning_grpc.v1 import store_service_pb2
from tests.conftest import ServerProcess
from tests.helpers import make_spans, serving, serving_with_proxy

TOKEN = "dashboard-s3cret"
STORE = "/lightning.v1.StoreService"


@dataclass
class Served:
    server: RunningServer
    dashboard: RunningDashboard
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.dashboard.url

    async def call(
        self, path: str, body: Any = None, *, token: str | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """A unary JSON call: (HTTP status, parsed JSON body)."""
        sent = {"Content-Type": "application/json", **(headers or {})}
        if token:
            sent["Authorization"] = f"Bearer {token}"
        async with self.http.post(self.url + path, data=json.dumps(body or {}), headers=sent) as resp:
            return resp.status, json.loads(await resp.read())


def dashboard_companion(
    started: list[RunningDashboard], assets: Path
) -> Callable[[RunningServer], Awaitable[Callable[[], Awaitable[None]]]]:
    """The dashboard as ``serve`` starts it (a companion of the server), keeping hold of it for the test."""

    async def start(server: RunningServer) -> Callable[[], Awaitable[None]]:
        dashboard = await start_dashboard(
            DashboardConfig(host=server.config.host, port=0, assets=assets),
            grpc_target(server),
            server.service_names,
        )
        started.append(dashboard)
        return dashboard.stop

    return start


@pytest_asyncio.fixture
async def open_server(tmp_path: Path) -> AsyncIterator[Served]:
    started: list[RunningDashboard] = []
    config = ServerConfig(port=0, grace=0.5, companions=(dashboard_companion(started, tmp_path / "none"),))
    async with serving(config) as running, aiohttp.ClientSession() as http:
        yield Served(running, started[0], http)


@pytest_asyncio.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Served]:
    """Store, Trainer and Proxy services with a token, the dashboard in front of all three."""
    started: list[RunningDashboard] = []
    config = ServerConfig(
        port=0, grace=0.5, token=TOKEN, companions=(dashboard_companion(started, tmp_path / "none"),)
    )
    async with serving_with_proxy(config) as running, aiohttp.ClientSession() as http:
        yield Served(running, started[0], http)


def error_info(error: dict[str, Any]) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo of a Connect error, decoded from its base64 (sent without padding)."""
    [detail] = error["details"]
    assert detail["type"] == "google.rpc.ErrorInfo"
    assert not detail["value"].endswith("=")
    value = detail["value"]
    return error_details_pb2.ErrorInfo.FromString(base64.b64decode(value + "=" * (-len(value) % 4)))


def enveloped(body: Any, flags: int = 0) -> bytes:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


async def read_envelope(content: aiohttp.StreamReader) -> tuple[int, bytes]:
    flags, length = struct.unpack(">BI", await content.readexactly(5))
    return flags, await content.readexactly(length)


async def read_stream(resp: aiohttp.ClientResponse) -> tuple[list[Any], dict[str, Any]]:
    """Every message of a connect+json stream, and its end-of-stream message."""
    messages = []
    while True:
        flags, payload = await read_envelope(resp.content)
        if flags & 0x02:
            return messages, json.loads(payload)
        assert flags == 0
        messages.append(json.loads(payload))


# ================================================================= unary
async def test_unary_json_round_trips_enqueue_then_list_and_statistics(open_server: Served) -> None:
    status, body = await open_server.call(
        f"{STORE}/EnqueueRollouts", {"rollouts": [{"input": {"q": "2+2"}}, {"input": {"q": "3+3"}}]}
    )
    assert status == 200
    ids = [r["rolloutId"] for r in body["rollouts"]]
    assert len(ids) == 2 and all(r["status"] == "ROLLOUT_STATUS_QUEUING" for r in body["rollouts"])
    status, listed = await open_server.call(f"{STORE}/ListRollouts", {})
    assert status == 200
    assert sorted(r["rolloutId"] for r in listed["rollouts"]) == sorted(ids)
    assert listed["totalSize"] == "2"  # int64 in JSON: a string, the canonical mapping
    status, stats = await open_server.call(f"{STORE}/GetStatistics")
    assert status == 200 and stats["totalRollouts"] == "2" and stats["backend"] == "memory"


async def test_unary_binary_round_trips(open_server: Served) -> None:
    request = store_service_pb2.EnqueueRolloutsRequest()
    request.rollouts.add().input.struct_value.fields["q"].string_value = "binary"
    async with open_server.http.post(
        f"{open_server.url}{STORE}/EnqueueRollouts",
        data=request.SerializeToString(),
        headers={"Content-Type": "application/proto", "Connect-Protocol-Version": "1"},
    ) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/proto"
        enqueued = store_service_pb2.EnqueueRolloutsResponse.FromString(await resp.read())
    rollout_id = enqueued.rollouts[0].rollout_id
    get = store_service_pb2.GetRolloutRequest(rollout_id=rollout_id).SerializeToString()
    async with open_server.http.post(
        f"{open_server.url}{STORE}/GetRollout", data=get, headers={"Content-Type": "application/proto"}
    ) as resp:
        assert resp.status == 200
        got = store_service_pb2.GetRolloutResponse.FromString(await resp.read())
    assert got.rollout.input.struct_value.fields["q"].string_value == "binary"
    # bytes that are no message: the server's own INVALID_ARGUMENT, as JSON
    async with open_server.http.post(
        f"{open_server.url}{STORE}/GetRollout",
        data=b"\xff\xff",
        headers={"Content-Type": "application/proto"},
    ) as resp:
        assert resp.status == 400 and (await resp.json())["code"] == "invalid_argument"


async def test_a_typed_error_is_a_connect_error_with_the_servers_error_info(open_server: Served) -> None:
    status, body = await open_server.call(f"{STORE}/GetRollout", {"rolloutId": "ro-nope"})
    assert status == 404
    assert body["code"] == "not_found" and "ro-nope" in body["message"]
    info = error_info(body)
    assert info.domain == "lightning-grpc.dev" and info.reason == "ROLLOUT_NOT_FOUND"
    assert info.metadata["rolloutId"] == "ro-nope"
    assert "Traceback" not in json.dumps(body)


async def test_bad_json_is_invalid_argument_naming_the_problem(open_server: Served) -> None:
    async with open_server.http.post(
        f"{open_server.url}{STORE}/GetRollout",
        data=b'{"rolloutId": ',
        headers={"Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["code"] == "invalid_argument"
    assert "lightning.v1.GetRolloutRequest" in body["message"] and "JSON" in body["message"]
    assert error_info(body).metadata["field"] == "request"
    status, wrong_type = await open_server.call(f"{STORE}/GetRollout", {"rolloutId": 7})
    assert status == 400 and "rolloutId" in wrong_type["message"]
    # a field this server does not know (a newer dashboard) is ignored, as Connect servers do
    status, _ = await open_server.call(f"{STORE}/GetStatistics", {"fromTheFuture": 1})
    assert status == 200


async def test_unknown_procedures_and_wrong_forms_are_refused_plainly(open_server: Served) -> None:
    status, body = await open_server.call("/lightning.v1.StoreService/Nope")
    assert status == 404 and body["code"] == "unimplemented" and "StoreService/Nope" in body["message"]
    status, body = await open_server.call("/lightning.v1.NoService/Get")
    assert status == 404 and body["code"] == "unimplemented"
    # the proxy's service is not hosted by this server: not served either
    status, body = await open_server.call("/lightning.v1.ProxyService/GetProxyStatus")
    assert status == 404
    async with open_server.http.post(
        f"{open_server.url}{STORE}/GetStatistics", data=b"{}", headers={"Content-Type": "text/plain"}
    ) as resp:
        assert resp.status == 415 and "application/json" in (await resp.json())["message"]
    # a server stream asked for as a unary call
    status, body = await open_server.call(f"{STORE}/WatchRollouts")
    assert status == 415 and "application/connect+json" in body["message"]
    async with open_server.http.put(f"{open_server.url}{STORE}/GetStatistics", data=b"{}") as resp:
        assert resp.status == 405 and "POST" in resp.headers["Allow"]


async def test_client_and_bidi_streams_are_unimplemented_naming_the_method(open_server: Served) -> None:
    status, body = await open_server.call(f"{STORE}/AddSpansStream", {})
    assert status == 501 and body["code"] == "unimplemented"
    assert "AddSpansStream" in body["message"] and "bidirectional" in body["message"]
    async with open_server.http.post(
        f"{open_server.url}{STORE}/AddSpansStream",
        data=enveloped({}),
        headers={"Content-Type": "application/connect+json"},
    ) as resp:
        assert resp.status == 200
        messages, end = await read_stream(resp)
    assert messages == [] and end["error"]["code"] == "unimplemented"
    assert "AddSpansStream" in end["error"]["message"]


async def test_connect_timeout_ms_is_the_calls_deadline(open_server: Served) -> None:
    started = time.monotonic()
    status, body = await open_server.call(
        f"{STORE}/DequeueRollouts",
        {"workerId": "w1", "waitTimeout": "10s"},
        headers={"Connect-Timeout-Ms": "500"},
    )
    # the long-poll ends within the caller's deadline (the server answers empty just before it)
    assert time.monotonic() - started < 3
    assert (status, body) in ((200, {}), (504, {"code": "deadline_exceeded", "message": body.get("message")}))
    status, body = await open_server.call(f"{STORE}/GetStatistics", headers={"Connect-Timeout-Ms": "0"})
    assert status == 504 and body["code"] == "deadline_exceeded"
    status, body = await open_server.call(f"{STORE}/GetStatistics", headers={"Connect-Timeout-Ms": "soon"})
    assert status == 400 and "Connect-Timeout-Ms" in body["message"]


async def test_get_is_for_procedures_free_of_side_effects(
    open_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # StartAttempt is not marked NO_SIDE_EFFECTS in the contract: POST only
    async with open_server.http.get(
        f"{open_server.url}{STORE}/StartAttempt", params={"encoding": "json", "message": "{}"}
    ) as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
    # a read the contract did not mark would be POST only too
    with monkeypatch.context() as patched:
        patched.setattr(Procedure, "side_effect_free", property(lambda self: False))
        async with open_server.http.get(
            f"{open_server.url}{STORE}/GetStatistics", params={"encoding": "json", "message": "{}"}
        ) as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
    # GetStatistics is marked NO_SIDE_EFFECTS (option idempotency_level): it can be called with GET
    message = base64.urlsafe_b64encode(b"{}").decode().rstrip("=")
    async with open_server.http.get(
        f"{open_server.url}{STORE}/GetStatistics",
        params={"connect": "v1", "encoding": "json", "message": message, "base64": "1"},
    ) as resp:
        assert resp.status == 200 and (await resp.json())["backend"] == "memory"
    binary = store_service_pb2.GetStatisticsRequest().SerializeToString()
    async with open_server.http.get(
        f"{open_server.url}{STORE}/GetStatistics",
        params={"encoding": "proto", "message": base64.urlsafe_b64encode(binary).decode(), "base64": "1"},
    ) as resp:
        assert resp.status == 200
        assert store_service_pb2.GetStatisticsResponse.FromString(await resp.read()).backend == "memory"


# ================================================================= server streams
async def test_a_watch_streams_live_then_ends_with_an_end_stream_message(open_server: Served) -> None:
    async with open_server.http.post(
        f"{open_server.url}{STORE}/WatchRollouts",
        data=enveloped({"progressInterval": "0.2s"}),
        headers={"Content-Type": "application/connect+json", "Connect-Timeout-Ms": "2500"},
    ) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/connect+json"
        await read_envelope(resp.content)  # the stream is live: a first (progress) message arrived
        async with StoreClient(open_server.server.address) as client:
            enqueued = await client.enqueue_rollout({"live": True})
        while True:
            flags, payload = await asyncio.wait_for(read_envelope(resp.content), 5)
            assert flags == 0, payload
            message = json.loads(payload)
            if message.get("rollout", {}).get("rolloutId") == enqueued.rollout_id:
                break
        assert message["rollout"]["input"] == {"live": True} and message["resumeToken"]
        # the deadline ends the watch: its status is in the end-of-stream message
        _, end = await asyncio.wait_for(read_stream(resp), 10)
    assert end["error"]["code"] == "deadline_exceeded"


async def test_a_browser_that_leaves_ends_its_watch(open_server: Served) -> None:
    async with open_server.http.post(
        f"{open_server.url}{STORE}/WatchRollouts",
        data=enveloped({"progressInterval": "0.2s"}),
        headers={"Content-Type": "application/connect+json"},
    ) as resp:
        await read_envelope(resp.content)
        assert sum(s.in_flight for s in open_server.server.servicers) == 1
        resp.close()  # the tab is closed
    deadline = time.monotonic() + 5
    while sum(s.in_flight for s in open_server.server.servicers) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sum(s.in_flight for s in open_server.server.servicers) == 0


async def test_a_finite_stream_ends_with_an_empty_end_stream_message(open_server: Served) -> None:
    async with StoreClient(open_server.server.address) as client:
        rollout = await client.start_rollout({"q": 1})
        attempt_id = rollout.latest_attempt.attempt_id if rollout.latest_attempt else ""
        await client.add_spans(make_spans(3), rollout_id=rollout.rollout_id, attempt_id=attempt_id)
    request = store_service_pb2.TailSpansRequest(follow=False)
    request.selector.rollout_id = rollout.rollout_id
    async with open_server.http.post(
        f"{open_server.url}{STORE}/TailSpans",
        data=enveloped(request.SerializeToString()),
        headers={"Content-Type": "application/connect+proto"},
    ) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/connect+proto"
        spans = []
        while True:
            flags, payload = await read_envelope(resp.content)
            if flags & 0x02:
                end = json.loads(payload)  # the end-of-stream message is JSON with every codec
                break
            spans.extend(store_service_pb2.TailSpansResponse.FromString(payload).spans)
    assert end == {}
    assert len(spans) == 3 and {s.name for s in spans} == {"step"}


async def test_a_bad_stream_request_ends_the_stream_with_the_error(open_server: Served) -> None:
    async with open_server.http.post(
        f"{open_server.url}{STORE}/WatchRollouts",
        data=b"{}",  # not enveloped
        headers={"Content-Type": "application/connect+json"},
    ) as resp:
        assert resp.status == 200
        _, end = await read_stream(resp)
    assert end["error"]["code"] == "invalid_argument" and "envelope" in end["error"]["message"]
    async with open_server.http.post(
        f"{open_server.url}{STORE}/TailSpans",
        data=enveloped({"selector": {"rolloutId": "ro-nope"}}),
        headers={"Content-Type": "application/connect+json"},
    ) as resp:
        _, end = await read_stream(resp)
    assert end["error"]["code"] == "not_found"
    assert error_info(end["error"]).reason == "ROLLOUT_NOT_FOUND"


async def test_the_training_pages_watch_serves_a_reported_interruption(open_server: Served) -> None:
    """What the Training page's WatchTraining call (connect+json, as connect-web sends it) gets for a step
    that reported an interruption: the fields its Interruptions section shows."""
    killed = RunInterruption(
        time=1_700_000_000.5,
        process="engine",
        cause="exited with signal 9 (SIGKILL)",
        recovery="restarted on the same port after 1.0 s back-off",
        recovery_seconds=2.5,
        step=7,
    )
    async with TrainerClient(open_server.server.address) as trainer:
        await trainer.report_step(6, 6, {"reward_mean": 0.5}, run_id="page-run")
        await trainer.report_step(7, 7, {"reward_mean": 0.5}, run_id="page-run", interruptions=[killed])
    async with open_server.http.post(
        f"{open_server.url}/lightning.v1.TrainerService/WatchTraining",
        data=enveloped({"afterSequence": "0", "follow": False}),
        headers={"Content-Type": "application/connect+json"},
    ) as resp:
        assert resp.status == 200
        messages, end = await asyncio.wait_for(read_stream(resp), 10)
    assert end == {}
    assert [m["event"]["step"] for m in messages] == ["6", "7"]
    assert "interruptions" not in messages[0]["event"]  # the page shows "none" for it
    assert messages[1]["event"]["interruptions"] == [
        {
            "time": "2023-11-14T22:13:20.500Z",
            "process": "engine",
            "cause": "exited with signal 9 (SIGKILL)",
            "recovery": "restarted on the same port after 1.0 s back-off",
            "recoverySeconds": 2.5,
            "step": "7",
        }
    ]


async def test_a_stream_ends_when_the_server_drains(tmp_path: Path) -> None:
    started: list[RunningDashboard] = []
    running = await start_server(
        ServerConfig(port=0, grace=2.0, companions=(dashboard_companion(started, tmp_path),))
    )
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{started[0].url}{STORE}/WatchRollouts",
            data=enveloped({"progressInterval": "0.2s"}),
            headers={"Content-Type": "application/connect+json"},
        ) as resp,
    ):
        await read_envelope(resp.content)
        stopping = asyncio.create_task(running.stop())
        _, end = await asyncio.wait_for(read_stream(resp), 10)
        await asyncio.wait_for(stopping, 10)
    assert "error" not in end or end["error"]["code"] == "unavailable"


# ================================================================= credentials
async def test_the_gateway_is_behind_the_same_credentials_as_the_api(secured: Served) -> None:
    status, body = await secured.call(f"{STORE}/GetStatistics")
    assert status == 401 and body["code"] == "unauthenticated"
    assert error_info(body).reason == "BAD_TOKEN"
    status, body = await secured.call(f"{STORE}/GetStatistics", token="wrong")
    assert status == 401 and body["code"] == "unauthenticated"
    status, body = await secured.call(f"{STORE}/GetStatistics", token=TOKEN)
    assert status == 200 and body["backend"] == "memory"
    runner = Credentials(TOKEN).runner("w1")
    status, body = await secured.call(f"{STORE}/EnqueueRollouts", {"rollouts": [{}]}, token=runner)
    assert status == 403 and body["code"] == "permission_denied"
    assert error_info(body).reason == "ROLE_NOT_ALLOWED"
    # an attempt credential (as the Store minted it) may read its own rollout, and nothing else
    status, started = await secured.call(f"{STORE}/StartRollout", {"input": {"q": 1}}, token=TOKEN)
    assert status == 200
    rollout_id = started["rollout"]["rolloutId"]
    credential = started["rollout"]["latestAttempt"]["credential"]
    status, _ = await secured.call(f"{STORE}/GetRollout", {"rolloutId": rollout_id}, token=credential)
    assert status == 200
    status, body = await secured.call(f"{STORE}/ListRollouts", {}, token=credential)
    assert status == 403 and body["code"] == "permission_denied"
    # a stream without a credential ends with the same refusal
    async with secured.http.post(
        f"{secured.url}{STORE}/WatchRollouts",
        data=enveloped({}),
        headers={"Content-Type": "application/connect+json"},
    ) as resp:
        messages, end = await read_stream(resp)
    assert messages == [] and end["error"]["code"] == "unauthenticated"


async def test_span_ids_through_the_gateway_are_scoped_like_over_grpc(secured: Served) -> None:
    """AddSpans in JSON with an attempt credential: a span naming another attempt in its own ids is refused
    (PERMISSION_DENIED, nothing stored), whatever the request's ids say."""
    ids = []
    for q in (1, 2):
        status, started = await secured.call(f"{STORE}/StartRollout", {"input": {"q": q}}, token=TOKEN)
        assert status == 200
        ids.append((started["rollout"]["rolloutId"], started["rollout"]["latestAttempt"]))
    (mine, my_attempt), (theirs, their_attempt) = ids
    span = {
        "traceId": "ab" * 16,
        "spanId": "cd" * 8,
        "name": "forged",
        "rolloutId": theirs,
        "attemptId": their_attempt["attemptId"],
    }
    request = {"rolloutId": mine, "attemptId": my_attempt["attemptId"], "spans": [span]}
    status, body = await secured.call(f"{STORE}/AddSpans", request, token=my_attempt["credential"])
    assert status == 403 and body["code"] == "permission_denied", body
    assert error_info(body).reason == "WRONG_ATTEMPT"
    status, listed = await secured.call(
        f"{STORE}/ListSpans", {"selector": {"rolloutId": theirs}}, token=TOKEN
    )
    assert status == 200 and not listed.get("spans"), listed
    status, got = await secured.call(f"{STORE}/GetRollout", {"rolloutId": theirs}, token=TOKEN)
    assert got["rollout"]["latestAttempt"]["status"] == "ATTEMPT_STATUS_PREPARING"


async def test_every_hosted_service_is_served_the_proxys_and_trainers_too(secured: Served) -> None:
    status, body = await secured.call("/lightning.v1.ProxyService/GetProxyStatus", token=TOKEN)
    assert status == 200, body
    status, body = await secured.call("/lightning.v1.TrainerService/GetTrainerStatus", token=TOKEN)
    assert status == 200, body
    status, body = await secured.call("/lightning.v1.TrainerService/GetTrainerStatus")
    assert status == 401


# ================================================================= files and hosts
async def test_static_files_with_the_single_page_fallback(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    (assets / "assets").mkdir(parents=True)
    (assets / "index.html").write_text("<!doctype html><title>lightning</title>")
    (assets / "assets" / "app.js").write_text("console.log('hi')")
    (tmp_path / "secret.txt").write_text("not served")
    started: list[RunningDashboard] = []
    running = await start_server(
        ServerConfig(port=0, grace=0.5, companions=(dashboard_companion(started, assets),))
    )
    url = started[0].url
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/", "/rollouts", "/rollouts/ro-1"):
                async with http.get(url + path) as resp:
                    assert resp.status == 200 and "<title>lightning</title>" in await resp.text(), path
            async with http.get(url + "/assets/app.js") as resp:
                assert resp.status == 200 and await resp.text() == "console.log('hi')"
            async with http.get(url + "/assets/missing.js") as resp:
                assert resp.status == 404
            async with http.get(url + "/%2E%2E/secret.txt") as resp:
                assert resp.status == 404 and "not served" not in await resp.text()
    finally:
        await running.stop()


async def test_without_built_assets_the_root_says_so(open_server: Served) -> None:
    async with open_server.http.get(open_server.url + "/") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        assert "assets are not built" in await resp.text()


async def test_a_loopback_dashboard_answers_only_requests_addressed_to_this_machine(
    open_server: Served,
) -> None:
    """A page of another site that points its own name at 127.0.0.1 (DNS rebinding) gets nothing."""
    for host in ("evil.example", "evil.example:4750"):
        async with open_server.http.post(
            f"{open_server.url}{STORE}/GetStatistics",
            data=b"{}",
            headers={"Content-Type": "application/json", "Host": host},
        ) as resp:
            assert resp.status == 403
    for host in ("localhost", f"localhost:{open_server.dashboard.port}", "127.0.0.1"):
        async with open_server.http.post(
            f"{open_server.url}{STORE}/GetStatistics",
            data=b"{}",
            headers={"Content-Type": "application/json", "Host": host},
        ) as resp:
            assert resp.status == 200, host


# ================================================================= serve
def dashboard_address(process: ServerProcess, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in process.lines:
            if "event=dashboard_started" in line:
                return line.split("http_address=")[1].split()[0]
        time.sleep(0.05)
    raise AssertionError("no dashboard_started line:\n" + "".join(process.lines))


def post_json(url: str, body: Any) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def test_serve_starts_the_dashboard_and_no_dashboard_turns_it_off(
    server_process: type[ServerProcess],
) -> None:
    served = server_process("--memory", "--port", "0", "--dashboard-port", "0").start()
    url = dashboard_address(served)
    assert post_json(url + f"{STORE}/GetStatistics", {})["backend"] == "memory"
    assert served.terminate() == 0
    assert any("event=dashboard_stopped" in line for line in served.lines)
    off = server_process("--memory", "--port", "0", "--no-dashboard").start()
    time.sleep(0.5)
    assert not any("dashboard" in line for line in off.lines)
    assert off.terminate() == 0


def test_a_taken_default_port_falls_back_to_a_free_one(server_process: type[ServerProcess]) -> None:
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", 4750))
        except OSError:
            pass  # something else holds it already: the fallback is tested all the same
        else:
            taken.listen()
        served = server_process("--memory", "--port", "0").start()
        url = dashboard_address(served)
        assert not url.endswith(":4750")
        assert any("event=dashboard_port_taken port=4750" in line for line in served.lines)
        assert post_json(url + f"{STORE}/GetStatistics", {})["backend"] == "memory"
        assert served.terminate() == 0


def test_a_taken_explicit_port_fails_in_one_line(server_process: type[ServerProcess]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = server_process("--memory", "--port", "0", "--dashboard-port", str(port))
        process.start()
        assert process.proc is not None and process._drainer is not None
        assert process.proc.wait(20) == 1
        process._drainer.join(5)
    output = "".join(process.lines)
    assert f"the dashboard cannot listen on 127.0.0.1:{port}" in output
    assert "Traceback" not in output


# ================================================================= TLS
def tls_files(tmp_path: Path, client_ca: bool = False) -> tuple[Any, TlsFiles]:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return ca, TlsFiles(
        tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem" if client_ca else None
    )


async def test_with_tls_the_dashboard_serves_https_and_calls_over_tls(tmp_path: Path) -> None:
    ca, files = tls_files(tmp_path)
    started: list[RunningDashboard] = []

    async def start(server: RunningServer) -> Callable[[], Awaitable[None]]:
        stop = await companion(DashboardConfig(port=0, assets=tmp_path))(server)
        started.append(stop.__self__)  # type: ignore[attr-defined]
        return stop

    running = await start_server(ServerConfig(port=0, grace=0.5, tls=files, token=TOKEN, companions=(start,)))
    try:
        assert started[0].url.startswith("https://")
        trusting = ssl.create_default_context(cadata=ca.cert_pem.bytes().decode())
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{started[0].url}{STORE}/GetStatistics",
                data=b"{}",
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
                ssl=trusting,
            ) as resp,
        ):
            assert resp.status == 200 and (await resp.json())["backend"] == "memory"
    finally:
        await running.stop()


async def test_with_mutual_tls_the_dashboard_is_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, files = tls_files(tmp_path, client_ca=True)
    with caplog.at_level(logging.INFO, logger="lightning_grpc.dashboard"):
        running = await start_server(
            ServerConfig(port=0, grace=0.5, tls=files, companions=(companion(DashboardConfig(port=0)),))
        )
        await running.stop()
    assert "event=dashboard_disabled reason=mutual_tls" in caplog.text
    assert "event=dashboard_started" not in caplog.text
