"""The framework agents of ``examples/frameworks/`` (the OpenAI Agents SDK, LangGraph, the Anthropic SDK),
each run by the real runner against the real services: the Store, the proxy (which records every call's
token ids as a ``lightning.llm.call`` span) and the embedded engine serving the tiny model in its own
process. What is checked is what training needs: the calls' spans in the dialect the framework speaks, the
trainer's triplets, the forced tool call in each response and the lock's answer in the next prompt, and a
reward that agrees with the digits the model pressed."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient, TrainerClient
from lightning_grpc.examples import combination_lock as lock
from lightning_grpc.examples.lock_tool import PRESS_PARAMETERS, TOOL_MAX_TOKENS, Keypad, anthropic_base_url
from lightning_grpc.proxy import LLMProxy, ProxyConfig
from lightning_grpc.runner import Runner
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from lightning_grpc.types import RolloutStatus, Span
from tests.engine_fixtures import MODEL, ROOT, Engine, loopback_guard

#: framework -> (the package it needs, its agent module, the API dialect the proxy records)
FRAMEWORKS = {
    "openai-agents": ("agents", "examples.frameworks.openai_agents_lock", semconv.DIALECT_RESPONSES),
    "langgraph": ("langgraph", "examples.frameworks.langgraph_lock", semconv.DIALECT_CHAT_COMPLETIONS),
    "anthropic": ("anthropic", "examples.frameworks.anthropic_lock", semconv.DIALECT_ANTHROPIC_MESSAGES),
}
ROLLOUTS = 3
#: The demo's training locks (the "moving on" variant: two presses), as the experiment files name them.
TASKS = ROOT / "examples" / "combination_lock" / "train.jsonl"
CALL = re.compile(r'<tool_call>\n\{"name": "press", "arguments": \{"digit": (\d)\}\}\n</tool_call>')


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """No framework phones home (tracing exports, telemetry): every connection stays on this machine."""
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


def agent_of(framework: str) -> Any:
    package, module, _ = FRAMEWORKS[framework]
    pytest.importorskip(
        package, reason=f"{framework} is not installed (pip install 'lightning-grpc[frameworks]')"
    )
    return pytest.importorskip(module).agent


async def llm_calls(store: StoreClient, rollout_id: str, count: int, timeout: float = 10.0) -> list[Span]:
    """The rollout's ``lightning.llm.call`` spans in call order, once ``count`` of them are stored."""
    deadline = time.monotonic() + timeout
    while True:
        spans = await store.query_spans(rollout_id, name=semconv.SPAN_LLM_CALL)
        if len(spans) >= count or time.monotonic() > deadline:
            return sorted(spans, key=lambda s: s.start_time_unix_nano)
        await asyncio.sleep(0.1)


