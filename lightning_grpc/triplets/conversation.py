"""An agent's LLM calls as a conversation: the tools offered, the tool calls made, the tool results sent back.

Read from the proxy's ``lightning.llm.call`` spans: :data:`semconv.LLM_REQUEST` is the chat-completions
request the proxy sent to the engine (``messages``, ``tools``, ``tool_choice``), :data:`semconv.LLM_RESPONSE`
its response (``choices[0].message.tool_calls``), whatever dialect the agent spoke. The one reader of these
in Python (``lightning-grpc rollout`` and ``spans``, the training run's transcripts); the dashboard has its
own (``dashboard/web/src/llm.ts``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_grpc import semconv
from lightning_grpc import types as t


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made: ``arguments`` is the JSON text it wrote."""

    call_id: str
    name: str
    arguments: str

    def text(self) -> str:
        return f"{self.name}({self.arguments})"


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer as the next prompt carried it; ``name`` from the tool call it answers ("" unknown)."""

    call_id: str
    name: str
    content: str


@dataclass(frozen=True)
class LlmCall:
    """One LLM call of an attempt, as a step of the conversation."""

    span_id: str
    sequence_id: int
    model: str = ""
    dialect: str = ""
    finish_reason: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tools: list[str] = field(default_factory=list)
    tool_choice: Any = None
    tool_results: list[ToolResult] = field(default_factory=list)
    user: list[str] = field(default_factory=list)
    reply: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None


def llm_calls(spans: Iterable[t.Span]) -> list[LlmCall]:
    """The LLM calls among ``spans``, in the order they started."""
    calls = [s for s in spans if s.name == semconv.SPAN_LLM_CALL]
    calls.sort(key=lambda s: (s.start_time_unix_nano, s.sequence_id))
    return [llm_call(s) for s in calls]


def llm_call(span: t.Span) -> LlmCall:
    attributes = span.attributes
    request = json_object(attributes.get(semconv.LLM_REQUEST))
    message = response_message(json_object(attributes.get(semconv.LLM_RESPONSE)))
    messages = _dicts(request.get("messages"))
    return LlmCall(
        span_id=span.span_id,
        sequence_id=span.sequence_id,
        model=str(attributes.get(semconv.LLM_MODEL) or ""),
        dialect=str(attributes.get(semconv.LLM_DIALECT) or ""),
        finish_reason=str(attributes.get(semconv.LLM_FINISH_REASON) or ""),
        prompt_tokens=_token_count(attributes, semconv.LLM_USAGE_PROMPT_TOKENS, semconv.LLM_PROMPT_TOKEN_IDS),
        completion_tokens=_token_count(
            attributes, semconv.LLM_USAGE_COMPLETION_TOKENS, semconv.LLM_RESPONSE_TOKEN_IDS
        ),
        tools=offered_tools(request.get("tools")),
        tool_choice=request.get("tool_choice"),
        tool_results=new_tool_results(messages),
        user=new_user_text(messages, request.get("prompt")),
        reply=content_text(message.get("content")),
        tool_calls=tool_calls_of(message.get("tool_calls")),
        error=semconv.read_llm_error(attributes, span.status_code, span.status_message),
    )


def response_message(response: Mapping[str, Any]) -> dict[str, Any]:
    """``choices[0].message`` of a chat-completions response ({} when it has none)."""
    choices = _dicts(response.get("choices"))
    if not choices:
        return {}
    message = choices[0].get("message")
    if isinstance(message, dict):
        return message
    text = choices[0].get("text")  # a completions response
    return {"content": text} if isinstance(text, str) else {}


def offered_tools(tools: Any) -> list[str]:
    """The names of the tools a request offered."""
    names = []
    for tool in _dicts(tools):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else tool.get("name")
        names.append(str(name or tool.get("type") or "?"))
    return names


def tool_calls_of(calls: Any) -> list[ToolCall]:
    """The ``tool_calls`` of an assistant message."""
    out = []
    for call in _dicts(calls):
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        out.append(ToolCall(str(call.get("id") or ""), str(function.get("name") or "?"), arguments))
    return out


def new_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[ToolResult]:
    """The tool results a prompt brings: its ``role: "tool"`` messages after its last assistant message."""
    names = {c.call_id: c.name for m in messages for c in tool_calls_of(m.get("tool_calls"))}
    return [
        ToolResult(
            call_id=str(m.get("tool_call_id") or ""),
            name=names.get(str(m.get("tool_call_id") or ""), str(m.get("name") or "")),
            content=content_text(m.get("content")),
        )
        for m in messages[_last_assistant(messages) + 1 :]
        if m.get("role") == "tool"
    ]


def _last_assistant(messages: Sequence[Mapping[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)


def new_user_text(messages: Sequence[Mapping[str, Any]], prompt: Any = None) -> list[str]:
    """What a prompt brings from the user: its user messages after its last assistant message (or a
    completions request's prompt)."""
    if not messages:
        return [content_text(prompt)] if prompt is not None else []
    return [
        content_text(m.get("content"))
        for m in messages[_last_assistant(messages) + 1 :]
        if m.get("role") == "user"
    ]


def content_text(content: Any) -> str:
    """A message's content as text: a string, the text parts of a list of parts, else its JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(str(p) for p in parts)
    return json.dumps(content, ensure_ascii=False)


# ---------------------------------------------------------------- printing
def format_llm_calls(calls: Sequence[LlmCall], width: int = 160) -> str:
    """The conversation, one block per call: its facts, what its prompt brought (tool results, user text),
    the model's reply and the tool calls it made."""
    return "\n".join(line for i, call in enumerate(calls, 1) for line in call_lines(i, call, width))


def call_lines(number: int, call: LlmCall, width: int) -> list[str]:
    lines = [f"#{number}  {call_facts(call)}"]
    if call.tools:
        choice = f"  (tool_choice {_compact(call.tool_choice)})" if call.tool_choice is not None else ""
        lines.append(f"  tools: {', '.join(call.tools)}{choice}")
    lines += [_cut(f"  <- {tool_result_text(r)}", width) for r in call.tool_results]
    lines += [_cut(f"  user: {_one_line(text)}", width) for text in call.user]
    if call.reply:
        lines.append(_cut(f"  assistant: {_one_line(call.reply)}", width))
    lines += [
        _cut(f"  -> {c.text()}{f'  [{c.call_id}]' if c.call_id else ''}", width) for c in call.tool_calls
    ]
    if call.error:
        lines.append(_cut(f"  error: {_one_line(call.error)}", width))
    return lines


def call_facts(call: LlmCall) -> str:
    tokens = f"{_count(call.prompt_tokens)} in / {_count(call.completion_tokens)} out"
    facts = [call.dialect or "-", f"finish {call.finish_reason or '-'}", f"tokens {tokens}"]
    if call.model:
        facts.append(f"model {call.model}")
    return "  ".join(facts)


def tool_result_text(result: ToolResult) -> str:
    label = " ".join(x for x in (result.name or "tool", f"[{result.call_id}]" if result.call_id else "") if x)
    return f"{label}: {_one_line(result.content)}"


def tool_calls_summary(span: t.Span) -> str:
    """A call's tool calls on one line (``press({"digit": 3}) press(...)``), for ``lightning-grpc spans``."""
    message = response_message(json_object(span.attributes.get(semconv.LLM_RESPONSE)))
    return " ".join(c.text() for c in tool_calls_of(message.get("tool_calls")))


# ---------------------------------------------------------------- helpers
def json_object(text: Any) -> dict[str, Any]:
    """A recorded JSON attribute as a dict ({} when it is not a JSON object)."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _token_count(attributes: Mapping[str, Any], usage: str, ids: str) -> int | None:
    value = attributes.get(usage)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    token_ids = attributes.get(ids)
    return len(token_ids) if isinstance(token_ids, list) else None


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _compact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
