"""Training data from real LLM calls: an agent using the official ``openai`` client makes two chat calls
through the real proxy to the embedded engine (tiny local model, its own process); the trainer's
triplets and batch rows hold exactly the ids the engine tokenized and sampled."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import openai
import pytest
import pytest_asyncio

from lightning_grpc.client import StoreClient, TrainerClient
from lightning_grpc.proxy import LLMProxy, ProxyConfig
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from tests.engine_fixtures import MODEL, Engine, loopback_guard
from tests.helpers import reward_span

FIRST: Any = [{"role": "user", "content": "Enter the first digit."}]


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    yield from loopback_guard(monkeypatch)


@pytest_asyncio.fixture
async def stack(engine: Engine) -> AsyncIterator[tuple[RunningServer, LLMProxy]]:
    server = await start_server(ServerConfig(port=0, grace=1.0))
    proxy = await LLMProxy(ProxyConfig(store=f"127.0.0.1:{server.port}", backends=[engine.backend()])).start()
    try:
        yield server, proxy
    finally:
        await proxy.stop(5)
        await server.stop()


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def digit_bias(tokenizer: Any) -> dict[str, int]:
    """A logit bias that makes the model answer with a digit (a constrained agent, as a lock's keypad is)."""
    return {str(tokenizer.convert_tokens_to_ids(str(d))): 100 for d in range(10)}


async def two_turns(
    client: openai.AsyncOpenAI, bias: dict[str, int], *, stream: bool
) -> list[dict[str, Any]]:
    """The agent: enters a digit, is told "Click.", enters another. Returns what the engine answered."""
    answers = []
    messages = list(FIRST)
    for turn in range(2):
        kwargs: Any = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "logit_bias": bias,
        }
        if stream:
            chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            ids = [
                i
                for c in chunks
                if c.choices
                for i in (c.choices[0].model_extra or {}).get("token_ids") or []
            ]
        else:
            resp = await client.chat.completions.create(**kwargs)
            text, ids = resp.choices[0].message.content or "", resp.choices[0].model_extra["token_ids"]
        answers.append({"messages": list(messages), "text": text, "ids": ids})
        if turn == 0:
            messages = [
                *messages,
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Click."},
            ]
    return answers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_triplets_and_trajectory_rows_hold_the_engines_ids(
    stack: tuple[RunningServer, LLMProxy], tokenizer: Any, stream: bool
) -> None:
    server, proxy = stack
    address = f"127.0.0.1:{server.port}"
    async with StoreClient(address) as store, TrainerClient(address) as trainer:
        [group] = await trainer.submit_groups([{"task": "lock"}], 1)
        [claimed] = await store.dequeue_rollouts(1, worker_id="w", wait=5)
        attempt = claimed.latest_attempt
        assert attempt is not None and claimed.rollout_id == group.rollout_ids[0]
        endpoint = proxy.proxy_llm(MODEL).for_attempt(claimed.rollout_id, attempt.attempt_id).endpoint
        client = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
        try:
            answers = await two_turns(client, digit_bias(tokenizer), stream=stream)
        finally:
            await client.close()
        await store.add_spans(
            [reward_span(0.5)], rollout_id=claimed.rollout_id, attempt_id=attempt.attempt_id
        )
        await store.complete_attempt(claimed.rollout_id, attempt.attempt_id, "succeeded")

        report = await trainer.triplets(claimed.rollout_id)
        assert report.calls == 2 and not report.drops and report.reward == 0.5
        for triplet, answer in zip(report.triplets, answers, strict=True):
            assert triplet.prompt_ids.tolist() == chat_ids(tokenizer, answer["messages"])
            assert triplet.response_ids.tolist() == answer["ids"]
            assert triplet.streamed is stream
            assert triplet.logprobs is not None and len(triplet.logprobs) == len(answer["ids"])
        assert [t.reward for t in report.triplets] == [None, 0.5]

        # Trajectory: the second prompt extends the first prompt and response token for token.
        first, second = report.triplets
        context = first.prompt_ids.tolist() + first.response_ids.tolist()
        assert second.prompt_ids.tolist()[: len(context)] == context
        observation = second.prompt_ids.tolist()[len(context) :]
        batch = await trainer.get_batch(aggregation="trajectory", pad_token_id=0)
        assert len(batch) == 1 and batch.rollouts[0].reward == 0.5
        response_len = int(batch.arrays["response_lengths"][0])
        response = batch.arrays["responses"][0][:response_len].tolist()
        assert response == first.response_ids.tolist() + observation + second.response_ids.tolist()
        mask = batch.arrays["response_mask"][0][:response_len].tolist()
        assert mask == [1] * len(first.response_ids) + [0] * len(observation) + [1] * len(second.response_ids)
        log_probs = batch.arrays["rollout_log_probs"][0][:response_len]
        start = len(first.response_ids)
        np.testing.assert_array_equal(log_probs[start : start + len(observation)], 0.0)
        np.testing.assert_array_equal(log_probs[:start], first.logprobs)
        np.testing.assert_array_equal(log_probs[start + len(observation) :], second.logprobs)
        assert batch.arrays["prompts"][0].tolist() == first.prompt_ids.tolist()
        assert batch.arrays["token_level_scores"][0][response_len - 1] == np.float32(0.5)
