"""The proxy's HTTP side with credentials: every route walked with every kind of key, through the official
``openai`` client and plain HTTP, against the embedded engine and a real Store with a token.

Then the whole chain a runner fleet uses: a runner holding only its runner credential claims a rollout, and
its agent, unchanged, calls the model with the attempt credential the runner handed it as its API key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from lightning_grpc import semconv
from lightning_grpc.access import PROXY_ROUTES, Credentials
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.proxy import LLMProxy, ProxyConfig
from lightning_grpc.runner import Runner, rollout
from lightning_grpc.runner.llm import openai_client
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from lightning_grpc.types import LLM, Span
from tests.engine_fixtures import Engine, loopback_guard
from tests.helpers import serving

TOKEN = "admin-s3cret"
MESSAGES: Any = [{"role": "user", "content": "What is 2 + 3?"}]
MODEL = "policy"


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    yield from loopback_guard(monkeypatch)


@pytest_asyncio.fixture
async def store_server() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=1.0, token=TOKEN)) as running:
        yield running


@pytest_asyncio.fixture
async def admin(store_server: RunningServer) -> AsyncIterator[StoreClient]:
    client = StoreClient(ClientConfig(target=store_server.address, token=TOKEN))
    try:
        yield client
    finally:
        await client.close()


@pytest_asyncio.fixture
async def proxy(store_server: RunningServer, engine: Engine) -> AsyncIterator[LLMProxy]:
    """A proxy recording into the Store with the admin token: it checks credentials under that token."""
    store = ClientConfig(target=store_server.address, token=TOKEN)
    running = await LLMProxy(ProxyConfig(store=store, backends=[engine.backend(MODEL)])).start()
    try:
        yield running
    finally:
        await running.stop(5)


async def claimed_attempt(
    store_server: RunningServer, admin: StoreClient, worker: str
) -> tuple[str, str, str]:
    """Enqueue a train rollout and claim it as ``worker`` with its runner credential: (rollout, attempt, credential)."""
    await admin.enqueue_rollouts([{"input": {"q": worker}, "mode": "train"}])
    runner = StoreClient(ClientConfig(target=store_server.address, token=Credentials(TOKEN).runner(worker)))
    try:
        [claimed] = await runner.dequeue_rollouts(worker_id=worker)
    finally:
        await runner.close()
    assert claimed.latest_attempt is not None and claimed.latest_attempt.credential
    return claimed.rollout_id, claimed.latest_attempt.attempt_id, claimed.latest_attempt.credential


async def llm_spans(admin: StoreClient, rollout_id: str) -> list[Span]:
    return [s for s in await admin.query_spans(rollout_id) if s.name == semconv.SPAN_LLM_CALL]


def route_url(proxy: LLMProxy, pattern: str, rollout_id: str, attempt_id: str) -> str:
    return proxy.base_url + pattern.format(rollout_id=rollout_id, attempt_id=attempt_id)


def body_for(path: str) -> dict[str, Any] | None:
    if path.endswith("chat/completions"):
        return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    if path.endswith("/completions"):
        return {"model": MODEL, "prompt": "2 + 3 =", "max_tokens": 2}
    if path.endswith("/responses"):
        return {"model": MODEL, "input": "What is 2 + 3?", "max_output_tokens": 2}
    if path.endswith("/messages"):
        return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    return None


#: Anthropic's error bodies carry a type and no code: the type each refusal has there.
ANTHROPIC_TYPES = {
    "invalid_api_key": "authentication_error",
    "role_not_allowed": "permission_error",
    "attempt_required": "permission_error",
    "wrong_attempt": "permission_error",
}


def code_of(payload: Any) -> str:
    """An error body's code (OpenAI's shape), or its type (Anthropic's)."""
    return str(payload["error"].get("code") or payload["error"]["type"])


def code_in(pattern: str, code: str) -> str:
    return ANTHROPIC_TYPES[code] if pattern.endswith("/v1/messages") else code


async def test_every_route_takes_the_keys_the_table_names_and_refuses_the_rest(
    proxy: LLMProxy, store_server: RunningServer, admin: StoreClient
) -> None:
    mine = await claimed_attempt(store_server, admin, "w1")
    theirs = await claimed_attempt(store_server, admin, "w2")
    keys = {
        "none": None,
        "wrong": "sk-not-a-credential",
        "runner": Credentials(TOKEN).runner("w1"),
        "attempt": mine[2],
        "admin": TOKEN,
    }
    async with aiohttp.ClientSession() as http:
        for (verb, pattern), roles in PROXY_ROUTES.items():
            prefixed = "{attempt_id}" in pattern
            for name, key in keys.items():
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                url = route_url(proxy, pattern, *mine[:2])
                async with http.request(verb, url, json=body_for(pattern), headers=headers) as resp:
                    status, payload = resp.status, await resp.json()
                if roles is None:
                    assert status == 200, (pattern, name, payload)
                elif name in ("none", "wrong"):
                    assert status == 401 and code_of(payload) == code_in(pattern, "invalid_api_key"), (
                        pattern,
                        name,
                    )
                elif name == "runner":
                    assert status == 403 and code_of(payload) == code_in(pattern, "role_not_allowed"), (
                        pattern,
                        name,
                    )
                elif name == "admin" and not prefixed and verb == "POST":
                    # the admin token names no attempt: with credentials on, unattributed calls are refused
                    assert status == 403 and code_of(payload) == code_in(pattern, "attempt_required"), (
                        pattern,
                        payload,
                    )
                else:
                    assert status == 200, (pattern, name, payload)
                if prefixed and roles is not None and name == "attempt":
                    # the same credential on another attempt's route: refused
                    url = route_url(proxy, pattern, *theirs[:2])
                    async with http.request(verb, url, json=body_for(pattern), headers=headers) as resp:
                        assert resp.status == 403, (pattern, await resp.text())
                        assert code_of(await resp.json()) == code_in(pattern, "wrong_attempt")
    # the attempt credential recorded its calls under its own attempt (4 prefixed + 4 bare completion
    # routes: chat, completions, responses, messages), and nothing ever reached the other attempt
    recorded = await llm_spans(admin, mine[0])
    assert len(recorded) == 8 + 4  # and the admin's four calls on the prefixed routes
    assert {s.attempt_id for s in recorded} == {mine[1]}
    assert await llm_spans(admin, theirs[0]) == []


async def test_an_attempt_credential_cannot_name_another_attempt_in_headers(
    proxy: LLMProxy, store_server: RunningServer, admin: StoreClient
) -> None:
    mine = await claimed_attempt(store_server, admin, "w1")
    theirs = await claimed_attempt(store_server, admin, "w2")
    client = openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=mine[2], max_retries=0)
    try:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=2,
                extra_headers={semconv.ROLLOUT_ID_HEADER: theirs[0], semconv.ATTEMPT_ID_HEADER: theirs[1]},
            )
        assert refused.value.body["code"] == "wrong_attempt"  # type: ignore[index]
        # on the bare route with no headers, the call is the credential's own
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    finally:
        await client.close()
    assert await llm_spans(admin, theirs[0]) == []
    assert [s.attempt_id for s in await llm_spans(admin, mine[0])] == [mine[1]]
    assert proxy.status().refused_calls >= 1


