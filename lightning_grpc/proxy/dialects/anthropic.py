"""Anthropic's Messages API (``POST /v1/messages``) over a chat-completions backend.

The request goes to chat completions through LiteLLM's ``LiteLLMAnthropicMessagesAdapter``
(``translate_anthropic_to_openai``: system, text/tool_use/tool_result blocks, tools, tool choice, stop
sequences, on plain dicts). The proxy checks first what the Messages API requires (``model``,
``max_tokens``, ``messages``) and refuses what the engine cannot take (images, documents, thinking blocks,
Anthropic's server tools) with a 400 naming the field. ``metadata`` and ``thinking`` are not passed on.

The answer back (a whole message, or the ``message_start`` … ``message_stop`` events) is written here:
LiteLLM's way back takes its ``ModelResponse`` objects and stream wrapper, not the chat JSON the proxy
relays, and its stream translator holds a text block open across tool calls.

Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, the type following
from the HTTP status.
"""

from __future__ import annotations

import json
from typing import Any

from lightning_grpc import semconv

from . import _litellm
from .base import (
    ChunkTranslator,
    Dialect,
    DialectError,
    choice0,
    engine_extras,
    event,
    new_id,
    require,
    tool_calls_of,
)

#: Request fields handed to LiteLLM's translation.
_PASSED = (
    "model",
    "messages",
    "system",
    "max_tokens",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "stop_sequences",
)
_BLOCKS = frozenset({"text", "tool_use", "tool_result"})
_TOOL_CHOICES = frozenset({"auto", "any", "tool", "none"})
#: Anthropic's error type for each HTTP status it uses.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    410: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_FINISH = {"length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


class AnthropicDialect(Dialect):
    name = semconv.DIALECT_ANTHROPIC_MESSAGES
    translates = True

    def error_body(self, status: int, code: str, message: str, kind: str, param: str | None = None) -> Any:
        return {"type": "error", "error": {"type": error_type(status), "message": message}}

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        model = require(body, "model", str, "a string")
        max_tokens = require(body, "max_tokens", int, "an integer")
        if max_tokens < 1:
            raise DialectError("max_tokens: must be at least 1", "max_tokens")
        _check_messages(body)
        _check_system(body.get("system"))
        _check_tools(body)
        request = {key: body[key] for key in _PASSED if body.get(key) is not None}
        made = _litellm.anthropic_adapter().translate_anthropic_to_openai(anthropic_message_request=request)
        chat = _litellm.clean_chat(made[0] if isinstance(made, tuple) else made)
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") and chat.get("tools"):
            chat["parallel_tool_calls"] = False
        stream = bool(body.get("stream"))
        chat.update(model=model, max_tokens=max_tokens, stream=stream, **engine_extras(body))
        if stream:
            chat["stream_options"] = {"include_usage": True}
        return chat

    def from_chat(self, chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        choice = choice0(chat)
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        assert isinstance(message, dict)
        content: list[dict[str, Any]] = []
        if isinstance(message.get("content"), str) and message["content"]:
            content.append({"type": "text", "text": message["content"]})
        calls = tool_calls_of(message)
        for call in calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["name"],
                    "input": _parsed(call["arguments"]),
                }
            )
        reason, sequence = stop_reason(
            str(choice.get("finish_reason") or ""), choice.get("stop_reason"), request, bool(calls)
        )
        usage = chat.get("usage") if isinstance(chat.get("usage"), dict) else {}
        assert isinstance(usage, dict)
        prompt_ids = chat.get("prompt_token_ids")
        return {
            "id": _message_id(str(chat.get("id") or "")),
            "type": "message",
            "role": "assistant",
            "model": request.get("model"),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": int(
                    usage.get("prompt_tokens") or (len(prompt_ids) if isinstance(prompt_ids, list) else 0)
                ),
                "output_tokens": int(usage.get("completion_tokens") or len(choice.get("token_ids") or ())),
            },
        }

    def translator(self, request: dict[str, Any]) -> MessagesStream:
        return MessagesStream(request)


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise DialectError("messages: field required", "messages")
    if not isinstance(messages, list) or not messages:
        raise DialectError("messages: must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise DialectError(f"{where}: must be an object with role user or assistant", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise DialectError(
                f"{where}.content: must be a string or a list of content blocks", f"{where}.content"
            )
        for j, block in enumerate(content):
            _check_block(block, f"{where}.content[{j}]")


