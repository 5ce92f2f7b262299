"""The LLM proxy, end to end: agents using the official ``openai`` client through the proxy against the
embedded engine serving a tiny local model, with every call recorded in a real Store.

Nothing is mocked: the engine runs as ``lightning-grpc engine`` in its own process, the Store is a real
gRPC server, LiteLLM is the real library. No test may reach beyond the loopback interface.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lightning_grpc import semconv
from lightning_grpc.client import ProxyClient, StoreClient
from lightning_grpc.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from lightning_grpc.proxy import Backend, BackendDialect, LLMProxy, ProxyConfig
from lightning_grpc.proxy.recorder import SpanRecorder
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from lightning_grpc.server.proxy_app import RunningProxy, start_proxy_server
from lightning_grpc.server.proxy_servicer import PROXY_SERVICE
from lightning_grpc.types import RolloutConfig, Span
from lightning_grpc.v1 import proxy_service_pb2 as ppb
from lightning_grpc.v1 import proxy_service_pb2_grpc as ppb_grpc
from tests.conftest import ROOT
from tests.engine_fixtures import CLI, MODEL, QUIET_ENV, Engine, loopback_guard

MESSAGES: Any = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]
#: Keep the engine and the CLI processes polite on a shared machine.


# ---------------------------------------------------------------- no internet, ever
@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    yield from loopback_guard(monkeypatch)


# ---------------------------------------------------------------- store, proxy, agents
def _config(store_server: RunningServer, backends: list[Backend], **kw: Any) -> ProxyConfig:
    return ProxyConfig(store=f"127.0.0.1:{store_server.port}", backends=backends, **kw)


@pytest_asyncio.fixture
async def proxy(store_server: RunningServer, engine: Engine) -> AsyncIterator[LLMProxy]:
    running = await LLMProxy(_config(store_server, [engine.backend()])).start()
    try:
        yield running
    finally:
        await running.stop(5)


@pytest_asyncio.fixture
async def proxy_server(store_server: RunningServer, engine: Engine) -> AsyncIterator[RunningProxy]:
    """A proxy with its own gRPC server (ProxyService, health, reflection)."""
    running = await start_proxy_server(_config(store_server, [engine.backend()]))
    try:
        yield running
    finally:
        await running.stop(5)


@pytest_asyncio.fixture
async def control(proxy_server: RunningProxy) -> AsyncIterator[ProxyClient]:
    client = ProxyClient(proxy_server.grpc_address)
    try:
        yield client
    finally:
        await client.close()


async def new_attempt(store: StoreClient, mode: str = "train", **kw: Any) -> tuple[str, str]:
    rollout = await store.start_rollout({"task": "t"}, mode=mode, **kw)
    assert rollout.latest_attempt is not None
    return rollout.rollout_id, rollout.latest_attempt.attempt_id


_CLIENTS: list[openai.AsyncOpenAI] = []


def openai_client(base_url: str, *, max_retries: int = 0) -> openai.AsyncOpenAI:
    """The official OpenAI client (closed after the test)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=max_retries)
    _CLIENTS.append(client)
    return client


@pytest_asyncio.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


def agent(proxy: LLMProxy, rollout_id: str, attempt_id: str, *, max_retries: int = 0) -> openai.AsyncOpenAI:
    """An agent's client, pointed at the attempt's routed URL."""
    endpoint = proxy.proxy_llm(MODEL).for_attempt(rollout_id, attempt_id).endpoint
    return openai_client(endpoint, max_retries=max_retries)


async def llm_spans(store: StoreClient, rollout_id: str) -> list[Span]:
    return [s for s in await store.query_spans(rollout_id) if s.name == semconv.SPAN_LLM_CALL]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


async def stream_chat(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, list[Any]]:
    chunks = []
    stream = await client.chat.completions.create(model=MODEL, stream=True, **kw)
    async for chunk in stream:
        chunks.append(chunk)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ================================================================= token ids
