"""What every dialect of the proxy shares: the interface, its errors, and the OpenAI-shaped dialects.

A dialect is the API shape an agent speaks on one route. The backend always speaks chat completions (or
legacy completions), so a translating dialect turns its request into a chat request (which then goes through
the same forwarding path as a chat call: :func:`~lightning_grpc.proxy.http.rewrite` asks for token ids and
log-probs, :class:`~lightning_grpc.proxy.capture.Capture` keeps the exact ids the engine used), and turns the
chat answer back: a whole body with :meth:`Dialect.from_chat`, a stream chunk by chunk with the
:class:`StreamTranslator` of :meth:`Dialect.translator`. Nothing is ever re-tokenized.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any, Protocol

from lightning_grpc import semconv


class DialectError(Exception):
    """A request the proxy refuses before anything reaches a backend: answered with ``status`` in the
    route's dialect, naming the offending field (``param``)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code or "invalid_request"


class StreamTranslator(Protocol):
    """Turns the chunks of one chat stream into the dialect's server-sent events."""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events one chat chunk makes (often none, some chunks several)."""
        ...

    def finish(self) -> list[bytes]:
        """The events that end the stream (sent once the call is recorded)."""
        ...

    def fail(self, message: str) -> list[bytes]:
        """The events that end a stream that broke off."""
        ...


class Dialect:
    """The OpenAI shape, which chat and legacy completions share: requests and answers pass through as
    they are; only the error body belongs to the dialect. Translating dialects override the rest."""

    #: The value of :data:`~lightning_grpc.semconv.LLM_DIALECT` for calls in this dialect.
    name: str = semconv.DIALECT_CHAT_COMPLETIONS
    #: Whether requests and answers are translated to and from chat completions.
    translates = False

    def error_body(self, status: int, code: str, message: str, kind: str, param: str | None = None) -> Any:
        """The body of an error answer; ``kind`` is OpenAI's error type."""
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat-completions request that serves ``body`` (raises :class:`DialectError`)."""
        return body

    def from_chat(self, chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        """The dialect's answer to ``request`` from the backend's chat answer."""
        return chat

    def translator(self, request: dict[str, Any]) -> StreamTranslator:
        raise NotImplementedError(f"the {self.name} dialect passes streams through")


class CompletionsDialect(Dialect):
    name = semconv.DIALECT_COMPLETIONS


# ------------------------------------------------------------------ helpers shared by the translators
def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def choice0(chat: Mapping[str, Any]) -> dict[str, Any]:
    """Choice 0 of a chat answer or chunk (an empty dict when it has none)."""
    for choice in chat.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


def tool_calls_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tool calls of a chat message, each as (id, name, arguments string)."""
    out = []
    for call in message.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        fn = call.get("function") or {}
        args = fn.get("arguments")
        out.append(
            {
                "id": str(call.get("id") or new_id("call_")),
                "name": str(fn.get("name") or ""),
                "arguments": args if isinstance(args, str) else json.dumps(args or {}),
            }
        )
    return out


def usage_of(chat: Mapping[str, Any], prompt_ids: int | None, output_ids: int | None) -> tuple[int, int]:
    """(input tokens, output tokens) from a chat answer's usage, else counted from its token ids."""
    usage = chat.get("usage") if isinstance(chat.get("usage"), dict) else {}
    assert isinstance(usage, dict)
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) else (prompt_ids or 0),
        completion if isinstance(completion, int) else (output_ids or 0),
    )


