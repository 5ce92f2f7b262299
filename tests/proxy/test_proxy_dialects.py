"""The proxy's Responses and Messages dialects, end to end: the official ``openai`` and ``anthropic`` clients
through the proxy against the embedded engine with the tiny model, every call recorded in a real Store.

Each call must be one ``lightning.llm.call`` span holding the exact ids the engine used and sampled (the
same ids the engine gives the equivalent chat request), whatever the dialect; errors keep the dialect's
shape and status.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio

from lightning_grpc import semconv
from lightning_grpc.access import Credentials
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.proxy import Backend, LLMProxy, ProxyConfig
from lightning_grpc.server.app import RunningServer, ServerConfig
from lightning_grpc.types import Span
from tests.engine_fixtures import MODEL, Engine, loopback_guard
from tests.helpers import serving

QUESTION = "What is 2 + 3? Answer with one number."
SYSTEM = "You are terse."
SEED = 1234
#: A closed set of cities: a forced call of the random tiny model fits in a few dozen tokens.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
}
TOKEN = "admin-s3cret"


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    yield from loopback_guard(monkeypatch)


@pytest_asyncio.fixture
async def proxy(store_server: RunningServer, engine: Engine) -> AsyncIterator[LLMProxy]:
    backend: Backend = engine.backend()
    config = ProxyConfig(store=f"127.0.0.1:{store_server.port}", backends=[backend])
    running = await LLMProxy(config).start()
    try:
        yield running
    finally:
        await running.stop(5)


async def new_attempt(store: StoreClient) -> tuple[str, str]:
    rollout = await store.start_rollout({"task": "t"}, mode="train")
    assert rollout.latest_attempt is not None
    return rollout.rollout_id, rollout.latest_attempt.attempt_id


def base_url(proxy: LLMProxy, rollout_id: str, attempt_id: str) -> str:
    """The attempt's routed URL without ``/v1`` (what Anthropic's client takes)."""
    return f"{proxy.base_url}/rollout/{rollout_id}/attempt/{attempt_id}"


@pytest_asyncio.fixture
async def clients() -> AsyncIterator[list[Any]]:
    made: list[Any] = []
    yield made
    for client in made:
        await client.close()


def openai_for(made: list[Any], url: str, key: str = "not-needed") -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    made.append(client)
    return client


def anthropic_for(made: list[Any], url: str, key: str = "not-needed") -> anthropic.AsyncAnthropic:
    client = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)
    made.append(client)
    return client


async def one_span(store: StoreClient, rollout_id: str, count: int = 1) -> list[Span]:
    spans = [s for s in await store.query_spans(rollout_id) if s.name == semconv.SPAN_LLM_CALL]
    assert len(spans) == count, spans
    return sorted(spans, key=lambda s: s.start_time_unix_nano)


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


async def engine_chat(engine: Engine, **body: Any) -> dict[str, Any]:
    """The engine's own answer to a chat request (with its token ids), asked directly."""
    body = {"model": engine.served_model, "return_token_ids": True, **body}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{engine.api_base}/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


def check_span(span: Span, dialect: str, own: dict[str, Any]) -> dict[str, Any]:
    """The span holds the engine's ids, the version and the dialect; returns the chat request it recorded."""
    attrs = span.attributes
    prompt, response = own["prompt_token_ids"], own["choices"][0]["token_ids"]
    assert attrs[semconv.LLM_DIALECT] == dialect
    assert list(attrs[semconv.LLM_PROMPT_TOKEN_IDS]) == prompt
    assert list(attrs[semconv.LLM_RESPONSE_TOKEN_IDS]) == response
    assert len(attrs[semconv.LLM_RESPONSE_LOGPROBS]) == len(response)
    assert isinstance(own["policy_version"], int)
    assert attrs[semconv.LLM_POLICY_VERSION] == own["policy_version"]
    assert semconv.LLM_ERROR not in attrs
    json.loads(attrs[semconv.LLM_DIALECT_REQUEST])
    request: dict[str, Any] = json.loads(attrs[semconv.LLM_REQUEST])
    assert "messages" in request and request["return_token_ids"] is True
    return request


CHAT_MESSAGES: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


