"""LiteLLM's request adapters, loaded on first use (LiteLLM takes a second or two to import) and offline.

Only the request direction is taken from LiteLLM: its functions turn a Responses or Messages request
into chat messages and tools from plain dicts, without a network call. What they add that the engine has
no use for (``None`` fields, LiteLLM's bookkeeping keys) is cleaned off by :func:`clean_chat`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..litellm_client import load_litellm

_RESPONSES = "litellm.responses.litellm_completion_transformation.transformation"
_ANTHROPIC = "litellm.llms.anthropic.pass_through.adapters.transformation"
#: The chat-request fields a translated request keeps; LiteLLM's others (user, metadata, reasoning
#: effort, provider hints) are dropped, since the task asks that metadata be ignored and the engine takes none.
CHAT_FIELDS = (
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "parallel_tool_calls",
)
#: Fields LiteLLM adds to chat messages and tool calls that OpenAI's chat format does not have.
_MESSAGE_NOISE = ("thinking_blocks", "provider_specific_fields", "reasoning_content")


def responses_config() -> Any:
    """LiteLLM's ``LiteLLMCompletionResponsesConfig`` (Responses → chat)."""
    load_litellm()
    return importlib.import_module(_RESPONSES).LiteLLMCompletionResponsesConfig


def anthropic_adapter() -> Any:
    """A LiteLLM ``LiteLLMAnthropicMessagesAdapter`` (Messages → chat)."""
    load_litellm()
    return importlib.import_module(_ANTHROPIC).LiteLLMAnthropicMessagesAdapter()


def _plain(value: Any) -> Any:
    """LiteLLM's typed dicts and pydantic objects as plain JSON values."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _clean_message(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k not in _MESSAGE_NOISE}
    if out.get("role") == "assistant" and "content" not in out:
        out["content"] = None if out.get("tool_calls") else ""
    calls = out.get("tool_calls")
    if calls:
        out["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
    return out


#: A chat function tool's keys in the order OpenAI's documentation writes them. The chat template renders
#: the tools as JSON in key order, so a translated tool renders as the same tool sent as chat would.
_TOOL_KEYS = ("name", "description", "parameters", "strict")


def _clean_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = dict(tool.get("function") or {})
    if fn.get("strict") is False:
        del fn["strict"]
    if not fn.get("description"):
        fn.pop("description", None)
    ordered = {key: fn.pop(key) for key in _TOOL_KEYS if key in fn}
    return {"type": "function", "function": {**ordered, **fn}}


def clean_chat(request: Any) -> dict[str, Any]:
    """The chat fields of a LiteLLM-made request, as plain JSON in OpenAI's shape."""
    plain = _plain(dict(request))
    out = {key: plain[key] for key in CHAT_FIELDS if key in plain}
    out["messages"] = [_clean_message(m) for m in out.get("messages") or ()]
    if out.get("tools"):
        out["tools"] = [_clean_tool(t) for t in out["tools"]]
    else:
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            out.pop(key, None)
    return out
