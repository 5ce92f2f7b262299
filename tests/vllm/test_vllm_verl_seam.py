"""The verl backend's rollout seam against a real vLLM: ``replica_backends`` turns vLLM replica addresses
("host:port", as verl's ``LLMServerManager.get_addresses()`` gives them) into the proxy's backends; an agent's
call through the proxy then reaches vLLM and is recorded with vLLM's own ids and the policy version given.
(verl itself is not needed: ``replica_backends`` is the seam, and it imports no verl.)"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.proxy import LLMProxy, ProxyConfig
from lightning_grpc.server.app import RunningServer
from lightning_grpc.training.engines import VllmEngine
from lightning_grpc.training.verl_backend import replica_backends

from .conftest import MODEL, SERVED
from .helpers import MESSAGES, agent, llm_spans, new_attempt, vllm_tokenize

pytestmark = pytest.mark.timeout(600)


async def test_a_vllm_replica_registered_as_verl_registers_it(
    store_server: RunningServer, store: StoreClient, vllm: VllmEngine
) -> None:
    address = urlsplit(vllm.url).netloc  # "127.0.0.1:PORT"
    version = await vllm.reported_version()
    backends = replica_backends([address], model_name=MODEL, served_model=SERVED, policy_version=version)
    proxy = await LLMProxy(ProxyConfig(store=f"127.0.0.1:{store_server.port}", backends=backends)).start()
    try:
        assert [b.api_base for b in proxy.list_backends()] == [f"{vllm.url}/v1"]
        rollout_id, attempt_id = await new_attempt(store)
        client = agent(proxy, rollout_id, attempt_id)
        try:
            answer = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=6,
                temperature=0,
            )
        finally:
            await client.close()
    finally:
        await proxy.stop(5)
    (span,) = await llm_spans(store, rollout_id)
    body = answer.model_dump()
    assert list(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) == body["choices"][0]["token_ids"]
    assert list(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == await vllm_tokenize(vllm, MESSAGES)
    assert len(span.attributes[semconv.LLM_RESPONSE_LOGPROBS]) == 6
    assert span.attributes[semconv.LLM_POLICY_VERSION] == version
    assert span.attributes[semconv.LLM_BACKEND] == f"{vllm.url}/v1"