# ================================================================= text, both dialects, streamed and not
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_responses_records_the_ids_the_engine_uses(
    proxy: LLMProxy, store: StoreClient, engine: Engine, tokenizer: Any, clients: list[Any], streamed: bool
) -> None:
    rid, aid = await new_attempt(store)
    client = openai_for(clients, base_url(proxy, rid, aid))
    kw: Any = dict(
        model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=8, temperature=1.0,
        extra_body={"seed": SEED},
    )  # fmt: skip
    if streamed:
        types, text, final = [], "", None
        async for ev in await client.responses.create(stream=True, **kw):
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert types[:2] == ["response.created", "response.in_progress"]
        assert "response.output_item.added" in types and types[-1] in (
            "response.completed",
            "response.incomplete",
        )
        assert final is not None and final.output_text == text
    else:
        final = await client.responses.create(**kw)
        text = final.output_text
    own = await engine_chat(engine, messages=CHAT_MESSAGES, max_tokens=8, temperature=1.0, seed=SEED)
    assert text == own["choices"][0]["message"]["content"]
    [span] = await one_span(store, rid)
    sent = check_span(span, semconv.DIALECT_RESPONSES, own)
    assert sent["messages"] == CHAT_MESSAGES and sent["max_tokens"] == 8 and sent["seed"] == SEED
    assert own["prompt_token_ids"] == prompt_ids(tokenizer, CHAT_MESSAGES)
    assert final.usage is not None and final.usage.output_tokens == len(own["choices"][0]["token_ids"])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_anthropic_messages_record_the_ids_the_engine_uses(
    proxy: LLMProxy, store: StoreClient, engine: Engine, tokenizer: Any, clients: list[Any], streamed: bool
) -> None:
    rid, aid = await new_attempt(store)
    client = anthropic_for(clients, base_url(proxy, rid, aid))
    kw: Any = dict(
        model=MODEL, system=SYSTEM, max_tokens=8, extra_body={"seed": SEED, "temperature": 1.0},
        messages=[{"role": "user", "content": QUESTION}], metadata={"user_id": "u1"},
    )  # fmt: skip
    if streamed:
        async with client.messages.stream(**kw) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            message = await stream.get_final_message()
        assert message.content and message.content[0].type == "text" and message.content[0].text == text
    else:
        message = await client.messages.create(**kw)
        text = "".join(block.text for block in message.content if block.type == "text")
    own = await engine_chat(engine, messages=CHAT_MESSAGES, max_tokens=8, temperature=1.0, seed=SEED)
    assert text == own["choices"][0]["message"]["content"]
    assert message.stop_reason == (
        "max_tokens" if own["choices"][0]["finish_reason"] == "length" else "end_turn"
    )
    assert message.usage.input_tokens == len(own["prompt_token_ids"])
    assert message.usage.output_tokens == len(own["choices"][0]["token_ids"])
    [span] = await one_span(store, rid)
    sent = check_span(span, semconv.DIALECT_ANTHROPIC_MESSAGES, own)
    assert sent["messages"] == CHAT_MESSAGES and "user" not in sent and "metadata" not in sent


async def test_chat_calls_are_marked_with_their_dialect(
    proxy: LLMProxy, store: StoreClient, clients: list[Any]
) -> None:
    rid, aid = await new_attempt(store)
    client = openai_for(clients, base_url(proxy, rid, aid))
    await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=2)
    await client.completions.create(model=MODEL, prompt="2 + 3 =", max_tokens=2)
    spans = await one_span(store, rid, 2)
    assert [s.attributes[semconv.LLM_DIALECT] for s in spans] == [
        semconv.DIALECT_CHAT_COMPLETIONS,
        semconv.DIALECT_COMPLETIONS,
    ]
    assert all(semconv.LLM_DIALECT_REQUEST not in s.attributes for s in spans)


