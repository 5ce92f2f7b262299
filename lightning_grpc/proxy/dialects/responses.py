"""OpenAI's Responses API (``POST /v1/responses``) over a chat-completions backend.

The request goes to chat completions through LiteLLM's ``LiteLLMCompletionResponsesConfig`` (input items,
instructions, function tools and tool choice, on plain dicts). The proxy's own checks come first, so that a
request the engine could not serve is a 400 naming its field rather than a surprise from the backend:
conversation state kept on the server (``previous_response_id``, ``conversation``, ``background``) is
refused, since the proxy keeps none; so are input parts other than text and tools other than functions.
``store`` is accepted and ignored (nothing is stored, so nothing can refer to it).

The answer back (a whole body, or the stream's ``response.*`` events) is written here: LiteLLM's way back
needs its ``ModelResponse`` objects and stream wrapper, not the plain chat JSON the proxy relays.
"""

from __future__ import annotations

import time
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
    "instructions",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_output_tokens",
    "parallel_tool_calls",
)
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output"})
_TOOL_CHOICES = frozenset({"auto", "none", "required"})


class ResponsesDialect(Dialect):
    name = semconv.DIALECT_RESPONSES
    translates = True

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        model = require(body, "model", str, "a string")
        _refuse_state(body)
        source = _input(body)
        _check_tools(body)
        if body.get("max_output_tokens") is not None:
            require(body, "max_output_tokens", int, "an integer")
        stream = bool(body.get("stream"))
        params = {key: body[key] for key in _PASSED if body.get(key) is not None}
        made = _litellm.responses_config().transform_responses_api_request_to_chat_completion_request(
            model=model, input=source, responses_api_request=params, stream=stream
        )
        chat = _litellm.clean_chat(made)
        chat.update(model=model, stream=stream, **engine_extras(body))
        if stream:
            chat["stream_options"] = {"include_usage": True}
        return chat

    def from_chat(self, chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        choice = choice0(chat)
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        assert isinstance(message, dict)
        output: list[dict[str, Any]] = []
        if isinstance(message.get("content"), str) and message["content"]:
            output.append(_message_item(new_id("msg_"), message["content"], "completed"))
        for call in tool_calls_of(message):
            output.append(_call_item(new_id("fc_"), call["id"], call["name"], call["arguments"], "completed"))
        usage = chat.get("usage") if isinstance(chat.get("usage"), dict) else {}
        assert isinstance(usage, dict)
        prompt_ids = chat.get("prompt_token_ids")
        counts = (
            int(usage.get("prompt_tokens") or (len(prompt_ids) if isinstance(prompt_ids, list) else 0)),
            int(usage.get("completion_tokens") or len(choice.get("token_ids") or ())),
        )
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        return response_object(
            request, _response_id(chat), int(chat.get("created") or time.time()), status, output, counts
        )

    def translator(self, request: dict[str, Any]) -> ResponsesStream:
        return ResponsesStream(request)


def _refuse_state(body: dict[str, Any]) -> None:
    for key in ("previous_response_id", "conversation", "prompt"):
        if body.get(key) is not None:
            raise DialectError(f"{key}: not supported by this proxy, which keeps no conversation state", key)
    if body.get("background"):
        raise DialectError("background: background responses are not supported by this proxy", "background")


def _input(body: dict[str, Any]) -> Any:
    """The input, checked, with reasoning items (which the engine cannot take back) left out."""
    source = body.get("input")
    if source is None:
        raise DialectError("input: field required", "input")
    if isinstance(source, str):
        return source
    if not isinstance(source, list) or not source:
        raise DialectError("input: must be a string or a non-empty list of input items", "input")
    items = []
    for i, item in enumerate(source):
        if not isinstance(item, dict):
            raise DialectError(f"input[{i}]: must be an object", f"input[{i}]")
        kind = item.get("type") or "message"
        if kind == "reasoning":
            continue
        if kind not in _ITEM_TYPES:
            raise DialectError(f"input[{i}]: items of type {kind!r} are not supported", f"input[{i}].type")
        if kind == "message":
            _check_content(item.get("content"), f"input[{i}].content")
        items.append(item)
    return items


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise DialectError(f"{where}: must be a string or a list of content parts", where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise DialectError(
                f"{where}[{j}]: content of type {kind!r} is not supported (text only)", f"{where}[{j}]"
            )


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise DialectError("tools: must be a list", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
                raise DialectError(
                    f"tools[{i}]: only function tools with a name are supported", f"tools[{i}]"
                )
    choice = body.get("tool_choice")
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        return
    if not (isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name")):
        raise DialectError("tool_choice: must be auto, none, required or a function by name", "tool_choice")


def _response_id(chat: dict[str, Any]) -> str:
    chat_id = str(chat.get("id") or "")
    return f"resp_{chat_id}" if chat_id else new_id("resp_")


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    request: dict[str, Any],
    response_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    counts: tuple[int, int] | None,
) -> dict[str, Any]:
    """A Responses ``response`` object, echoing the request's settings as OpenAI does."""
    usage = None
    if counts is not None:
        usage = {
            "input_tokens": counts[0],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts[1],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts[0] + counts[1],
        }
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata") or {},
        "model": request.get("model"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "store": False,
        "usage": usage,
    }


class ResponsesStream(ChunkTranslator):
    """Chat chunks → ``response.created`` … ``response.output_text.delta`` /
    ``response.function_call_arguments.delta`` … ``response.completed``."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__(request)
        self.sequence = 0
        self.response_id = new_id("resp_")
        self.output: list[dict[str, Any]] = []
        self.item_id = ""
        self.tool_items: dict[int, tuple[int, str]] = {}  # chat tool index → (output index, item id)

    def _event(self, kind: str, **payload: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return event(kind, body)

    def _response(self, status: str) -> dict[str, Any]:
        counts = self.counts() if status != "in_progress" else None
        created = self.created or int(time.time())
        return response_object(self.request, self.response_id, created, status, list(self.output), counts)

    def on_start(self) -> list[bytes]:
        if self.chat_id:
            self.response_id = f"resp_{self.chat_id}"
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def on_open_text(self) -> list[bytes]:
        self.item_id = new_id("msg_")
        self.text = []
        index = len(self.output)
        self.output.append(_message_item(self.item_id, "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=index, item=self.output[index]),
            self._event(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def on_text(self, text: str) -> list[bytes]:
        index = len(self.output) - 1
        return [
            self._event(
                "response.output_text.delta",
                item_id=self.item_id, output_index=index, content_index=0, delta=text, logprobs=[],
            )
        ]  # fmt: skip

    def on_close_text(self) -> list[bytes]:
        index = len(self.output) - 1
        text = "".join(self.text)
        item = _message_item(self.item_id, text, "completed")
        self.output[index] = item
        part = item["content"][0]
        common = {"item_id": self.item_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **common, text=text, logprobs=[]),
            self._event("response.content_part.done", **common, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def on_open_tool(self, index: int) -> list[bytes]:
        tool = self.tools[index]
        at, item_id = len(self.output), new_id("fc_")
        self.tool_items[index] = (at, item_id)
        self.output.append(_call_item(item_id, tool["id"], tool["name"], "", "in_progress"))
        return [self._event("response.output_item.added", output_index=at, item=self.output[at])]

    def on_arguments(self, index: int, piece: str) -> list[bytes]:
        at, item_id = self.tool_items[index]
        return [
            self._event(
                "response.function_call_arguments.delta", item_id=item_id, output_index=at, delta=piece
            )
        ]

    def on_close_tool(self, index: int) -> list[bytes]:
        at, item_id = self.tool_items[index]
        tool, arguments = self.tools[index], self.arguments(index)
        item = _call_item(item_id, tool["id"], tool["name"], arguments, "completed")
        self.output[at] = item
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id, output_index=at, name=tool["name"], arguments=arguments,
            ),
            self._event("response.output_item.done", output_index=at, item=item),
        ]  # fmt: skip

    def on_end(self) -> list[bytes]:
        if self.finish_reason == "length":
            return [self._event("response.incomplete", response=self._response("incomplete"))]
        return [self._event("response.completed", response=self._response("completed"))]

    def on_fail(self, message: str) -> list[bytes]:
        failed = self._response("failed")
        failed["error"] = {"code": "server_error", "message": message}
        return [
            self._event("error", code="stream_failed", message=message, param=None),
            self._event("response.failed", response=failed),
        ]
