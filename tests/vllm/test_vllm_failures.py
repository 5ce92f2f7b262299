"""vLLM failing under the proxy: killed in the middle of a stream (an error span, the agent told), then
started again (calls recover once the proxy has the new address)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import openai
import psutil
import pytest

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.proxy import LLMProxy
from lightning_grpc.training.engines import VllmEngine

from .conftest import MODEL, vllm_backend
from .helpers import MESSAGES, agent, llm_spans, new_attempt

pytestmark = pytest.mark.timeout(900)


async def test_vllm_killed_mid_stream_then_restarted(
    proxy: LLMProxy, store: StoreClient, vllm: VllmEngine, wide_model: Path
) -> None:
    server = vllm.processes[0]
    family = [server.proc.pid, *(c.pid for c in psutil.Process(server.proc.pid).children(recursive=True))]
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    received: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content is not None:
                    received.append(chunk.choices[0].delta.content)
                if len(received) == 2:
                    # freeze generation where it is, then kill the server: the stream is cut mid-answer
                    await vllm.pause()
                    os.kill(server.proc.pid, signal.SIGKILL)
    finally:
        await client.close()
    assert "broke off" in str(caught.value.message)
    (span,) = await llm_spans(store, rollout_id)
    assert span.status_code == 2
    assert "stream" in span.attributes[semconv.LLM_ERROR]
    assert len(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) > 0  # what came before the cut is kept

    # while it is down the agent gets a clear error, recorded
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    try:
        with pytest.raises(openai.APIStatusError) as down:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    finally:
        await client.close()
    assert down.value.status_code == 502
    (span,) = await llm_spans(store, rollout_id)
    assert span.status_code == 2

    # stopped, nothing of vLLM is left (its engine process outlives a killed server: the group goes)
    vllm.stop()
    await asyncio.to_thread(
        psutil.wait_procs, [psutil.Process(p) for p in family if psutil.pid_exists(p)], 10
    )
    assert not [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

    # started again (as a run restarts its engine), the proxy pointed at it: calls recover
    vllm.url = ""
    vllm.start(wide_model, 0)
    proxy.set_backends([vllm_backend(vllm, await vllm.reported_version())])
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    try:
        answer = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0
        )  # type: ignore[arg-type]
    finally:
        await client.close()
    (span,) = await llm_spans(store, rollout_id)
    assert span.status_code != 2
    assert (
        list(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS])
        == answer.model_dump()["choices"][0]["token_ids"]
    )