def _check_block(block: Any, where: str) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _BLOCKS:
        raise DialectError(
            f"{where}: content blocks of type {kind!r} are not supported (text, tool_use, tool_result)", where
        )
    assert isinstance(block, dict)
    inner = block.get("content")
    if kind == "tool_result" and isinstance(inner, list):
        for k, part in enumerate(inner):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise DialectError(
                    f"{where}.content[{k}]: tool results may hold text only", f"{where}.content[{k}]"
                )


def _check_system(system: Any) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list) or any(
        not isinstance(b, dict) or b.get("type") != "text" for b in system
    ):
        raise DialectError("system: must be a string or a list of text blocks", "system")


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise DialectError("tools: must be a list", "tools")
        for i, tool in enumerate(tools):
            custom = isinstance(tool, dict) and tool.get("type") in (None, "custom")
            if not custom or not tool.get("name") or not isinstance(tool.get("input_schema"), dict):
                raise DialectError(
                    f"tools[{i}]: only custom tools with a name and an input_schema are supported",
                    f"tools[{i}]",
                )
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or str(choice.get("type")) not in _TOOL_CHOICES:
        raise DialectError("tool_choice: must be an object of type auto, any, tool or none", "tool_choice")
    if choice["type"] == "tool" and not choice.get("name"):
        raise DialectError("tool_choice.name: field required for type tool", "tool_choice.name")


def _parsed(arguments: str) -> Any:
    """A tool call's arguments as its ``input`` object (``{}`` when the model wrote no JSON object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message_id(chat_id: str) -> str:
    return f"msg_{chat_id}" if chat_id else new_id("msg_")


def stop_reason(finish: str, matched: Any, request: dict[str, Any], called: bool) -> tuple[str, str | None]:
    """(Anthropic stop reason, the stop sequence that ended the text) for a chat finish reason;
    ``matched`` is vLLM's ``stop_reason`` (the stop string or token that matched)."""
    if finish in _FINISH:
        return _FINISH[finish], None
    if called:
        return "tool_use", None
    sequences = request.get("stop_sequences") or ()
    if isinstance(matched, str) and matched in sequences:
        return "stop_sequence", matched
    return "end_turn", None


class MessagesStream(ChunkTranslator):
    """Chat chunks → ``message_start``, ``content_block_start`` / ``content_block_delta`` (``text_delta``,
    ``input_json_delta``) / ``content_block_stop`` per block, ``message_delta``, ``message_stop``."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__(request)
        self.block = -1

    def on_start(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": _message_id(self.chat_id),
            "type": "message",
            "role": "assistant",
            "model": self.request.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_ids or 0, "output_tokens": 0},
        }
        return [event("message_start", {"type": "message_start", "message": message})]

    def _start_block(self, block: dict[str, Any]) -> list[bytes]:
        self.block += 1
        return [
            event(
                "content_block_start",
                {"type": "content_block_start", "index": self.block, "content_block": block},
            )
        ]

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        return [
            event("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})
        ]

    def _stop_block(self) -> list[bytes]:
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def on_open_text(self) -> list[bytes]:
        return self._start_block({"type": "text", "text": ""})

    def on_text(self, text: str) -> list[bytes]:
        return self._delta({"type": "text_delta", "text": text})

    def on_close_text(self) -> list[bytes]:
        return self._stop_block()

    def on_open_tool(self, index: int) -> list[bytes]:
        tool = self.tools[index]
        return self._start_block({"type": "tool_use", "id": tool["id"], "name": tool["name"], "input": {}})

    def on_arguments(self, index: int, piece: str) -> list[bytes]:
        return self._delta({"type": "input_json_delta", "partial_json": piece})

    def on_close_tool(self, index: int) -> list[bytes]:
        return self._stop_block()

    def on_end(self) -> list[bytes]:
        reason, sequence = stop_reason(self.finish_reason, self.stop_reason, self.request, bool(self.tools))
        _, output = self.counts()
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": output},
        }
        return [event("message_delta", delta), event("message_stop", {"type": "message_stop"})]

    def on_fail(self, message: str) -> list[bytes]:
        return [event("error", {"type": "error", "error": {"type": "api_error", "message": message}})]