async def test_chat_records_the_engines_token_ids(
    proxy: LLMProxy, store: StoreClient, tokenizer: Any, engine: Engine
) -> None:
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    [span] = await llm_spans(store, rid)
    attrs = span.attributes
    assert span.attempt_id == aid and span.status_code == 1 and not span.status_message
    # The prompt ids are the engine's tokenization of the chat; the response ids are what it sampled.
    assert attrs[semconv.LLM_PROMPT_TOKEN_IDS] == chat_prompt_ids(tokenizer, MESSAGES)
    response_ids = attrs[semconv.LLM_RESPONSE_TOKEN_IDS]
    assert response_ids == resp.choices[0].model_extra["token_ids"]
    assert resp.model_extra["prompt_token_ids"] == attrs[semconv.LLM_PROMPT_TOKEN_IDS]
    assert tokenizer.decode(response_ids, skip_special_tokens=True) == resp.choices[0].message.content
    assert 1 <= len(response_ids) <= 12
    # Everything else a trainer and an operator want.
    assert attrs[semconv.LLM_MODEL] == MODEL
    assert attrs[semconv.LLM_BACKEND] == engine.api_base
    assert attrs[semconv.LLM_POLICY_VERSION] == resp.model_extra["policy_version"]
    assert attrs[semconv.LLM_RESPONSE_ID] == resp.id
    assert attrs[semconv.LLM_FINISH_REASON] == resp.choices[0].finish_reason
    assert attrs[semconv.LLM_STREAMED] is False
    assert attrs[semconv.LLM_LATENCY_MS] > 0
    assert (
        attrs[semconv.LLM_USAGE_PROMPT_TOKENS]
        == resp.usage.prompt_tokens
        == len(attrs[semconv.LLM_PROMPT_TOKEN_IDS])
    )
    assert attrs[semconv.LLM_USAGE_COMPLETION_TOKENS] == resp.usage.completion_tokens == len(response_ids)
    request = json.loads(attrs[semconv.LLM_REQUEST])
    assert request["messages"] == MESSAGES and request["return_token_ids"] is True
    assert request["model"] == engine.served_model
    assert (
        json.loads(attrs[semconv.LLM_RESPONSE])["choices"][0]["message"]["content"]
        == resp.choices[0].message.content
    )
    assert semconv.LLM_ERROR not in attrs
    assert span.end_time_unix_nano > span.start_time_unix_nano
    # The call counted as a heartbeat: the attempt is running.
    attempt = (await store.get_rollout(rid)).latest_attempt
    assert attempt is not None and attempt.status.name == "RUNNING" and attempt.last_heartbeat_time


async def test_streamed_and_whole_calls_record_identical_ids(
    proxy: LLMProxy, store: StoreClient, tokenizer: Any
) -> None:
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    params: dict[str, Any] = {
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = await client.chat.completions.create(model=MODEL, **params)
    text, chunks = await stream_chat(client, **params)
    first, second = await llm_spans(store, rid)
    assert (first.attributes[semconv.LLM_STREAMED], second.attributes[semconv.LLM_STREAMED]) == (False, True)
    for key in (semconv.LLM_PROMPT_TOKEN_IDS, semconv.LLM_RESPONSE_TOKEN_IDS):
        assert first.attributes[key] == second.attributes[key]
    assert len(second.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) == 24
    # The agent got what it asked for: the same text, in many chunks, with vLLM's fields passed through.
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2
    assert chunks[0].model_extra["prompt_token_ids"] == first.attributes[semconv.LLM_PROMPT_TOKEN_IDS]
    streamed = json.loads(second.attributes[semconv.LLM_RESPONSE])
    assert streamed["choices"][0]["message"]["content"] == text
    assert second.attributes[semconv.LLM_FINISH_REASON] == whole.choices[0].finish_reason
    assert second.attributes[semconv.LLM_USAGE_COMPLETION_TOKENS] == 24


PRESS: Any = {
    "type": "function",
    "function": {
        "name": "press",
        "parameters": {
            "type": "object",
            "properties": {"digit": {"type": "integer", "enum": list(range(10))}},
            "required": ["digit"],
        },
    },
}


async def test_a_forced_calls_positions_are_recorded_streamed_or_not(
    proxy: LLMProxy, store: StoreClient, tokenizer: Any
) -> None:
    """The engine forces every token of a named call but the digit: the span says which, streamed or not."""
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    params: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": [PRESS],
        "tool_choice": {"type": "function", "function": {"name": "press"}},
        "max_tokens": 100,
        "temperature": 1.5,
        "seed": 4,
    }
    await client.chat.completions.create(model=MODEL, **params)
    await stream_chat(client, **params)
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    whole, streamed, plain = await llm_spans(store, rid)
    ids = whole.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]
    forced = whole.attributes[semconv.LLM_RESPONSE_FORCED_POSITIONS]
    assert streamed.attributes[semconv.LLM_RESPONSE_TOKEN_IDS] == ids
    assert streamed.attributes[semconv.LLM_RESPONSE_FORCED_POSITIONS] == forced
    [free] = sorted(set(range(len(ids))) - set(forced))
    assert tokenizer.decode([ids[free]]).isdigit() and len(ids) - 1 in forced
    assert semconv.LLM_RESPONSE_FORCED_POSITIONS not in plain.attributes


async def test_stream_reaches_the_agent_while_the_engine_still_generates(
    proxy: LLMProxy, store: StoreClient
) -> None:
    """Real streaming: the first chunk arrives long before the call ends (nothing is buffered)."""
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    started = time.monotonic()
    arrivals: list[float] = []
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
    total = time.monotonic() - started
    [span] = await llm_spans(store, rid)
    assert len(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) == 400
    assert arrivals[0] < total / 2, (arrivals[0], total)


