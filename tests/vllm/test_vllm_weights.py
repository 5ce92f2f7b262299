"""Weight sync into a real vLLM the way a training run does it (:meth:`VllmEngine.load_weights`: vLLM's
``/collective_rpc reload_weights`` from the learner's ``export_weights`` directory, its prefix cache reset,
its weight version set and read back), the policy version then recorded on every call, and the pause a
sync-mode swap wraps around it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.proxy import LLMProxy
from lightning_grpc.training.engines import VllmEngine
from lightning_grpc.training.learner import Learner
from lightning_grpc.training.ppo import token_log_probs

from .conftest import MODEL, vllm_backend
from .helpers import MESSAGES, agent, llm_spans, new_attempt

pytestmark = pytest.mark.timeout(600)

#: Longer than a KV block of vLLM's CPU build (128 tokens): the prompt stays in vLLM's prefix cache between
#: calls, and its cached keys and values, computed by the old weights, must not answer after a reload
#: (measured without the reset: another greedy answer, log-probs off by up to 4.5).
LONG_MESSAGES = [MESSAGES[0], {"role": "user", "content": MESSAGES[1]["content"] * 12}]

#: vLLM (float32, its CPU kernels) against transformers' float32 forward on the same weights: the
#: log-probs of the same tokens agree to this (measured: ~1e-5).
LOGPROB_TOLERANCE = 1e-3


async def greedy_call(proxy: LLMProxy, store: StoreClient) -> dict:
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    try:
        await client.chat.completions.create(
            model=MODEL,
            messages=LONG_MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    finally:
        await client.close()
    (span,) = await llm_spans(store, rollout_id)
    return dict(span.attributes)


def learner_log_probs(
    learner: Learner, prompt: list[int], response: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """The learner's own log-probs of ``response`` after ``prompt`` (a float32 transformers forward), and the
    greedy choice at each of those positions."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = learner.model.eval()(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = token_log_probs(logits, torch.tensor(response))
    return chosen, logits.argmax(-1).tolist()


async def test_a_reload_serves_the_learners_new_weights_and_version(
    proxy: LLMProxy, store: StoreClient, vllm: VllmEngine, wide_model: Path, tmp_path: Path
) -> None:
    before = await greedy_call(proxy, store)
    learner = Learner(model_path=wide_model)
    # the weights at the start agree with what vLLM serves
    lp, greedy = learner_log_probs(
        learner,
        list(before[semconv.LLM_PROMPT_TOKEN_IDS]),
        list(before[semconv.LLM_RESPONSE_TOKEN_IDS]),
    )
    assert greedy == list(before[semconv.LLM_RESPONSE_TOKEN_IDS])
    torch.testing.assert_close(
        lp, torch.tensor(before[semconv.LLM_RESPONSE_LOGPROBS]), atol=LOGPROB_TOLERANCE, rtol=0
    )
    # new weights: a seeded change of every parameter, as an update would make, exported by the learner
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in learner.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    exported = learner.export_weights(tmp_path / "weights")
    try:
        started = time.perf_counter()
        served = await vllm.load_weights(exported, 7)
        seconds = time.perf_counter() - started
        print(
            f"\nvLLM reload of {exported}: {seconds * 1000:.0f} ms (reload_weights + cache reset + version)"
        )
        assert served == 7 == await vllm.reported_version()
        proxy.set_backends([vllm_backend(vllm, served)])  # what TrainingRun.publish_weights does
        after = await greedy_call(proxy, store)
        prompt = list(after[semconv.LLM_PROMPT_TOKEN_IDS])
        response = list(after[semconv.LLM_RESPONSE_TOKEN_IDS])
        assert prompt == list(before[semconv.LLM_PROMPT_TOKEN_IDS])
        # vLLM now samples from the new weights: the same prompt (its KV blocks were cached under the old
        # weights) gets the new weights' greedy tokens and log-probs
        assert len(prompt) > 256
        lp, greedy = learner_log_probs(learner, prompt, response)
        assert greedy == response
        logprobs = torch.tensor(after[semconv.LLM_RESPONSE_LOGPROBS])
        torch.testing.assert_close(lp, logprobs, atol=LOGPROB_TOLERANCE, rtol=0)
        old = torch.tensor(before[semconv.LLM_RESPONSE_LOGPROBS])
        assert response != list(before[semconv.LLM_RESPONSE_TOKEN_IDS]) or (logprobs - old).abs().max() > 0.05
        # every later call records the version vLLM reports
        assert after[semconv.LLM_POLICY_VERSION] == 7
    finally:
        assert await vllm.load_weights(wide_model, 0) == 0
        proxy.set_backends([vllm_backend(vllm, 0)])
    restored = await greedy_call(proxy, store)
    assert list(restored[semconv.LLM_RESPONSE_TOKEN_IDS]) == list(before[semconv.LLM_RESPONSE_TOKEN_IDS])
    assert restored[semconv.LLM_POLICY_VERSION] == 0


async def test_a_paused_vllm_holds_calls_until_resumed(
    proxy: LLMProxy, store: StoreClient, vllm: VllmEngine
) -> None:
    """Sync mode's swap: vLLM paused (``mode=keep``) holds a call without failing it; resumed, it answers."""
    await vllm.pause()
    try:
        assert await vllm.call("GET", "/is_paused") == {"is_paused": True}
        call = asyncio.create_task(greedy_call(proxy, store))
        await asyncio.sleep(2.0)
        assert not call.done()
    finally:
        await vllm.resume()
    attributes = await asyncio.wait_for(call, 60)
    assert len(attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) == 8
    assert await vllm.call("GET", "/is_paused") == {"is_paused": False}
