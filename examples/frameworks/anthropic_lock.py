"""The combination lock played with the Anthropic SDK: ``AsyncAnthropic().messages.create`` with a
``press`` tool, in the manual tool-use loop of the SDK's documentation (the Anthropic Messages API),
trained unchanged.

    lightning-grpc train examples/frameworks/anthropic_lock.toml          # from the repository root
    lightning-grpc runner examples.frameworks.anthropic_lock:agent --store 127.0.0.1:4747

The client takes the LLM resource's base URL (the proxy's route for this attempt, which records the token
ids) without its trailing ``/v1`` (the SDK adds ``/v1/messages``), its API key and model name. Each turn
sends the conversation with ``tool_choice`` naming ``press``: a random tiny model never writes a tool call
unforced, and the engine writes the forced one by constrained decoding, so the digit is the only choice it
makes. Each ``tool_use`` block is answered by a ``tool_result`` with the lock's answer; the loop ends when
the lock's episode is over (the second press).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from anthropic import AsyncAnthropic
from anthropic.types import MessageParam, ToolParam, ToolResultBlockParam

from lightning_grpc.examples.lock_tool import (
    PRESS,
    PRESS_DESCRIPTION,
    PRESS_PARAMETERS,
    Keypad,
    anthropic_base_url,
    tool_sampling,
)
from lightning_grpc.runner import rollout
from lightning_grpc.types import LLM

PRESS_TOOL: ToolParam = {"name": PRESS, "description": PRESS_DESCRIPTION, "input_schema": PRESS_PARAMETERS}


@rollout
async def agent(task: Mapping[str, Any], llm: LLM) -> float:
    """Play one lock; returns the reward (right digits / 2)."""
    keypad = Keypad.for_task(task)
    sampling = tool_sampling(task, llm.sampling_parameters)
    messages: list[MessageParam] = [{"role": "user", "content": str(task["prompt"])}]
    # max_retries: the proxy answers 429 (with Retry-After) while the engine loads new weights.
    client = AsyncAnthropic(
        base_url=anthropic_base_url(llm.endpoint), api_key=llm.api_key or "unused", max_retries=6
    )
    async with client:
        while not keypad.done:
            reply = await client.messages.create(
                model=llm.model,
                messages=messages,
                tools=[PRESS_TOOL],
                tool_choice={"type": "tool", "name": PRESS},
                max_tokens=sampling["max_tokens"],
                # The SDK's 2.x signature has no temperature or top_p; the Messages API still reads them.
                extra_body={"temperature": sampling["temperature"], "top_p": sampling["top_p"]},
            )
            results: list[ToolResultBlockParam] = [
                {
                    "type": "tool_result",
                    "tool_use_id": block.id,
                    "content": keypad.press(block.input["digit"]),
                }
                for block in reply.content
                if block.type == "tool_use" and block.name == PRESS
            ]
            if not results:  # no press: the lock stays as it is
                break
            messages += [
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": results},
            ]
    return keypad.reward