async def test_completions_record_ids_streamed_or_not(
    proxy: LLMProxy, store: StoreClient, tokenizer: Any
) -> None:
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    prompt = "The agent calls a tool and"
    params: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    whole = await client.completions.create(**params)
    stream = await client.completions.create(stream=True, **params)
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    first, second = await llm_spans(store, rid)
    assert first.attributes[semconv.LLM_PROMPT_TOKEN_IDS] == tokenizer.encode(prompt)
    for key in (semconv.LLM_PROMPT_TOKEN_IDS, semconv.LLM_RESPONSE_TOKEN_IDS, semconv.LLM_RESPONSE_LOGPROBS):
        assert first.attributes[key] == pytest.approx(second.attributes[key]), key
    assert text == whole.choices[0].text
    assert json.loads(first.attributes[semconv.LLM_REQUEST])["logprobs"] == 0


# ================================================================= logprobs and modes
async def test_train_rollouts_get_logprobs_and_val_rollouts_do_not(
    proxy: LLMProxy, store: StoreClient
) -> None:
    train_rid, train_aid = await new_attempt(store, mode="train")
    val_rid, val_aid = await new_attempt(store, mode="val")
    params: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 8}
    await agent(proxy, train_rid, train_aid).chat.completions.create(model=MODEL, **params)
    await stream_chat(agent(proxy, train_rid, train_aid), **params)
    val = await agent(proxy, val_rid, val_aid).chat.completions.create(model=MODEL, **params)
    for span in await llm_spans(store, train_rid):
        logprobs = span.attributes[semconv.LLM_RESPONSE_LOGPROBS]
        assert len(logprobs) == len(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS])
        assert all(isinstance(x, float) and x <= 0.0 for x in logprobs)
    [val_span] = await llm_spans(store, val_rid)
    assert semconv.LLM_RESPONSE_LOGPROBS not in val_span.attributes
    assert val_span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]  # token ids are recorded in every mode
    assert val.choices[0].logprobs is None  # nothing was added to what the val agent asked for
    # An agent that asks for logprobs itself gets them in every mode.
    asked = await agent(proxy, val_rid, val_aid).chat.completions.create(model=MODEL, logprobs=True, **params)
    assert asked.choices[0].logprobs is not None


# ================================================================= many agents
async def test_32_concurrent_agents_each_recorded_once_under_its_attempt(
    proxy: LLMProxy, store: StoreClient
) -> None:
    async def one_agent(i: int) -> tuple[str, str]:
        rid, aid = await new_attempt(store)
        client = agent(proxy, rid, aid)
        marker = f"agent number {i}"
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": marker}], max_tokens=6
        )
        await stream_chat(client, messages=[{"role": "user", "content": marker + " again"}], max_tokens=6)
        await store.complete_attempt(rid, aid, "succeeded")
        return rid, aid

    done = await asyncio.gather(*(one_agent(i) for i in range(32)))
    span_ids: set[str] = set()
    for i, (rid, aid) in enumerate(done):
        spans = await llm_spans(store, rid)
        assert len(spans) == 2, (rid, len(spans))
        for span in spans:
            assert span.attempt_id == aid and span.status_code == 1
            assert (
                f"agent number {i}"
                in json.loads(span.attributes[semconv.LLM_REQUEST])["messages"][0]["content"]
            )
            assert span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]
            span_ids.add(span.span_id)
    assert len(span_ids) == 64
    status = proxy.status()
    assert (status.total_calls, status.total_errors, status.in_flight, status.spans_stored) == (64, 0, 0, 64)


# ================================================================= pause, drain, backends
async def test_pause_refuses_with_retry_after_and_drain_waits_for_calls_in_flight(
    proxy_server: RunningProxy, control: ProxyClient, store: StoreClient
) -> None:
    proxy = proxy_server.proxy
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    )
    iterator = stream.__aiter__()
    await iterator.__anext__()  # the call is in flight now
    assert await control.pause("weight update", retry_after=2.5) == 1
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert refused.value.response.headers["Retry-After"] == "3"
    assert refused.value.response.headers["retry-after-ms"] == "2500"
    assert refused.value.body["code"] == "proxy_paused"  # type: ignore[index]
    assert await control.drain(timeout=0) == 1  # still generating
    drained = asyncio.create_task(control.drain(timeout=60))
    rest = [chunk async for chunk in iterator]
    assert await drained == 0 and rest
    assert (await control.status()).in_flight == 0
    [span] = await llm_spans(store, rid)  # the refused call is not recorded; the streamed one is
    assert len(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) == 300
    status = await control.status()
    assert status.paused and status.refused_calls == 1
    await control.resume()
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert len(await llm_spans(store, rid)) == 2


async def test_a_paused_call_succeeds_once_resumed_thanks_to_retry_after(
    proxy: LLMProxy, store: StoreClient
) -> None:
    rid, aid = await new_attempt(store)
    proxy.pause("weights", retry_after=0.3)
    client = agent(proxy, rid, aid, max_retries=5)
    asyncio.get_running_loop().call_later(0.5, proxy.resume)
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert resp.choices[0].message.content is not None
    assert len(await llm_spans(store, rid)) == 1 and proxy.refused_calls >= 1


