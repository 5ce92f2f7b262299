"""The agents' OpenAI clients (lightning_grpc.runner.llm), against the engine in its own process."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lightning_grpc.runner.llm import close_shared_http_client, openai_client
from lightning_grpc.types import LLM
from tests.engine_fixtures import Engine


class CountingExecutor(ThreadPoolExecutor):
    """The event loop's default executor, counting what is handed to a worker thread."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted: list[str] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted.append(getattr(fn, "__qualname__", repr(fn)))
        return super().submit(fn, *args, **kwargs)


async def test_a_rollouts_new_client_answers_without_a_worker_thread(engine: Engine) -> None:
    """Rollouts each make a client for their own route: a new client's first request goes straight out,
    without the SDK's detour through a worker thread to name the platform."""
    executor = CountingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    try:
        llm = LLM(endpoint=engine.api_base, model=engine.served_model)
        clients = [openai_client(llm) for _ in range(3)]
        replies = [
            await c.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": "2 + 3?"}], max_tokens=2
            )
            for c in clients
        ]
        assert all(r.choices and r.choices[0].message.content is not None for r in replies)
        assert executor.submitted == []
    finally:
        await close_shared_http_client()
        executor.shutdown(wait=False)
