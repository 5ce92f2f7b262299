"""Tool calls in the hermes format (Qwen2.5's chat template, vLLM's ``hermes`` parser): validation,
parsing of generated text, and the grammar that forces a call.

A call is written as ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>``, exactly as the
tiny model's chat template renders an assistant message's ``tool_calls``; so a parsed call, sent back
in the history, renders to the text the model generated. Parsing is plain text work (nothing here
imports torch or llguidance): the server parses a whole response, or feeds a ``ToolCallStream`` the
text deltas of a streamed one. The forced choices (``"required"``, a named function) become a Lark
grammar for llguidance (see ``guided``) that allows nothing but such a block, followed by the end of
the turn.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from lightning_grpc.engine.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: The JSON options of a forced call's arguments: the separators ``json.dumps`` and the template's
#: ``tojson`` write, no other whitespace, and only the escapes ``json.dumps(ensure_ascii=False)`` writes,
#: so re-serialising the parsed arguments gives back the generated text.
JSON_OPTIONS = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "json_allowed_escapes": '"\\bfnrt',
}
MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: none, auto, required, or named (then ``name`` is the function that must be called)."""

    mode: str
    name: str | None = None

    @property
    def parses(self) -> bool:
        """Whether generated text is searched for calls (every mode but ``none``)."""
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass
class ToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI ``message.tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def as_delta(self, index: int) -> dict[str, Any]:
        """The OpenAI streaming ``delta.tool_calls`` entry: the whole call in one delta."""
        return {"index": index, **self.as_dict()}


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ToolCall]


# ---------------------------------------------------------------- request validation
def validate_tools(value: Any) -> list[dict[str, Any]] | None:
    """``tools``: a list of ``{"type": "function", "function": {"name", "parameters"?...}}`` (400 otherwise)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools must be a list", "tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request('each tool must be an object with "type": "function"', param)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request("a tool needs a function object", f"{param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in '"\\\n\r\t'):
            raise bad_request(
                "a function needs a name (no quotes, backslashes or line breaks)", f"{param}.function.name"
            )
        if name in names:
            raise bad_request(f"two tools are named {name!r}", f"{param}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request("parameters must be a JSON schema object", f"{param}.function.parameters")
    return list(value)


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``tool_choice``: "auto" by default when there are tools, "none" without (400 for a bad one)."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if not tools and value != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if isinstance(value, str):
        if value not in MODES:
            raise bad_request(f"tool_choice must be one of {', '.join(MODES)} or a function", "tool_choice")
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if name not in {t["function"]["name"] for t in tools or []}:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("named", name)


# ---------------------------------------------------------------- the forced call's grammar
def forced_grammar(tools: list[dict[str, Any]], choice: ToolChoice) -> str | None:
    """The Lark grammar of one call to the chosen tool (named) or to any tool (required); else None."""
    if not choice.forced:
        return None
    functions = [
        t["function"] for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name
    ]
    key = json.dumps([[f["name"], f.get("parameters")] for f in functions], sort_keys=True)
    return _grammar(key)


@functools.lru_cache(maxsize=256)
def _grammar(key: str) -> str:
    """Cached by the tools' names and schemas: agents send the same tools with every turn."""
    rules = []
    for i, (name, parameters) in enumerate(json.loads(key)):
        schema = {**closed(parameters or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        head = f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        tail = f"}}\n{CLOSE}"
        rules.append(f"call_{i}: {_lark_string(head)} args_{i} {_lark_string(tail)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    alternatives = " | ".join(f"call_{i}" for i in range(len(rules) // 2))
    return "\n".join([f"start: {alternatives}", *rules])


#: Keys whose values are data, not schemas: left as they are by :func:`closed`.
DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def closed(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that does not say otherwise.

    JSON Schema allows any other property by default, and a random or untrained model then writes keys
    nobody declared until it runs out of tokens. A forced call holds the declared properties only, as vLLM's
    default grammar backend does (xgrammar's strict mode); a schema that sets ``additionalProperties``
    keeps its own choice.
    """
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in DATA_KEYS else closed(value) for key, value in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lark_string(text: str) -> str:
    """A Lark string literal (its escapes are JSON's for the characters a call's frame holds)."""
    return json.dumps(text, ensure_ascii=False)


# ---------------------------------------------------------------- parsing generated text
def parse_tool_calls(text: str) -> ParsedOutput:
    """Complete ``<tool_call>`` blocks become calls and the text before the first is the content.

    As vLLM's hermes parser: if any block is not a JSON object with ``name`` and ``arguments``, nothing is
    a call and the whole text is content. Text after the first block (between blocks, after the last)
    is dropped. One line break just before the first block is the template's separator, not content.
    """
    start = text.find(OPEN)
    if start < 0:
        return ParsedOutput(text or None, [])
    calls: list[ToolCall] = []
    position = start
    while (position := text.find(OPEN, position)) >= 0:
        end = text.find(CLOSE, position)
        call = _call(text[position + len(OPEN) : end]) if end >= 0 else None
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
        position = end + len(CLOSE)
    return ParsedOutput(_content_before(text[:start]), calls)


def _content_before(text: str) -> str | None:
    text = text.removesuffix("\n")
    return text or None


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
        return None
    return ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))


class ToolCallStream:
    """The streaming side of ``parse_tool_calls``: content until a block starts, then whole calls.

    ``feed`` takes each text delta and returns the content that may be sent now and the calls whose
    block just closed (numbered from 0 in order). Text that may still turn out to be the start of a block
    is held back. Unlike the whole-text parser, a malformed block cannot take back the calls already
    sent: it is sent as content, and the calls before and after it stand.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._in_block = False
        self._seen_block = False
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._pending += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                end = self._pending.find(CLOSE)
                if end < 0:
                    break
                block, self._pending = self._pending[:end], self._pending[end + len(CLOSE) :]
                self._in_block = False
                call = _call(block)
                if call is None:
                    content.append(OPEN + block + CLOSE)
                else:
                    calls.append(call.as_delta(self.calls))
                    self.calls += 1
                continue
            start = self._pending.find(OPEN)
            if start < 0:
                keep = max(_partial_suffix(self._pending, "\n" + OPEN), _partial_suffix(self._pending, OPEN))
                self._emit(content, self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            before = self._pending[:start]
            self._emit(content, before if self._seen_block else before.removesuffix("\n"))
            self._pending, self._in_block, self._seen_block = self._pending[start + len(OPEN) :], True, True
        return "".join(content), calls

    def finish(self) -> str:
        """The end of the text: an unclosed block, or what was held back before the first, is content."""
        rest = self._pending if not self._seen_block else ""
        if self._in_block:
            rest = OPEN + self._pending
        self._pending, self._in_block = "", False
        return rest

    def _emit(self, content: list[str], text: str) -> None:
        """Content before the first block; text between and after blocks is dropped, as when parsing."""
        if not self._seen_block:
            content.append(text)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
