"""One tiny model and one engine per test module of the embedded engine (in this process, on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from lightning_grpc.engine import EngineServer, build_tiny_model, start_engine

#: The name the engine serves the model as.
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", seed=7)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[EngineServer]:
    server = await start_engine(model_dir, served_model_name=MODEL, max_batch_size=64)
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client(engine: EngineServer) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0, timeout=60)
    try:
        yield c
    finally:
        await c.close()
