"""The training run's before/after transcript: what the agent said, or the tools it called."""

from __future__ import annotations

import json
from typing import Any

from lightning_grpc import semconv
from lightning_grpc.training.loop import transcript_of
from lightning_grpc.types import Span
from tests.helpers import llm_call


def call(last_message: dict[str, Any], answer: dict[str, Any], start_ns: int) -> Span:
    span = llm_call([1], [2], start_ns=start_ns)
    span.attributes[semconv.LLM_REQUEST] = json.dumps({"messages": [last_message]})
    span.attributes[semconv.LLM_RESPONSE] = json.dumps({"choices": [{"message": answer}]})
    return span


def test_a_tool_call_turn_shows_the_call_and_the_tool_result_shows_as_the_next_prompt() -> None:
    press = {"id": "c1", "type": "function", "function": {"name": "press", "arguments": '{"digit": 3}'}}
    spans = [
        call(
            {"role": "tool", "content": "Click. Enter the second digit."},
            {"content": "ok", "tool_calls": []},
            2,
        ),
        call(
            {"role": "user", "content": "Enter the first digit."}, {"content": None, "tool_calls": [press]}, 1
        ),
    ]
    assert transcript_of(spans, 0.5).splitlines() == [
        "  user: Enter the first digit.",
        '  assistant: press({"digit": 3})',
        "  tool: Click. Enter the second digit.",
        "  assistant: 'ok'",
        "  reward: 0.5",
    ]
