"""The API shapes the proxy speaks: OpenAI chat and legacy completions (passed through), OpenAI's
Responses API and Anthropic's Messages API (translated to and from chat completions, so the backend, the
recorded span and the trainer see one format). See :mod:`.base` for the interface."""

from __future__ import annotations

from .anthropic import AnthropicDialect
from .base import CompletionsDialect, Dialect, DialectError, StreamTranslator
from .responses import ResponsesDialect

CHAT = Dialect()
COMPLETIONS = CompletionsDialect()
RESPONSES = ResponsesDialect()
ANTHROPIC = AnthropicDialect()
#: The dialect of each route's last path segments.
BY_PATH: dict[str, Dialect] = {
    "chat/completions": CHAT,
    "completions": COMPLETIONS,
    "responses": RESPONSES,
    "messages": ANTHROPIC,
}


def dialect_for_path(path: str) -> Dialect:
    """The dialect of a request path (chat's OpenAI shape for routes that are no completion route)."""
    for suffix, dialect in BY_PATH.items():
        if path.endswith(f"/v1/{suffix}"):
            return dialect
    return CHAT


__all__ = [
    "ANTHROPIC",
    "BY_PATH",
    "CHAT",
    "COMPLETIONS",
    "RESPONSES",
    "AnthropicDialect",
    "CompletionsDialect",
    "Dialect",
    "DialectError",
    "ResponsesDialect",
    "StreamTranslator",
    "dialect_for_path",
]