def decode(tokenizer: Any, ids: Any) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=False))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
async def test_a_framework_agent_trains_through_the_real_services(
    stack: tuple[RunningServer, LLMProxy], tokenizer: Any, framework: str
) -> None:
    agent = agent_of(framework)
    server, proxy = stack
    address = f"127.0.0.1:{server.port}"
    llm = proxy.proxy_llm(MODEL)
    llm.sampling_parameters = {"temperature": 1.0, "max_tokens": TOOL_MAX_TOKENS}
    runner = Runner(agent, address, concurrency=ROLLOUTS)
    tasks = lock.read_jsonl(TASKS)[:ROLLOUTS]
    try:
        outcomes = await asyncio.gather(
            *(runner.step(t, resources={"main_llm": llm}, mode="train") for t in tasks)
        )
    finally:
        await runner.close()
    assert [o.error for o in outcomes] == [None] * ROLLOUTS
    async with StoreClient(address) as store, TrainerClient(address) as trainer:
        for outcome in outcomes:
            rollout_id = outcome.rollout.rollout_id
            assert outcome.rollout.status == RolloutStatus.SUCCEEDED and outcome.result in (0.0, 0.5, 1.0)
            spans = await llm_calls(store, rollout_id, 2)
            assert [s.attributes.get(semconv.LLM_DIALECT) for s in spans] == [FRAMEWORKS[framework][2]] * 2
            report = await trainer.triplets(rollout_id)
            assert report.calls == 2 and not report.drops and report.reward == outcome.result
            first, second = report.triplets
            assert [t.response_ids.tolist() for t in report.triplets] == [
                list(s.attributes[semconv.LLM_RESPONSE_TOKEN_IDS]) for s in spans
            ]
            pressed = check_the_calls(tokenizer, decode(tokenizer, first.prompt_ids), first, second)
            assert [recorded_press(s) for s in spans] == [int(d) for d in pressed]
            right = (pressed[0] == lock.CODE[0]) + (pressed[1] == lock.CODE[1])
            assert report.reward == right / 2, (pressed, report.reward)
            for triplet, digit in zip(
                report.triplets, pressed, strict=True
            ):  # the policy chose the digit only
                [free] = sorted(
                    set(range(len(triplet.response_ids))) - set(triplet.forced_positions.tolist())
                )
                assert tokenizer.decode([int(triplet.response_ids[free])]) == digit
            chained = await trainer.triplets(rollout_id, aggregation="trajectory")
            # the framework sent the first call back as the engine wrote it: one row, the lock's answer masked
            assert chained.aggregation_fallback is None and len(chained.rows) == 1, (
                chained.aggregation_fallback
            )
            assert chained.rows[0]["trainable_tokens"] == 2  # the two digits
    shown = await asyncio.to_thread(  # the server runs on this event loop: the command must not block it
        subprocess.run,
        [sys.executable, "-m", "lightning_grpc.cli.main", "rollout", rollout_id, "--store", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert f'press({{"digit": {pressed[1]}}})' in shown.stdout and lock.ask(1) in shown.stdout, shown.stdout


def recorded_press(span: Span) -> int:
    """The digit of the one ``press`` call in the response the proxy recorded (the backend's answer)."""
    [call] = json.loads(span.attributes[semconv.LLM_RESPONSE])["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "press"
    return int(json.loads(call["function"]["arguments"])["digit"])


def check_the_calls(tokenizer: Any, prompt: str, first: Any, second: Any) -> list[str]:
    """Each response is one forced ``press`` call; the second prompt carries the first call and the lock's
    answer to it. Returns the digits pressed."""
    assert '"name": "press"' in prompt  # the tool's schema is in the prompt (the chat template's tools block)
    responses = [decode(tokenizer, t.response_ids) for t in (first, second)]
    calls = [CALL.search(text) for text in responses]
    assert all(calls), responses
    digits = [call.group(1) for call in calls if call]
    assert all(t.finish_reason == "tool_calls" for t in (first, second)), [
        t.finish_reason for t in (first, second)
    ]
    later = decode(tokenizer, second.prompt_ids)
    answer = f"{lock.CLICK if digits[0] == lock.CODE[0] else lock.WRONG} {lock.ask(1)}"
    assert later.startswith(prompt.removesuffix("<|im_start|>assistant\n")), (prompt, later)
    assert calls[0] is not None and calls[0].group(0) in later and answer in later, (later, answer)
    return digits


# ================================================================ without services


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_each_framework_offers_the_model_ten_digits(framework: str) -> None:
    """The schema each framework sends for ``press`` allows exactly the digits 0..9 (the only choice left to
    the model once the call is forced)."""
    agent_module = importlib.import_module(agent_of(framework).fn.__module__)
    if framework == "openai-agents":
        schema = agent_module.press.params_json_schema
    elif framework == "langgraph":
        from langchain_core.utils.function_calling import convert_to_openai_tool

        schema = convert_to_openai_tool(agent_module.press)["function"]["parameters"]
    else:
        schema = agent_module.PRESS_TOOL["input_schema"]
    digit = schema["properties"]["digit"]
    assert (
        digit["type"] == "integer"
        and digit["enum"] == list(range(10)) == PRESS_PARAMETERS["properties"]["digit"]["enum"]
    )
    assert schema["required"] == ["digit"]


def test_the_keypad_answers_as_the_lock() -> None:
    [task] = lock.moving_on([lock.train_tasks(half_open=False)[0]])
    keypad = Keypad.for_task(task)
    assert keypad.press(3) == "Click. Enter the second digit."
    assert (
        keypad.press(5) == "Out of presses: 1 of 2 digits unlocked." and keypad.done and keypad.reward == 0.5
    )
    assert (
        keypad.press(7) == "Out of presses: 1 of 2 digits unlocked."
    )  # pressed after the end: nothing changes
    wrong = Keypad.for_task(task)
    assert (
        wrong.press(12) == "Wrong. Enter the second digit."
        and wrong.press("7") == "Out of presses: 0 of 2 digits unlocked."
    )
    assert json.dumps(PRESS_PARAMETERS)  # JSON as it goes on the wire


def test_the_anthropic_base_url_leaves_v1_to_the_sdk() -> None:
    routed = "http://127.0.0.1:9/rollout/ro-1/attempt/at-1/v1"
    assert anthropic_base_url(routed) == "http://127.0.0.1:9/rollout/ro-1/attempt/at-1"
    assert anthropic_base_url(routed + "/") == anthropic_base_url(routed)
    assert anthropic_base_url("http://h:1") == "http://h:1"


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_each_experiment_file_names_its_agent_and_the_demos_tasks(framework: str) -> None:
    from lightning_grpc.training.experiment import load_experiment

    _, module, _ = FRAMEWORKS[framework]
    config = load_experiment(ROOT / f"{module.replace('.', '/')}.toml")
    assert config.agent.agent == f"{module}:agent"
    assert config.path(config.agent.train_tasks) == TASKS
    assert config.model.init and config.sampling.max_tokens == TOOL_MAX_TOKENS
