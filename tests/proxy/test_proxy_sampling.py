"""Each call's sampling parameters on its span, end to end: the official ``openai`` and ``anthropic`` clients
through the proxy against the embedded engine serving the tiny model, spans in a real Store, and the
TrainerService of that server cutting them into triplets and batch rows.

The span records what the engine sampled with: the request's temperature and top_p, else the engine's
defaults (1.0); top_k, max_tokens and seed when the request set them. Every dialect is recorded from the
chat request it was translated to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
import pytest_asyncio

from lightning_grpc import semconv
from lightning_grpc.batching import GroupSample
from lightning_grpc.client import StoreClient, TrainerClient
from lightning_grpc.proxy import LLMProxy, ProxyConfig
from lightning_grpc.server.app import RunningServer
from lightning_grpc.types import Span
from tests.engine_fixtures import MODEL, Engine, loopback_guard
from tests.helpers import reward_span

MESSAGES: Any = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]
SAMPLING = (
    semconv.LLM_REQUEST_TEMPERATURE,
    semconv.LLM_REQUEST_TOP_P,
    semconv.LLM_REQUEST_TOP_K,
    semconv.LLM_REQUEST_MAX_TOKENS,
    semconv.LLM_REQUEST_SEED,
)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    yield from loopback_guard(monkeypatch)


@pytest_asyncio.fixture
async def proxy(store_server: RunningServer, engine: Engine) -> AsyncIterator[LLMProxy]:
    config = ProxyConfig(store=f"127.0.0.1:{store_server.port}", backends=[engine.backend()])
    running = await LLMProxy(config).start()
    try:
        yield running
    finally:
        await running.stop(5)


@pytest_asyncio.fixture
async def trainer(store_server: RunningServer) -> AsyncIterator[TrainerClient]:
    client = TrainerClient(f"127.0.0.1:{store_server.port}")
    try:
        yield client
    finally:
        await client.close()


@pytest_asyncio.fixture
async def clients() -> AsyncIterator[list[Any]]:
    made: list[Any] = []
    yield made
    for client in made:
        await client.close()


def openai_for(made: list[Any], proxy: LLMProxy, rollout_id: str, attempt_id: str) -> openai.AsyncOpenAI:
    endpoint = proxy.proxy_llm(MODEL).for_attempt(rollout_id, attempt_id).endpoint
    client = openai.AsyncOpenAI(base_url=endpoint, api_key="not-needed", max_retries=0)
    made.append(client)
    return client


async def new_attempt(store: StoreClient) -> tuple[str, str]:
    rollout = await store.start_rollout({"task": "t"}, mode="train")
    assert rollout.latest_attempt is not None
    return rollout.rollout_id, rollout.latest_attempt.attempt_id


async def llm_spans(store: StoreClient, rollout_id: str) -> list[Span]:
    spans = [s for s in await store.query_spans(rollout_id) if s.name == semconv.SPAN_LLM_CALL]
    return sorted(spans, key=lambda s: (s.start_time_unix_nano, s.sequence_id))


def sampling_of(span: Span) -> dict[str, Any]:
    """The span's sampling attributes, by their last name part."""
    return {key.rsplit(".", 1)[1]: span.attributes[key] for key in SAMPLING if key in span.attributes}


async def test_chat_and_completions_record_the_parameters_the_engine_used(
    proxy: LLMProxy, store: StoreClient, clients: list[Any]
) -> None:
    rid, aid = await new_attempt(store)
    client = openai_for(clients, proxy, rid, aid)
    await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0.7,
        top_p=0.9,
        max_tokens=5,
        seed=3,
        extra_body={"top_k": 8},
    )
    await client.chat.completions.create(model=MODEL, messages=MESSAGES)  # the engine's defaults
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.3, max_completion_tokens=4, stream=True
    )
    async for _ in stream:
        pass
    await client.completions.create(model=MODEL, prompt="The agent", temperature=0, max_tokens=3)
    set_all, defaults, streamed, greedy = await llm_spans(store, rid)
    assert sampling_of(set_all) == {"temperature": 0.7, "top_p": 0.9, "top_k": 8, "max_tokens": 5, "seed": 3}
    assert sampling_of(defaults) == {"temperature": 1.0, "top_p": 1.0}
    assert isinstance(defaults.attributes[semconv.LLM_REQUEST_TEMPERATURE], float)
    assert sampling_of(streamed) == {"temperature": 1.3, "top_p": 1.0, "max_tokens": 4}
    assert sampling_of(greedy) == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 3}
    assert semconv.read_sampling(set_all.attributes) == (0.7, 0.9)
    assert semconv.read_sampling({}) == (None, None)