async def test_backend_list_updates_apply_without_restart(
    proxy_server: RunningProxy, control: ProxyClient, store: StoreClient, engine: Engine
) -> None:
    proxy = proxy_server.proxy
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    await control.set_backends([engine.backend("renamed", policy_version=7)])
    assert [m.id async for m in client.models.list()] == ["renamed"]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    await client.chat.completions.create(model="renamed", messages=MESSAGES, max_tokens=4)
    [span] = await llm_spans(store, rid)
    assert span.attributes[semconv.LLM_MODEL] == "renamed"
    assert span.attributes[semconv.LLM_BACKEND] == engine.api_base


async def test_calls_of_one_rollout_stick_to_one_backend(
    proxy: LLMProxy, store: StoreClient, engine: Engine
) -> None:
    port = engine.api_base.split(":")[-1].split("/")[0]
    second = f"http://localhost:{port}/v1"  # the same engine under a second name: two backends
    proxy.set_backends([engine.backend(), Backend(MODEL, second, backend_model=engine.served_model)])

    async def rollout() -> set[str]:
        rid, aid = await new_attempt(store)
        client = agent(proxy, rid, aid)
        for _ in range(3):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        return {s.attributes[semconv.LLM_BACKEND] for s in await llm_spans(store, rid)}

    used = await asyncio.gather(*(rollout() for _ in range(12)))
    # the rollout ids are random: 12 rollouts all land on one of two backends once in 2,048 runs,
    # so go on, one rollout at a time, until both are used (a failure once in 2**63 runs)
    while len(set().union(*used)) < 2 and len(used) < 64:
        used.append(await rollout())
    assert all(len(backends) == 1 for backends in used)
    assert set().union(*used) == {engine.api_base, second}
    assert {k: v.calls for k, v in proxy.status().backends.items()} == {
        b: 3 * sum(1 for u in used if b in u) for b in (engine.api_base, second)
    }


# ================================================================= refused attempts
async def test_unknown_and_finished_attempts_are_refused_and_not_recorded(
    proxy: LLMProxy, store: StoreClient
) -> None:
    rid, _ = await new_attempt(store)
    cases: list[tuple[str, str, int, str]] = [("ro-nope", "at-nope", 404, "attempt_not_found")]
    cases.append((rid, "at-nope", 404, "attempt_not_found"))
    done_rid, done_aid = await new_attempt(store)
    await store.complete_attempt(done_rid, done_aid, "succeeded")
    cases.append((done_rid, done_aid, 410, "attempt_finished"))
    cancelled_rid, cancelled_aid = await new_attempt(store)
    await store.cancel_rollout(cancelled_rid)
    cases.append((cancelled_rid, cancelled_aid, 410, "attempt_finished"))
    for case_rid, case_aid, status, code in cases:
        with pytest.raises(openai.APIStatusError) as refused:
            await agent(proxy, case_rid, case_aid).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4
            )
        assert refused.value.status_code == status
        assert refused.value.body["code"] == code  # type: ignore[index]
        assert refused.value.body["message"]  # type: ignore[index]
    for known in (rid, done_rid, cancelled_rid):
        assert await llm_spans(store, known) == []
    status = proxy.status()
    assert status.refused_calls == 4 and status.total_calls == 0


async def test_calls_without_an_attempt_are_forwarded_unrecorded_or_refused(
    proxy: LLMProxy, store: StoreClient, store_server: RunningServer, engine: Engine
) -> None:
    plain = openai_client(f"{proxy.base_url}/v1")
    resp = await plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert resp.choices[0].model_extra["token_ids"]
    assert (await store.statistics()).total_spans == 0
    # The attribution headers stand in for the URL prefix.
    rid, aid = await new_attempt(store)
    headers = {semconv.ROLLOUT_ID_HEADER: rid, semconv.ATTEMPT_ID_HEADER: aid}
    await plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers=headers)
    assert len(await llm_spans(store, rid)) == 1
    strict = await LLMProxy(_config(store_server, [engine.backend()], unattributed="refuse")).start()
    try:
        refusing = openai_client(f"{strict.base_url}/v1")
        with pytest.raises(openai.PermissionDeniedError):
            await refusing.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    finally:
        await strict.stop(1)


# ================================================================= errors are recorded
async def test_an_unreachable_backend_is_recorded_as_an_error_span(
    store_server: RunningServer, store: StoreClient
) -> None:
    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    proxy = await LLMProxy(_config(store_server, [Backend(MODEL, dead)], retries=1)).start()
    try:
        rid, aid = await new_attempt(store)
        for streamed in (False, True):
            with pytest.raises(openai.APIStatusError) as failed:
                await agent(proxy, rid, aid).chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4, stream=streamed
                )
            assert failed.value.status_code == 502
            assert failed.value.body["code"] == "backend_unreachable"  # type: ignore[index]
            # the agent learns which model's backend failed, never where it lives
            told = json.dumps(failed.value.body)
            assert "the backend of model 'policy' could not be reached" in told
            assert "127.0.0.1" not in told and dead not in told
        spans = await llm_spans(store, rid)
        assert len(spans) == 2
        for span in spans:
            assert span.status_code == 2 and "unreachable" in span.status_message
            assert "unreachable" in span.attributes[semconv.LLM_ERROR]
            assert span.attributes[semconv.LLM_BACKEND] == dead
            assert semconv.LLM_RESPONSE_TOKEN_IDS not in span.attributes
        assert proxy.status().total_errors == 2
        assert proxy.status().backends[dead].errors == 2
    finally:
        await proxy.stop(1)