def require(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``body[key]``, which must be present and of ``kind`` (else a 400 naming ``key``)."""
    value = body.get(key)
    if value is None:
        raise DialectError(f"{key}: field required", key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise DialectError(f"{key}: must be {what}", key)
    return value


def event(name: str, payload: Mapping[str, Any]) -> bytes:
    """One named server-sent event carrying JSON."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


#: Sampling fields a dialect request may carry (through the SDKs' ``extra_body``) that go to the engine as
#: they are: vLLM's extensions, which make runs reproducible.
ENGINE_EXTRAS = ("seed", "top_k", "repetition_penalty", "min_p")


def engine_extras(body: Mapping[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in ENGINE_EXTRAS if body.get(key) is not None}


class ChunkTranslator:
    """A state machine over chat chunks that both streaming dialects share: it reads each chunk's text and
    tool-call deltas, opens and closes one output block at a time (the text, or one tool call), and
    counts tokens; the dialect says what each step looks like on the wire (the ``on_*`` hooks).

    Written here rather than taken from LiteLLM: LiteLLM's streaming translators iterate its own
    ``ModelResponseStream`` objects out of a ``CustomStreamWrapper`` (with its logging object), not the
    plain chunks the proxy relays and captures, and would hold back events the agent should get at once."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.started = False
        self.chat_id = ""
        self.created = 0
        self.finish_reason = ""
        self.stop_reason: Any = None
        self.usage: dict[str, Any] = {}
        self.prompt_ids: int | None = None
        self.output_ids = 0
        self.text: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.open: tuple[str, int] | None = None

    # ------------------------------------------------------------ the chat side
    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        self._account(chunk)
        if not self.started:
            self.started = True
            out += self.on_start()
        choice = choice0(chunk)
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        assert isinstance(delta, dict)
        content = delta.get("content")
        if isinstance(content, str) and content:
            out += self._text(content)
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                out += self._tool(call)
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
            self.stop_reason = choice.get("stop_reason")
        return out

    def finish(self) -> list[bytes]:
        out = [] if self.started else self.on_start()
        self.started = True
        return out + self._close() + self.on_end()

    def fail(self, message: str) -> list[bytes]:
        return self.on_fail(message)

    def _account(self, chunk: dict[str, Any]) -> None:
        self.chat_id = self.chat_id or str(chunk.get("id") or "")
        self.created = self.created or int(chunk.get("created") or 0)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        prompt = chunk.get("prompt_token_ids")
        if isinstance(prompt, list) and self.prompt_ids is None:
            self.prompt_ids = len(prompt)
        ids = choice0(chunk).get("token_ids")
        if isinstance(ids, list):
            self.output_ids += len(ids)

    def _text(self, content: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open != ("text", 0):
            out += self._close()
            self.open = ("text", 0)
            out += self.on_open_text()
        self.text.append(content)
        return out + self.on_text(content)

    def _tool(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = int(call.get("index") or 0)
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        assert isinstance(fn, dict)
        if index not in self.tools:
            out += self._close()
            self.tools[index] = {
                "id": str(call.get("id") or new_id("call_")),
                "name": str(fn.get("name") or ""),
                "arguments": [],
            }
            self.open = ("tool", index)
            out += self.on_open_tool(index)
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            self.tools[index]["arguments"].append(args)
            out += self.on_arguments(index, args)
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        kind, index = self.open
        self.open = None
        return self.on_close_text() if kind == "text" else self.on_close_tool(index)

    def counts(self) -> tuple[int, int]:
        return usage_of({"usage": self.usage}, self.prompt_ids, self.output_ids)

    def arguments(self, index: int) -> str:
        return "".join(self.tools[index]["arguments"])

    # ------------------------------------------------------------ the dialect side
    def on_start(self) -> list[bytes]:
        return []

    def on_open_text(self) -> list[bytes]:
        return []

    def on_text(self, text: str) -> list[bytes]:
        return []

    def on_close_text(self) -> list[bytes]:
        return []

    def on_open_tool(self, index: int) -> list[bytes]:
        return []

    def on_arguments(self, index: int, piece: str) -> list[bytes]:
        return []

    def on_close_tool(self, index: int) -> list[bytes]:
        return []

    def on_end(self) -> list[bytes]:
        return []

    def on_fail(self, message: str) -> list[bytes]:
        return []