async def test_translated_dialects_record_the_chat_request_they_became(
    proxy: LLMProxy, store: StoreClient, clients: list[Any]
) -> None:
    rid, aid = await new_attempt(store)
    responses = openai_for(clients, proxy, rid, aid)
    await responses.responses.create(
        model=MODEL, input="What is 2 + 3?", temperature=0.6, top_p=0.8, max_output_tokens=6
    )
    await responses.responses.create(model=MODEL, input="What is 2 + 3?", max_output_tokens=4)
    messages = anthropic.AsyncAnthropic(
        base_url=f"{proxy.base_url}/rollout/{rid}/attempt/{aid}", api_key="not-needed", max_retries=0
    )
    clients.append(messages)
    await messages.messages.create(  # this SDK takes temperature and top_k only as extra_body
        model=MODEL,
        max_tokens=5,
        messages=[{"role": "user", "content": "2 + 3?"}],
        extra_body={"temperature": 0.5, "top_k": 4},
    )
    responses_set, responses_default, anthropic_set = await llm_spans(store, rid)
    assert responses_set.attributes[semconv.LLM_DIALECT] == semconv.DIALECT_RESPONSES
    assert sampling_of(responses_set) == {"temperature": 0.6, "top_p": 0.8, "max_tokens": 6}
    assert sampling_of(responses_default) == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4}
    assert anthropic_set.attributes[semconv.LLM_DIALECT] == semconv.DIALECT_ANTHROPIC_MESSAGES
    assert sampling_of(anthropic_set) == {"temperature": 0.5, "top_p": 1.0, "top_k": 4, "max_tokens": 5}


async def test_the_recorded_temperatures_reach_the_triplets_and_the_batch_rows(
    proxy: LLMProxy, store: StoreClient, trainer: TrainerClient, clients: list[Any]
) -> None:
    """An agent that hard-codes temperature 0.7 and one that sets none: their rows say so, per row."""
    [group] = await trainer.submit_groups([GroupSample("task", "sampling-group")], 2)
    played = []
    for rollout in await store.dequeue_rollouts(2, worker_id="w", wait=5):
        attempt = rollout.latest_attempt
        assert attempt is not None
        client = openai_for(clients, proxy, rollout.rollout_id, attempt.attempt_id)
        own = {"temperature": 0.7, "top_p": 0.95} if rollout.rollout_id == group.rollout_ids[0] else {}
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **own)
        await store.add_spans(
            [reward_span(1.0)], rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id
        )
        await store.complete_attempt(rollout.rollout_id, attempt.attempt_id, "succeeded")
        played.append(rollout.rollout_id)
    assert sorted(played) == sorted(group.rollout_ids)
    [hot] = (await trainer.triplets(group.rollout_ids[0])).triplets
    [plain] = (await trainer.triplets(group.rollout_ids[1])).triplets
    assert (hot.temperature, hot.top_p) == (0.7, 0.95)
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)
    batch = await trainer.get_batch(pad_token_id=0)
    assert list(batch.rollout_ids) == group.rollout_ids
    temperatures = batch.arrays["temperatures"]
    assert temperatures.dtype == np.float32
    np.testing.assert_array_equal(temperatures, np.array([0.7, 1.0], np.float32))
    assert batch.tensors()["temperatures"].shape == (2,)