async def test_a_request_the_engine_rejects_is_recorded_as_an_error_span(
    proxy: LLMProxy, store: StoreClient
) -> None:
    rid, aid = await new_attempt(store)
    client = agent(proxy, rid, aid)
    for streamed in (False, True):
        with pytest.raises(openai.BadRequestError) as rejected:
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, stream=streamed, extra_body={"min_p": 0.5}
            )
        assert "min_p" in str(rejected.value)  # the engine's own error reached the agent unchanged
    spans = await llm_spans(store, rid)
    assert len(spans) == 2
    for span in spans:
        assert span.status_code == 2
        assert (
            span.attributes[semconv.LLM_ERROR].startswith("HTTP 400")
            and "min_p" in span.attributes[semconv.LLM_ERROR]
        )
        assert "min_p" in span.attributes[semconv.LLM_RESPONSE]


async def test_the_span_records_the_request_sent_and_the_answer_exactly_as_the_engine_sent_it(
    proxy: LLMProxy, store: StoreClient
) -> None:
    rid, aid = await new_attempt(store)
    url = proxy.proxy_llm(MODEL).for_attempt(rid, aid).endpoint + "/chat/completions"
    messages = [{"role": "user", "content": "Grüße, 世界 \U0001f600: what is 2 + 3?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200
        answered = await resp.text()
    [span] = await llm_spans(store, rid)
    assert span.attributes[semconv.LLM_RESPONSE] == answered  # the engine's JSON text, not re-encoded
    request = json.loads(span.attributes[semconv.LLM_REQUEST])
    assert request["messages"] == messages and request["max_tokens"] == 6
    prompt = json.loads(answered)["prompt_token_ids"]
    assert span.attributes[semconv.LLM_PROMPT_TOKEN_IDS] == prompt  # the engine read the same request


async def test_an_agent_leaving_mid_stream_is_recorded(proxy: LLMProxy, store: StoreClient) -> None:
    rid, aid = await new_attempt(store)
    url = proxy.proxy_llm(MODEL).for_attempt(rid, aid).endpoint + "/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # one line of the first event, then hang up
        resp.close()
    for _ in range(200):
        spans = await llm_spans(store, rid)
        if spans:
            break
        await asyncio.sleep(0.05)
    [span] = spans
    assert span.status_code == 2 and "disconnected" in span.attributes[semconv.LLM_ERROR]
    assert span.attributes[semconv.LLM_PROMPT_TOKEN_IDS]
    assert len(span.attributes.get(semconv.LLM_RESPONSE_TOKEN_IDS, [])) < 1500


async def test_a_long_call_keeps_its_attempt_alive(
    store_server: RunningServer, store: StoreClient, engine: Engine
) -> None:
    """Calls heartbeat their attempt while they run, so a long generation is not taken for silence."""
    proxy = await LLMProxy(_config(store_server, [engine.backend()], heartbeat_interval=0.1)).start()
    # The store, the proxy and this test share one process: late in a long session a full collection of its
    # heap paused it for over a second, heartbeats and all. The heap the session built is left out of
    # collections while the call runs, and any pause left is measured.
    gc.collect()
    gc.freeze()
    pauses = LoopPauses()
    try:
        await openai_client(f"{proxy.base_url}/v1").models.list()  # warm the client's lazy imports up
        silence = 1.0  # 1,500 tokens take 3-4 s here, so without heartbeats the attempt is taken for silent
        rid, aid = await new_attempt(store, config=RolloutConfig(unresponsive_timeout=silence))
        started = time.monotonic()
        await stream_chat(
            agent(proxy, rid, aid), messages=MESSAGES, max_tokens=1500, extra_body={"ignore_eos": True}
        )
        if time.monotonic() - started < 2 * silence:
            pytest.skip("the engine generated too fast to outlast the unresponsive timeout twice")
        attempt = (await store.get_rollout(rid)).latest_attempt
        assert attempt is not None
        if attempt.status.name != "RUNNING" and pauses.idle_stop >= 0.8 * silence:
            pytest.skip(f"the machine stopped this process for {pauses.idle_stop:.2f} s, heartbeats and all")
        assert attempt.status.name == "RUNNING", f"{attempt}; {pauses}"
        [span] = await llm_spans(store, rid)
        assert span.status_code == 1
    finally:
        pauses.stop()
        gc.unfreeze()
        await proxy.stop(1)


class LoopPauses:
    """The longest stretch the running event loop did not get to run a timer, and of those, the longest in
    which this thread used under half the time on the CPU (so the machine stopped it, not code of the process)."""

    def __init__(self, tick: float = 0.02) -> None:
        self.longest = 0.0
        self.idle_stop = 0.0
        self._task = asyncio.create_task(self._watch(tick))

    async def _watch(self, tick: float) -> None:
        while True:
            wall, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(tick)
            late = time.monotonic() - wall - tick
            self.longest = max(self.longest, late)
            if time.thread_time() - cpu < (late + tick) / 2:
                self.idle_stop = max(self.idle_stop, late)

    def stop(self) -> None:
        self._task.cancel()

    def __str__(self) -> str:
        return f"longest pause of the event loop {self.longest:.2f} s, of the machine {self.idle_stop:.2f} s"


async def test_a_call_heartbeats_its_attempt_only_once_it_outlasts_the_interval_and_stops_when_it_ends(
    store: StoreClient,
) -> None:
    from lightning_grpc.proxy.attempts import AttemptGate

    async def last_beat(rid: str) -> float | None:
        attempt = (await store.get_rollout(rid)).latest_attempt
        assert attempt is not None
        return attempt.last_heartbeat_time

    gate = AttemptGate(store)
    rid, aid = await new_attempt(store)
    start = await last_beat(rid)
    short = gate.keep_alive(rid, aid, 0.2)  # a call that ends within the interval
    await asyncio.sleep(0.05)
    short.cancel()
    await asyncio.sleep(0.3)
    assert await last_beat(rid) == start

    long = gate.keep_alive(rid, aid, 0.1)  # a call that runs for several intervals
    seen = []
    for _ in range(3):
        await asyncio.sleep(0.15)
        seen.append(await last_beat(rid))
    long.cancel()
    beats = [b for b in seen if b is not None]
    assert len(beats) == 3 and (start is None or start < beats[0]) and beats[0] < beats[1] < beats[2]
    await asyncio.sleep(0.05)  # a heartbeat already on its way lands
    ended = await last_beat(rid)
    await asyncio.sleep(0.3)
    assert await last_beat(rid) == ended


async def test_a_traceparent_header_makes_the_call_a_child_span(proxy: LLMProxy, store: StoreClient) -> None:
    rid, aid = await new_attempt(store)
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    await agent(proxy, rid, aid).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
    )
    [span] = await llm_spans(store, rid)
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)


