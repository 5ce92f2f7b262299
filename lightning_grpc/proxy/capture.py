"""What one LLM call produced, gathered from a whole response body or from its stream chunks.

vLLM's dialect (with ``return_token_ids``): chat responses carry ``prompt_token_ids`` at the top
level and ``token_ids`` per choice; legacy completions carry both per choice. When streaming,
``prompt_token_ids`` comes with the first chunk only and each chunk's ``token_ids`` holds the new
tokens, so the ids of a stream are the concatenation of its chunks' ids. Log-probs: chat
``choices[].logprobs.content[].logprob``, completions ``choices[].logprobs.token_logprobs``.
The embedded engine's ``forced_token_positions`` (a constrained choice: the tokens its grammar forced)
index that choice's ``token_ids``, or in a stream that chunk's, so a chunk's are offset by the ids
gathered before it.

Only choice 0 is gathered (agents ask for one choice; ``n > 1`` is kept in the recorded response).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "completion"]


def _int_list(value: Any) -> list[int] | None:
    """A copy of ``value`` if it is a list of ints (not bools), else None. The items' types are gathered in C
    (``set(map(type, ...))``): a prompt's ids run to thousands, and a test per item took three times as long."""
    if isinstance(value, list) and set(map(type, value)) <= _INT:
        return list(value)
    return None


_INT: set[type] = {int}


def _float_or_nan(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _choice0(payload: dict[str, Any]) -> dict[str, Any] | None:
    for choice in payload.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def _choice_logprobs(kind: Kind, choice: dict[str, Any]) -> list[float] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if kind == "chat":
        content = lp.get("content")
        if not isinstance(content, list):
            return None
        return [_float_or_nan(item.get("logprob") if isinstance(item, dict) else None) for item in content]
    values = lp.get("token_logprobs")
    if not isinstance(values, list):
        return None
    return [_float_or_nan(v) for v in values]


@dataclass
class ToolCallParts:
    id: str = ""
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": "".join(self.arguments)},
        }


@dataclass
class Capture:
    """Gathers ids, log-probs and the other recorded facts of one call."""

    kind: Kind
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    #: Indices into ``response_token_ids`` of the tokens a grammar forced (None: the backend sent none).
    forced_positions: list[int] | None = None
    finish_reason: str = ""
    response_id: str = ""
    model: str = ""
    policy_version: int | None = None
    usage: dict[str, Any] | None = None
    #: The whole body of a non-streamed call, as the backend sent it, and its JSON text (when it was UTF-8).
    body: dict[str, Any] | None = None
    body_json: str | None = None
    chunks: int = 0
    # Pieces of a streamed choice 0, to assemble the recorded response.
    _role: str = "assistant"
    _text: list[str] = field(default_factory=list)
    _reasoning: list[str] = field(default_factory=list)
    _tool_calls: dict[int, ToolCallParts] = field(default_factory=dict)
    _created: int = 0
    _object: str = ""

    # ------------------------------------------------------------ common
    def _header(self, payload: dict[str, Any]) -> None:
        self.response_id = self.response_id or str(payload.get("id") or "")
        self.model = self.model or str(payload.get("model") or "")
        self._created = self._created or int(payload.get("created") or 0)
        self._object = self._object or str(payload.get("object") or "")
        version = payload.get("policy_version")
        if isinstance(version, int) and not isinstance(version, bool):
            self.policy_version = version
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
        prompt = _int_list(payload.get("prompt_token_ids"))
        if prompt is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = prompt

    # ------------------------------------------------------------ whole body
    def add_body(self, payload: dict[str, Any], text: str | None = None) -> None:
        """The parsed body of a non-streamed answer; ``text``, the JSON it was parsed from, is recorded as is."""
        self.body = payload
        self.body_json = text
        self._header(payload)
        choice = _choice0(payload)
        if choice is None:
            return
        if self.prompt_token_ids is None:
            self.prompt_token_ids = _int_list(choice.get("prompt_token_ids"))
        self.response_token_ids = _int_list(choice.get("token_ids"))
        self.forced_positions = _int_list(choice.get("forced_token_positions"))
        self.logprobs = _choice_logprobs(self.kind, choice)
        self.finish_reason = str(choice.get("finish_reason") or "")

    # ------------------------------------------------------------ stream
    def add_chunk(self, payload: dict[str, Any]) -> None:
        self.chunks += 1
        self._header(payload)
        choice = _choice0(payload)
        if choice is None:
            return
        if self.prompt_token_ids is None:
            self.prompt_token_ids = _int_list(choice.get("prompt_token_ids"))
        ids = _int_list(choice.get("token_ids"))
        self._add_forced(choice, ids)
        if ids is not None:
            self.response_token_ids = (self.response_token_ids or []) + ids
        lps = _choice_logprobs(self.kind, choice)
        if lps is not None:
            self.logprobs = (self.logprobs or []) + lps
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        if self.kind == "chat":
            self._add_delta(choice.get("delta"))
        elif isinstance(choice.get("text"), str):
            self._text.append(choice["text"])

    def _add_forced(self, choice: dict[str, Any], ids: list[int] | None) -> None:
        """A chunk's forced positions, shifted to index the whole response (call before adding its ids)."""
        positions = _int_list(choice.get("forced_token_positions"))
        if positions is None:
            return
        offset = len(self.response_token_ids or [])
        self.forced_positions = (self.forced_positions or []) + [
            offset + i for i in positions if 0 <= i < len(ids or [])
        ]

    def _add_delta(self, delta: Any) -> None:
        if not isinstance(delta, dict):
            return
        if delta.get("role"):
            self._role = str(delta["role"])
        if isinstance(delta.get("content"), str):
            self._text.append(delta["content"])
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                self._reasoning.append(delta[key])
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            parts = self._tool_calls.setdefault(int(call.get("index") or 0), ToolCallParts())
            parts.id = parts.id or str(call.get("id") or "")
            parts.type = str(call.get("type") or parts.type)
            fn = call.get("function") or {}
            parts.name = parts.name or str(fn.get("name") or "")
            if isinstance(fn.get("arguments"), str):
                parts.arguments.append(fn["arguments"])

    def assembled(self) -> dict[str, Any]:
        """The response of a streamed call, as the same call would have answered without streaming."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason or None}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": self._role, "content": "".join(self._text)}
            if self._reasoning:
                message["reasoning_content"] = "".join(self._reasoning)
            if self._tool_calls:
                message["tool_calls"] = [self._tool_calls[i].as_dict() for i in sorted(self._tool_calls)]
            choice["message"] = message
        else:
            choice["text"] = "".join(self._text)
        out: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self._created,
            "model": self.model,
            "choices": [choice],
        }
        if self.usage is not None:
            out["usage"] = self.usage
        return out

    # ------------------------------------------------------------ results
    def response(self) -> dict[str, Any] | None:
        if self.body is not None:
            return self.body
        return self.assembled() if self.chunks else None

    def usage_counts(self) -> tuple[int | None, int | None]:
        """(prompt tokens, completion tokens): from the usage block, else counted from the ids."""
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if not isinstance(prompt, int) and self.prompt_token_ids is not None:
            prompt = len(self.prompt_token_ids)
        if not isinstance(completion, int) and self.response_token_ids is not None:
            completion = len(self.response_token_ids)
        return (
            prompt if isinstance(prompt, int) else None,
            completion if isinstance(completion, int) else None,
        )