# ================================================================= tools
RESPONSES_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": WEATHER_SCHEMA,
}
ANTHROPIC_TOOL: Any = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_responses_forced_tool_call_round_trip(
    proxy: LLMProxy, store: StoreClient, engine: Engine, tokenizer: Any, clients: list[Any], streamed: bool
) -> None:
    rid, aid = await new_attempt(store)
    client = openai_for(clients, base_url(proxy, rid, aid))
    kw: Any = dict(
        model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], max_output_tokens=48, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    if streamed:
        final = None
        async for ev in await client.responses.create(stream=True, **kw):
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert final is not None
    else:
        final = await client.responses.create(**kw)
    calls = [item for item in final.output if item.type == "function_call"]
    [first] = await one_span(store, rid)
    sent = json.loads(first.attributes[semconv.LLM_REQUEST])
    assert sent["tools"] == [CHAT_TOOL]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    user = [{"role": "user", "content": QUESTION}]
    assert list(first.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == prompt_ids(tokenizer, user, [CHAT_TOOL])
    own = await engine_chat(
        engine,
        messages=user,
        tools=[CHAT_TOOL],
        tool_choice=sent["tool_choice"],
        max_tokens=48,
        temperature=0,
    )
    check_span(first, semconv.DIALECT_RESPONSES, own)  # the ids the engine itself answers with
    [call] = calls
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    # the second call carries the call and its result: the prompt holds the result
    second: Any = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    await client.responses.create(model=MODEL, input=second, tools=[RESPONSES_TOOL], max_output_tokens=4)
    spans = await one_span(store, rid, 2)
    chat: Any = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": call.call_id},
    ]  # fmt: skip
    assert json.loads(spans[1].attributes[semconv.LLM_REQUEST])["messages"] == chat
    assert list(spans[1].attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == prompt_ids(tokenizer, chat, [CHAT_TOOL])
    assert "sunny, 21 C" in tokenizer.decode(spans[1].attributes[semconv.LLM_PROMPT_TOKEN_IDS])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_anthropic_forced_tool_use_round_trip(
    proxy: LLMProxy, store: StoreClient, engine: Engine, tokenizer: Any, clients: list[Any], streamed: bool
) -> None:
    rid, aid = await new_attempt(store)
    client = anthropic_for(clients, base_url(proxy, rid, aid))
    user = {"role": "user", "content": QUESTION}
    kw: Any = dict(
        model=MODEL, max_tokens=48, extra_body={"temperature": 0}, messages=[user], tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    if streamed:
        async with client.messages.stream(**kw) as stream:
            message = await stream.get_final_message()
    else:
        message = await client.messages.create(**kw)
    [first] = await one_span(store, rid)
    sent = json.loads(first.attributes[semconv.LLM_REQUEST])
    assert sent["tools"] == [CHAT_TOOL]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert list(first.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == prompt_ids(tokenizer, [user], [CHAT_TOOL])
    own = await engine_chat(
        engine,
        messages=[user],
        tools=[CHAT_TOOL],
        tool_choice=sent["tool_choice"],
        max_tokens=48,
        temperature=0,
    )
    check_span(first, semconv.DIALECT_ANTHROPIC_MESSAGES, own)  # the ids the engine itself answers with
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and message.stop_reason == "tool_use"
    history: Any = [
        user,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}],
        },
    ]
    await client.messages.create(model=MODEL, max_tokens=4, messages=history, tools=[ANTHROPIC_TOOL])
    spans = await one_span(store, rid, 2)
    messages = json.loads(spans[1].attributes[semconv.LLM_REQUEST])["messages"]
    assert messages[-1] == {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert list(spans[1].attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == prompt_ids(
        tokenizer, messages, [CHAT_TOOL]
    )
    assert "sunny, 21 C" in tokenizer.decode(spans[1].attributes[semconv.LLM_PROMPT_TOKEN_IDS])


async def test_tool_history_reaches_the_engine_as_chat_tool_messages(
    proxy: LLMProxy, store: StoreClient, tokenizer: Any, clients: list[Any]
) -> None:
    """A tool round trip's second call, whatever the engine samples: the result is in the prompt ids."""
    rid, aid = await new_attempt(store)
    url = base_url(proxy, rid, aid)
    args = '{"city": "Paris"}'
    await openai_for(clients, url).responses.create(
        model=MODEL, tools=[RESPONSES_TOOL], max_output_tokens=2, tool_choice="auto",
        input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
    )  # fmt: skip
    await anthropic_for(clients, url).messages.create(
        model=MODEL, max_tokens=2, tools=[ANTHROPIC_TOOL], tool_choice={"type": "auto"},
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"}]},
        ],
    )  # fmt: skip
    spans = await one_span(store, rid, 2)
    for span in spans:
        sent = json.loads(span.attributes[semconv.LLM_REQUEST])
        assert sent["tool_choice"] == "auto"
        assert sent["messages"][-1] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}
        [call] = sent["messages"][1]["tool_calls"]
        assert call["id"] == "call_1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        ids = list(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
        assert ids == prompt_ids(tokenizer, sent["messages"], [CHAT_TOOL])
        assert "sunny, 21 C" in tokenizer.decode(ids)


# ================================================================= errors in the dialect's shape
async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers or {}) as resp:
        return resp.status, await resp.json()


def anthropic_error(payload: Any, kind: str) -> str:
    assert payload["type"] == "error" and payload["error"]["type"] == kind, payload
    return str(payload["error"]["message"])


def openai_error(payload: Any, kind: str, param: str | None = None) -> str:
    assert payload["error"]["type"] == kind and payload["error"]["param"] == param, payload
    return str(payload["error"]["message"])