# ================================================================= spans are not lost
async def test_spans_written_while_the_store_is_down_arrive_when_it_returns(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    first = await start_server(ServerConfig(port=0, db=db, grace=0.5))
    port = first.port
    async with StoreClient(f"127.0.0.1:{port}") as client:
        rid, aid = await new_attempt(client)
    await first.stop()
    recorder_client = StoreClient(f"127.0.0.1:{port}")
    recorder = SpanRecorder(recorder_client, max_backoff=0.2).start()
    span = Span(
        trace_id=os.urandom(16).hex(),
        span_id=os.urandom(8).hex(),
        name=semconv.SPAN_LLM_CALL,
        rollout_id=rid,
        attempt_id=aid,
        attributes={semconv.LLM_PROMPT_TOKEN_IDS: [1, 2, 3]},
    )
    assert await recorder.record(span, wait=0.5) is False  # the Store is down: still queued
    second = await start_server(ServerConfig(port=port, db=db, grace=0.5))
    try:
        for _ in range(100):
            if recorder.stored:
                break
            await asyncio.sleep(0.1)
        async with StoreClient(f"127.0.0.1:{port}") as client:
            [stored] = await llm_spans(client, rid)
        assert stored.attributes[semconv.LLM_PROMPT_TOKEN_IDS] == [1, 2, 3]
        await recorder.close()
        assert recorder.dropped == 0
    finally:
        await recorder_client.close()
        await second.stop()


# ================================================================= LiteLLM
async def test_litellm_reshapes_vllm_token_fields(engine: Engine) -> None:
    """Why vLLM-dialect backends bypass LiteLLM (Agent Lightning issue #262), checked on litellm==1.106.2.

    Straight from the engine the first chunk carries ``prompt_token_ids`` and ``policy_version``.
    Through LiteLLM's vLLM provider (``hosted_vllm/``) streaming drops both; its generic ``openai/``
    route keeps them but moves a whole response's ``choices[].token_ids`` elsewhere. If this test
    starts failing, LiteLLM changed and the direct path in ``lightning_grpc.proxy.upstream`` can be
    reconsidered.
    """
    from lightning_grpc.proxy.litellm_client import load_litellm

    params: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    body = {"model": engine.served_model, "stream": True, "return_token_ids": True, **params}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{engine.api_base}/chat/completions", json=body) as resp,
    ):
        raw = await resp.text()
    direct = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert "prompt_token_ids" in direct[0] and "policy_version" in direct[0]
    direct_ids = [i for c in direct for ch in c["choices"] for i in ch.get("token_ids") or ()]

    litellm = load_litellm()
    extra = {"api_base": engine.api_base, "api_key": "none", "extra_body": {"return_token_ids": True}}
    try:
        chunks: dict[str, list[dict[str, Any]]] = {}
        for provider in ("hosted_vllm", "openai"):
            stream = await litellm.acompletion(
                model=f"{provider}/{engine.served_model}", stream=True, **params, **extra
            )
            chunks[provider] = [chunk.model_dump() async for chunk in stream]
            ids = [i for c in chunks[provider] for ch in c["choices"] for i in ch.get("token_ids") or ()]
            assert ids == direct_ids  # the per-chunk ids survive on both routes
        # The trap: LiteLLM's vLLM provider loses the prompt ids (and the policy version) of a stream.
        assert not any(c.get("prompt_token_ids") for c in chunks["hosted_vllm"])
        assert not any("policy_version" in c for c in chunks["hosted_vllm"])
        assert chunks["openai"][0].get("prompt_token_ids") == direct[0]["prompt_token_ids"]
        whole = await litellm.acompletion(model=f"openai/{engine.served_model}", **params, **extra)
        choice = whole.model_dump()["choices"][0]
        assert "token_ids" not in choice and choice["provider_specific_fields"]["token_ids"]
    finally:
        await litellm.close_litellm_async_clients()