async def test_an_ended_attempts_credential_gets_no_more_calls(
    proxy: LLMProxy, store_server: RunningServer, admin: StoreClient
) -> None:
    rollout_id, attempt_id, credential = await claimed_attempt(store_server, admin, "w1")
    await admin.complete_attempt(rollout_id, attempt_id, "succeeded")
    client = openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=credential, max_retries=0)
    try:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert refused.value.status_code == 410
    finally:
        await client.close()
    assert await llm_spans(admin, rollout_id) == []


async def test_a_runner_with_only_its_runner_credential_runs_an_unchanged_agent_through_the_proxy(
    proxy: LLMProxy, store_server: RunningServer, admin: StoreClient
) -> None:
    """The fleet's chain: runner credential -> dequeue -> attempt credential -> the agent's API key."""
    keys_seen: list[str] = []

    @rollout
    async def agent(task: Any, llm: LLM) -> float:
        keys_seen.append(llm.api_key)
        reply = await openai_client(llm).chat.completions.create(
            model=llm.model, messages=MESSAGES, max_tokens=2
        )
        return 1.0 if reply.choices else 0.0

    resources = await admin.add_resources({"main_llm": proxy.proxy_llm(MODEL)})
    [queued] = await admin.enqueue_rollouts(
        [{"input": {"q": 1}, "mode": "train", "resources_id": resources.resources_id}]
    )
    credential = Credentials(TOKEN).runner("gpu-node-7")
    runner = Runner(
        agent, ClientConfig(target=store_server.address, token=credential), max_rollouts=1, poll_wait=0.2
    )
    assert runner.worker_id == "gpu-node-7"  # taken from the credential
    await runner.run()
    assert runner.succeeded == 1, (runner.failed, runner.stopped)
    finished = await admin.get_rollout(queued.rollout_id)
    assert finished.status.name == "SUCCEEDED"
    assert finished.latest_attempt is not None and finished.latest_attempt.worker_id == "gpu-node-7"
    [key] = keys_seen
    claims = key.split(".")
    assert claims[0] == "lgc1" and key != credential  # the attempt's own credential, not the runner's
    [call] = await llm_spans(admin, queued.rollout_id)
    assert call.attempt_id == finished.latest_attempt.attempt_id


async def test_a_store_out_of_reach_is_a_server_side_error_that_names_no_address(engine: Engine) -> None:
    """The standalone proxy's Store goes away: the agent's call is a 503 of the server's side (api_error)
    with Retry-After, and neither the Store's address nor its port reaches the agent."""
    store_server = await start_server(ServerConfig(port=0, grace=0.5, token=TOKEN))
    store = ClientConfig(target=store_server.address, token=TOKEN, timeout=3)
    proxy = await LLMProxy(ProxyConfig(store=store, backends=[engine.backend(MODEL)])).start()
    try:
        admin = StoreClient(store)
        try:
            rollout_id, attempt_id, credential = await claimed_attempt(store_server, admin, "w1")
        finally:
            await admin.close()
        await store_server.stop()
        async with aiohttp.ClientSession() as http:
            reply = await http.post(
                f"{proxy.base_url}/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions",
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                headers={"Authorization": f"Bearer {credential}"},
            )
            body = await reply.json()
            text = await reply.text()
        assert reply.status == 503, body
        assert body["error"]["code"] == "store_unavailable"
        assert body["error"]["type"] == "api_error"
        assert reply.headers.get("Retry-After")
        assert "127.0.0.1" not in text and str(store_server.port) not in text and "ipv4" not in text
    finally:
        await proxy.stop(1)
        await store_server.stop()