async def test_malformed_requests_get_400_in_the_dialects_shape(proxy: LLMProxy, store: StoreClient) -> None:
    rid, aid = await new_attempt(store)
    url = base_url(proxy, rid, aid) + "/v1"
    user = [{"role": "user", "content": "hi"}]
    responses = {
        "model": {"input": "hi"},
        "input": {"model": MODEL},
        "previous_response_id": {"model": MODEL, "input": "hi", "previous_response_id": "resp_1"},
        "background": {"model": MODEL, "input": "hi", "background": True},
        "input[0].content[0]": {
            "model": MODEL,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        },
        "tools[0]": {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]},
    }
    for param, body in responses.items():
        status, payload = await post(f"{url}/responses", body)
        assert status == 400 and param in openai_error(payload, "invalid_request_error", param), (
            param,
            payload,
        )
    messages = {
        "model": {"max_tokens": 4, "messages": user},
        "max_tokens": {"model": MODEL, "messages": user},
        "messages": {"model": MODEL, "max_tokens": 4},
        "messages[0].content[0]": {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        "tools[0]": {"model": MODEL, "max_tokens": 4, "messages": user, "tools": [{"type": "bash_20250124"}]},
    }
    for field, body in messages.items():
        status, payload = await post(f"{url}/messages", body)
        assert status == 400 and field in anthropic_error(payload, "invalid_request_error"), (field, payload)
    status, payload = await post(f"{url}/messages", {"model": "nope", "max_tokens": 4, "messages": user})
    assert status == 404 and "nope" in anthropic_error(payload, "not_found_error")
    status, payload = await post(f"{url}/responses", {"model": "nope", "input": "hi"})
    assert status == 404 and payload["error"]["code"] == "model_not_found"
    assert await one_span(store, rid, 0) == []


async def test_sdks_raise_their_own_errors(proxy: LLMProxy, store: StoreClient, clients: list[Any]) -> None:
    rid, aid = await new_attempt(store)
    url = base_url(proxy, rid, aid)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await anthropic_for(clients, url).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]
        )  # fmt: skip
    body: Any = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        await openai_for(clients, url).responses.create(
            model=MODEL, input="hi", previous_response_id="resp_1"
        )
    assert bad.value.param == "previous_response_id"


async def test_paused_and_unknown_attempts_answer_in_the_dialects_shape(
    proxy: LLMProxy, store: StoreClient
) -> None:
    rid, aid = await new_attempt(store)
    url = base_url(proxy, rid, aid) + "/v1"
    msg = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    resp = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    proxy.pause("weights", retry_after=2)
    status, payload = await post(f"{url}/messages", msg)
    assert status == 429 and "paused" in anthropic_error(payload, "rate_limit_error")
    status, payload = await post(f"{url}/responses", resp)
    assert status == 429 and payload["error"]["code"] == "proxy_paused"
    proxy.resume()
    gone = base_url(proxy, rid, "no-such-attempt") + "/v1"
    status, payload = await post(f"{gone}/messages", msg)
    assert status == 404 and anthropic_error(payload, "not_found_error")
    status, payload = await post(f"{gone}/responses", resp)
    assert status == 404 and payload["error"]["type"] == "invalid_request_error"


# ================================================================= credentials: Anthropic's x-api-key
@pytest_asyncio.fixture
async def token_store() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=1.0, token=TOKEN)) as running:
        yield running


async def test_anthropic_key_is_taken_from_x_api_key(
    token_store: RunningServer, engine: Engine, clients: list[Any]
) -> None:
    admin = StoreClient(ClientConfig(target=token_store.address, token=TOKEN))
    config = ProxyConfig(
        store=ClientConfig(target=token_store.address, token=TOKEN), backends=[engine.backend()]
    )
    running = await LLMProxy(config).start()
    try:
        rid, aid = await new_attempt(admin)
        url = base_url(running, rid, aid)
        body: Any = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        status, payload = await post(f"{url}/v1/messages", body, {"x-api-key": "sk-wrong"})
        assert status == 401 and anthropic_error(payload, "authentication_error")
        status, payload = await post(
            f"{url}/v1/responses", {"model": MODEL, "input": "hi"}, {"x-api-key": "bad"}
        )
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"
        credential = Credentials(TOKEN).attempt(rid, aid)
        with pytest.raises(anthropic.AuthenticationError):
            await anthropic_for(clients, url, "sk-wrong").messages.create(**body)
        message = await anthropic_for(clients, url, credential).messages.create(**body)
        assert message.type == "message"
        other = base_url(running, rid, "another-attempt")
        with pytest.raises(anthropic.PermissionDeniedError):
            await anthropic_for(clients, other, credential).messages.create(**body)
        spans = [s for s in await admin.query_spans(rid) if s.name == semconv.SPAN_LLM_CALL]
        assert (
            len(spans) == 1 and spans[0].attributes[semconv.LLM_DIALECT] == semconv.DIALECT_ANTHROPIC_MESSAGES
        )
    finally:
        await running.stop(5)
        await admin.close()