async def test_openai_dialect_backends_go_through_litellm(
    store_server: RunningServer, store: StoreClient, engine: Engine
) -> None:
    backend = engine.backend(dialect=BackendDialect.OPENAI)
    proxy = await LLMProxy(_config(store_server, [backend])).start()
    try:
        rid, aid = await new_attempt(store)
        client = agent(proxy, rid, aid)
        whole = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
        )
        text, chunks = await stream_chat(client, messages=MESSAGES, max_tokens=6, temperature=0)
        assert text == whole.choices[0].message.content and len(chunks) > 1
        spans = await llm_spans(store, rid)
        assert len(spans) == 2
        for span in spans:
            assert span.status_code == 1
            request = json.loads(span.attributes[semconv.LLM_REQUEST])
            assert "return_token_ids" not in request and "logprobs" not in request
            assert semconv.LLM_PROMPT_TOKEN_IDS not in span.attributes
        assert (
            json.loads(spans[1].attributes[semconv.LLM_RESPONSE])["choices"][0]["message"]["content"] == text
        )
    finally:
        await proxy.stop(1)


# ================================================================= ProxyService over gRPC
async def test_set_and_list_backends(
    control: ProxyClient, proxy_server: RunningProxy, engine: Engine
) -> None:
    wanted = [
        Backend("a", engine.api_base, backend_model=engine.served_model, api_key="secret", policy_version=3),
        Backend("b", "http://127.0.0.1:9", dialect=BackendDialect.OPENAI),
    ]
    got = await control.set_backends(wanted)
    assert [(b.model_name, b.api_base, b.dialect, b.policy_version) for b in got] == [
        ("a", engine.api_base, BackendDialect.VLLM, 3),
        ("b", "http://127.0.0.1:9/v1", BackendDialect.OPENAI, 0),
    ]
    listed = await control.list_backends()
    assert listed == got and all(b.api_key == "" for b in listed)  # the key never leaves the proxy
    assert proxy_server.proxy.list_backends()[0].api_key == "secret"
    for bad, field_name in (
        (Backend("", engine.api_base), "backends[0].model_name"),
        (Backend("a", "ftp://x"), "backends[0].api_base"),
    ):
        with pytest.raises(InvalidArgumentError) as refused:
            await control.set_backends([bad])
        assert refused.value.field == field_name
    with pytest.raises(InvalidArgumentError):
        await control.set_backends([wanted[0], wanted[0]])
    assert await control.list_backends() == got  # a refused update changes nothing
    assert await control.set_backends([]) == [] and await control.list_backends() == []


async def test_get_attempt_endpoint(
    control: ProxyClient, proxy_server: RunningProxy, store: StoreClient
) -> None:
    rid, aid = await new_attempt(store)
    llm = await control.attempt_endpoint(rid, aid)
    assert (
        llm.endpoint == f"{proxy_server.proxy.base_url}/rollout/{rid}/attempt/{aid}/v1" and llm.model == MODEL
    )
    client = openai_client(llm.endpoint)
    await client.chat.completions.create(model=llm.model, messages=MESSAGES, max_tokens=3)
    assert len(await llm_spans(store, rid)) == 1
    with pytest.raises(NotFoundError):
        await control.attempt_endpoint(rid, "at-missing")
    with pytest.raises(NotFoundError):
        await control.attempt_endpoint("ro-missing", aid)
    with pytest.raises(NotFoundError):
        await control.attempt_endpoint(rid, aid, "no-such-model")
    with pytest.raises(InvalidArgumentError):
        await control.attempt_endpoint("", aid)
    await store.complete_attempt(rid, aid, "succeeded")
    with pytest.raises(FailedPreconditionError):
        await control.attempt_endpoint(rid, aid)


