"""The combination lock played by a LangGraph agent: a ``StateGraph`` whose model node is LangChain's
``ChatOpenAI`` bound to a ``press`` tool, a ``ToolNode`` that runs it, and conditional edges, trained
unchanged (chat completions with tools).

    lightning-grpc train examples/frameworks/langgraph_lock.toml          # from the repository root
    lightning-grpc runner examples.frameworks.langgraph_lock:agent --store 127.0.0.1:4747

The graph is built once, as LangGraph's documentation builds one; what changes per rollout comes in the
run's context (LangGraph's ``context_schema``): the chat model made from the LLM resource's base URL (the
proxy's route for this attempt, which records the token ids), API key and model name, and the episode's
:class:`~lightning_grpc.examples.lock_tool.Keypad`, which the tool reaches through its ``ToolRuntime``.
The model is bound with ``tool_choice="press"``: a random tiny model never writes a tool call unforced,
and the engine writes the forced one by constrained decoding, so the digit is the only choice it makes
(``strict=True`` too, as OpenAI's structured tool calls advise: the schema is sent closed to other keys;
the engine would close an open one itself).
After the tool, a conditional edge ends the graph when the lock's episode is over (the second press).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, ToolRuntime, tools_condition
from langgraph.runtime import Runtime
from pydantic import SecretStr

from lightning_grpc.examples.lock_tool import PRESS, PRESS_DESCRIPTION, Digit, Keypad, tool_sampling
from lightning_grpc.runner import rollout
from lightning_grpc.types import LLM


@dataclass
class LockRun:
    """What one run of the graph brings: the chat model for this rollout and the episode's keypad."""

    model: BaseChatModel
    keypad: Keypad


@tool(PRESS, description=PRESS_DESCRIPTION)
def press(digit: Digit, runtime: ToolRuntime[LockRun]) -> str:
    return runtime.context.keypad.press(digit)


async def call_model(state: MessagesState, runtime: Runtime[LockRun]) -> dict[str, Any]:
    model = runtime.context.model.bind_tools([press], tool_choice=PRESS, strict=True)
    return {"messages": [await model.ainvoke(state["messages"])]}


def after_tools(state: MessagesState, runtime: Runtime[LockRun]) -> str:
    """The end once the lock's episode is over (the second press), otherwise the next turn."""
    return END if runtime.context.keypad.done else "model"


def build_graph() -> Any:
    graph = StateGraph(MessagesState, context_schema=LockRun)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([press]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # to "tools" when the model called one
    graph.add_conditional_edges("tools", after_tools, ["model", END])
    return graph.compile()


locksmith = build_graph()


@rollout
async def agent(task: Mapping[str, Any], llm: LLM) -> float:
    """Play one lock; returns the reward (right digits / 2)."""
    sampling = tool_sampling(task, llm.sampling_parameters)
    model = ChatOpenAI(
        model=llm.model,
        base_url=llm.endpoint,
        api_key=SecretStr(llm.api_key or "unused"),
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        max_completion_tokens=sampling["max_tokens"],
        max_retries=6,  # the proxy answers 429 (with Retry-After) while the engine loads new weights
    )
    keypad = Keypad.for_task(task)
    await locksmith.ainvoke({"messages": [("user", str(task["prompt"]))]}, context=LockRun(model, keypad))
    return keypad.reward
