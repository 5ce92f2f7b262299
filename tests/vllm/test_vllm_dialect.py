"""The proxy's vLLM dialect against a real vLLM server: the ids and log-probs it records are vLLM's own.

An agent (the official OpenAI client) calls through the proxy on its attempt's route; the proxy relays to
vLLM (through the run's gate, as in training) and records each call in a real Store.
"""

from __future__ import annotations

import itertools
import math

import openai
import pytest

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.proxy import LLMProxy
from lightning_grpc.training.engines import VllmEngine

from .conftest import MAX_MODEL_LEN, MODEL
from .helpers import MESSAGES, agent, llm_spans, new_attempt, vllm_chat, vllm_tokenize

pytestmark = pytest.mark.timeout(600)


async def test_streamed_and_whole_calls_record_vllms_own_ids(
    proxy: LLMProxy, store: StoreClient, vllm: VllmEngine
) -> None:
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    try:
        whole = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        streamed_text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    finally:
        await client.close()
    first, second = await llm_spans(store, rollout_id)
    assert (first.attributes[semconv.LLM_STREAMED], second.attributes[semconv.LLM_STREAMED]) == (False, True)
    answer = whole.model_dump()
    ids = list(first.attributes[semconv.LLM_RESPONSE_TOKEN_IDS])
    # what the agent was given is what vLLM sampled, recorded as is
    assert ids == answer["choices"][0]["token_ids"] and len(ids) == 12
    assert list(first.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == answer["prompt_token_ids"]
    # greedy: the stream's ids (concatenated from its chunks) equal the whole answer's, and so do the texts
    assert list(second.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) == ids
    assert streamed_text == whole.choices[0].message.content
    # the prompt ids are vLLM's tokenization of the prompt it renders, never ours
    tokenized = await vllm_tokenize(vllm, MESSAGES)
    assert list(first.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == tokenized
    assert list(second.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == tokenized
    # log-probs for a train rollout (asked for by the proxy), one per sampled token, as vLLM sent them
    for span in (first, second):
        logprobs = list(span.attributes[semconv.LLM_RESPONSE_LOGPROBS])
        assert len(logprobs) == len(ids) and all(math.isfinite(x) and x <= 0 for x in logprobs)
    sent = [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
    assert list(first.attributes[semconv.LLM_RESPONSE_LOGPROBS]) == pytest.approx(sent, abs=0)
    assert list(second.attributes[semconv.LLM_RESPONSE_LOGPROBS]) == pytest.approx(sent, abs=1e-5)
    # the policy version vLLM reports, recorded on every call
    reported = await vllm.reported_version()
    assert first.attributes[semconv.LLM_POLICY_VERSION] == second.attributes[semconv.LLM_POLICY_VERSION]
    assert first.attributes[semconv.LLM_POLICY_VERSION] == reported


async def test_multi_turn_prompts_are_vllms_rendering_of_the_whole_conversation(
    proxy: LLMProxy, store: StoreClient, vllm: VllmEngine
) -> None:
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    messages = list(MESSAGES)
    try:
        for turn in range(3):
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                temperature=1.0,
                seed=turn,
                stream=turn == 1,
            )
            if turn == 1:
                text = "".join([c.choices[0].delta.content or "" async for c in reply if c.choices])  # type: ignore[union-attr]
            else:
                text = reply.choices[0].message.content or ""  # type: ignore[union-attr]
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Wrong."}]
    finally:
        await client.close()
    spans = await llm_spans(store, rollout_id)
    assert len(spans) == 3
    for turn, span in enumerate(spans):
        conversation = messages[: len(MESSAGES) + 2 * turn]
        assert list(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == await vllm_tokenize(vllm, conversation)
        assert len(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) == len(
            span.attributes[semconv.LLM_RESPONSE_LOGPROBS]
        )
    # each turn's prompt holds the previous one whole
    for before, after in itertools.pairwise(spans):
        earlier = list(before.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
        assert list(after.attributes[semconv.LLM_PROMPT_TOKEN_IDS])[: len(earlier)] == earlier


async def test_vllms_refusal_reaches_the_agent_and_is_recorded(
    proxy: LLMProxy, store: StoreClient, vllm: VllmEngine
) -> None:
    """A prompt over ``--max-model-len``: vLLM's 400 and its own message reach the agent; an error span."""
    long = [{"role": "user", "content": " ".join(["seven"] * (2 * MAX_MODEL_LEN))}]
    status, direct = await vllm_chat(vllm, {"messages": long, "max_tokens": 4})
    assert status == 400
    message = direct["error"]["message"]
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=MODEL, messages=long, max_tokens=4)  # type: ignore[arg-type]
    finally:
        await client.close()
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["message"] == message
    assert str(MAX_MODEL_LEN) in message
    (span,) = await llm_spans(store, rollout_id)
    assert span.status_code == 2  # error
    assert span.attributes[semconv.LLM_ERROR] == f"HTTP 400: {message}"
    assert semconv.LLM_RESPONSE_TOKEN_IDS not in span.attributes


#: The paths the gate passes on (every other answers 404 there).
OPEN_ON_THE_GATE = ("/health", "/v1/models", "/metrics")


async def test_the_gate_serves_inference_only(vllm: VllmEngine) -> None:
    """The loopback port passes on /v1, /health and /metrics; vLLM's control routes are reachable only over
    its socket, in a directory only this user may enter."""
    import aiohttp

    assert vllm.socket_dir is not None and (vllm.socket_dir.stat().st_mode & 0o777) == 0o700
    # the sockets between vLLM's own processes are there too (removed with the directory), not in /tmp
    own = [p.name for p in vllm.socket_dir.iterdir() if p.is_socket() and p.name != "vllm.sock"]
    assert own, sorted(p.name for p in vllm.socket_dir.iterdir())
    async with aiohttp.ClientSession() as http:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/collective_rpc"),
            ("POST", "/pause"),
            ("POST", "/update_weight_version"),
            ("GET", "/weight_info"),
            ("POST", "/v1/load_lora_adapter"),
        ]:
            async with http.request(method, f"{vllm.url}{path}", json={}) as resp:
                assert resp.status == (200 if path in OPEN_ON_THE_GATE else 404), path
                if path == "/metrics":  # vLLM's own figures, under the names the embedded engine uses too
                    assert "vllm:num_requests_running" in await resp.text()
    assert (await vllm.call("GET", "/is_paused")) == {"is_paused": False}