async def test_pause_resume_drain_and_status_rpcs(
    control: ProxyClient, proxy_server: RunningProxy, store: StoreClient, engine: Engine
) -> None:
    status = await control.status()
    assert status.http_address == proxy_server.proxy.base_url
    assert not status.paused and status.in_flight == 0 and status.total_calls == 0
    assert await control.pause() == 0
    assert proxy_server.proxy.retry_after == 1.0  # the default Retry-After
    assert (await control.status()).paused
    assert await control.drain() == 0  # nothing in flight: returns at once
    await control.resume()
    rid, aid = await new_attempt(store)
    await agent(proxy_server.proxy, rid, aid).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3
    )
    status = await control.status()
    assert not status.paused and status.total_calls == 1 and status.total_errors == 0
    assert status.backends[engine.api_base].calls == 1 and status.backends[engine.api_base].in_flight == 0
    with pytest.raises(InvalidArgumentError):
        await control.pause(retry_after=-1)


async def test_proxy_grpc_server_serves_health_and_reflection(proxy_server: RunningProxy) -> None:
    async with grpc.aio.insecure_channel(proxy_server.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", PROXY_SERVICE):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        services = {s.name async for r in call for s in r.list_services_response.service}
        assert PROXY_SERVICE in services
        # The raw stub answers typed errors, as grpcurl would see them.
        stub = ppb_grpc.ProxyServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.SetBackends(ppb.SetBackendsRequest(backends=[ppb.Backend(model_name="m")]))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ================================================================= the CLI
def _read_until(
    proc: subprocess.Popen[str], pattern: str, lines: list[str], timeout: float = 60
) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    proc.kill()
    raise AssertionError(f"no {pattern!r} in:\n{''.join(lines)}")


async def test_proxy_command(store_server: RunningServer, store: StoreClient, engine: Engine) -> None:
    proc = subprocess.Popen(
        [*CLI, "proxy", "--store", f"127.0.0.1:{store_server.port}", "--backend", engine.api_base,
         "--port", "0", "--grpc-port", "0"],
        cwd=ROOT, env=QUIET_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        found = await asyncio.to_thread(_read_until, proc, r"grpc_address=(\S+) http_address=(\S+)", lines)
        grpc_address, http_address = found.group(1), found.group(2)
        async with ProxyClient(grpc_address) as control:
            [backend] = await control.list_backends()
            assert backend.model_name == engine.served_model  # asked the engine, as no name was given
            rid, aid = await new_attempt(store)
            client = openai_client(f"{http_address}/rollout/{rid}/attempt/{aid}/v1")
            await client.chat.completions.create(model=backend.model_name, messages=MESSAGES, max_tokens=3)
            assert (await control.status()).total_calls == 1
        assert len(await llm_spans(store, rid)) == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_serve_hosts_the_proxy_in_the_store_process(engine: Engine) -> None:
    proc = subprocess.Popen(
        [*CLI, "serve", "--memory", "--port", "0", "--proxy-backend", engine.api_base,
         "--proxy-model-name", MODEL, "--proxy-backend-model", engine.served_model, "--proxy-port", "0"],
        cwd=ROOT, env=QUIET_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        store_address = (
            await asyncio.to_thread(_read_until, proc, r"event=server_started address=(\S+)", lines)
        ).group(1)
        http_address = (
            await asyncio.to_thread(_read_until, proc, r"event=proxy_started http_address=(\S+)", lines)
        ).group(1)
        async with StoreClient(store_address) as store, ProxyClient(store_address) as control:
            assert (await control.status()).http_address == http_address  # ProxyService on the Store's port
            rid, aid = await new_attempt(store)
            llm = await control.attempt_endpoint(rid, aid)
            client = openai_client(llm.endpoint)
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
            assert len(await llm_spans(store, rid)) == 1
            async with grpc.aio.insecure_channel(store_address) as channel:
                resp = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=PROXY_SERVICE)
                )
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_an_unreachable_litellm_backend_is_named_by_its_model_to_the_agent(
    store_server: RunningServer, store: StoreClient
) -> None:
    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    backend = Backend(MODEL, dead, dialect=BackendDialect.OPENAI, api_key="sk-internal")
    proxy = await LLMProxy(_config(store_server, [backend], retries=0)).start()
    try:
        rid, aid = await new_attempt(store)
        with pytest.raises(openai.APIStatusError) as failed:
            await agent(proxy, rid, aid).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        told = json.dumps(failed.value.body)
        assert failed.value.status_code in (502, 504) and "the backend of model 'policy'" in told
        assert "127.0.0.1" not in told and "sk-internal" not in told
        [span] = await llm_spans(store, rid)
        assert span.attributes[semconv.LLM_BACKEND] == dead  # the Store (admins only) keeps where it was
    finally:
        await proxy.stop(1)
