"""The combination lock played by an OpenAI Agents SDK agent: an ``Agent`` with a ``press`` function tool,
run by ``Runner.run`` over the OpenAI Responses API (the SDK's default), trained unchanged.

    lightning-grpc train examples/frameworks/openai_agents_lock.toml      # from the repository root
    lightning-grpc runner examples.frameworks.openai_agents_lock:agent --store 127.0.0.1:4747

The agent is what the SDK's documentation writes: a module-level ``Agent`` whose tool reads the run's
context (here the episode's :class:`~lightning_grpc.examples.lock_tool.Keypad`). Only the model is per
rollout: the LLM resource's base URL (the proxy's route for this attempt, which records the token ids),
API key and model name. Two settings fit the task to a random tiny model: ``tool_choice="press"`` (it
never writes a tool call unforced; the engine writes the forced one by constrained decoding, so the digit
is the only choice it makes) with ``reset_tool_choice=False``, and a ``tool_use_behavior`` that ends the
run when the lock's episode is over (the second press) instead of asking the model for a final answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agents import (
    Agent,
    FunctionToolResult,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.agent import ToolsToFinalOutputResult
from openai import AsyncOpenAI

from lightning_grpc.examples.lock_tool import PRESS, PRESS_DESCRIPTION, Digit, Keypad, tool_sampling
from lightning_grpc.runner import rollout
from lightning_grpc.types import LLM

# The SDK exports traces to OpenAI by default; the proxy already records every call (and this machine
# may have no internet).
set_tracing_disabled(True)


@function_tool(name_override=PRESS, description_override=PRESS_DESCRIPTION)
def press(ctx: RunContextWrapper[Keypad], digit: Digit) -> str:
    return ctx.context.press(digit)


def stop_when_done(
    ctx: RunContextWrapper[Keypad], results: list[FunctionToolResult]
) -> ToolsToFinalOutputResult:
    """The run ends with the episode (after the second press), its reward as the final output."""
    keypad = ctx.context
    return ToolsToFinalOutputResult(
        is_final_output=keypad.done, final_output=keypad.reward if keypad.done else None
    )


locksmith = Agent[Keypad](
    name="locksmith",
    instructions="Open the combination lock by pressing its digits with the press tool.",
    tools=[press],
    model_settings=ModelSettings(tool_choice=PRESS),
    reset_tool_choice=False,
    tool_use_behavior=stop_when_done,
)


@rollout
async def agent(task: Mapping[str, Any], llm: LLM) -> float:
    """Play one lock; returns the reward (right digits / 2)."""
    keypad = Keypad.for_task(task)
    sampling = tool_sampling(task, llm.sampling_parameters)
    # max_retries: the proxy answers 429 (with Retry-After) while the engine loads new weights.
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=6)
    config = RunConfig(
        model=OpenAIResponsesModel(model=llm.model, openai_client=client),
        model_settings=ModelSettings(
            temperature=sampling["temperature"], top_p=sampling["top_p"], max_tokens=sampling["max_tokens"]
        ),
    )
    async with client:
        await Runner.run(locksmith, str(task["prompt"]), context=keypad, run_config=config, max_turns=4)
    return keypad.reward
