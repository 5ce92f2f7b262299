"""What the tests against real vLLM share: an attempt to call for, an agent's official OpenAI client on its
routed proxy URL, the recorded LLM-call spans, vLLM's own routes over its Unix socket, and the command line of
a training run of the vLLM example."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from lightning_grpc import environment, semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.proxy import LLMProxy
from lightning_grpc.training.engines import VllmEngine
from lightning_grpc.types import Span
from tests.engine_fixtures import CLI, QUIET_ENV, ROOT

from .conftest import MODEL, SERVED

#: A prompt longer than one KV block (16 tokens), so vLLM's prefix cache holds it between calls.
MESSAGES: list[dict[str, str]] = [
    {"role": "system", "content": "You open combination locks. Answer with digits only, nothing else."},
    {"role": "user", "content": "The lock has two digits. Which code do you try first? Say it."},
]


async def new_attempt(store: StoreClient, mode: str = "train") -> tuple[str, str]:
    rollout = await store.start_rollout({"task": "t"}, mode=mode)
    assert rollout.latest_attempt is not None
    return rollout.rollout_id, rollout.latest_attempt.attempt_id


def agent(proxy: LLMProxy, rollout_id: str, attempt_id: str) -> openai.AsyncOpenAI:
    """An agent's client, on the attempt's routed proxy URL (no retries: a test sees the first answer)."""
    endpoint = proxy.proxy_llm(MODEL).for_attempt(rollout_id, attempt_id).endpoint
    return openai.AsyncOpenAI(base_url=endpoint, api_key="not-needed", max_retries=0)


async def llm_spans(store: StoreClient, rollout_id: str) -> list[Span]:
    spans = [s for s in await store.query_spans(rollout_id) if s.name == semconv.SPAN_LLM_CALL]
    return sorted(spans, key=lambda s: s.start_time_unix_nano)


async def vllm_tokenize(engine: VllmEngine, messages: list[dict[str, str]]) -> list[int]:
    """vLLM's own tokenization of the chat prompt it renders for ``messages`` (``POST /tokenize``)."""
    answer = await engine.call(
        "POST", "/tokenize", {"model": SERVED, "messages": messages, "add_generation_prompt": True}
    )
    return list(answer["tokens"])


async def vllm_chat(engine: VllmEngine, body: dict[str, Any]) -> tuple[int, Any]:
    """A chat call straight to vLLM (its socket, not the proxy): (status, JSON answer)."""
    async with (
        engine._control(120) as http,
        http.post("http://vllm/v1/chat/completions", json={"model": SERVED, **body}) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


def train_command(tmp_path: Path, settings: dict[str, str]) -> list[str]:
    """``lightning-grpc train examples/combination_lock/vllm.toml`` with ``settings`` (no validation, output in
    ``tmp_path / "run"``)."""
    settings = {
        **settings,
        "experiment.output_dir": str(tmp_path / "run"),
        "model.path": str(tmp_path / "model"),
        "validation.every": "0",
        "agent.val_tasks": '""',
    }
    return [
        *CLI,
        "train",
        str(ROOT / "examples" / "combination_lock" / "vllm.toml"),
        "--no-progress",
        *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")],
    ]


def train_env(vllm_python: str) -> dict[str, str]:
    return {**QUIET_ENV, environment.VLLM_PYTHON: vllm_python}


def services_output(out: Path, lines: int = 15) -> str:
    """The last lines each of the run's services wrote to its file in ``out/logs`` (for a failure's message)."""
    folder = out / "logs"
    parts = []
    for path in sorted(folder.glob("*.log")) if folder.is_dir() else []:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(parts)
