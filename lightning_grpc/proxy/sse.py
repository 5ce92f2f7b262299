"""Server-sent events: split a byte stream into whole events, keeping each event's bytes as they came."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"
_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")


@dataclass(frozen=True)
class Event:
    """One event: its raw bytes (separator included) and its joined ``data:`` lines."""

    raw: bytes
    data: str

    @property
    def done(self) -> bool:
        return self.data.strip() == DONE

    def json(self) -> Any:
        """The parsed data; None for [DONE], comments, and data that is not JSON."""
        if not self.data or self.done:
            return None
        try:
            return json.loads(self.data)
        except ValueError:
            return None


def _split(buffer: bytes) -> tuple[bytes, bytes] | None:
    """(first event with its separator, rest), or None when no event is complete yet."""
    best: tuple[int, int] | None = None
    for sep in _SEPARATORS:
        at = buffer.find(sep)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, len(sep))
    if best is None:
        return None
    end = best[0] + best[1]
    return buffer[:end], buffer[end:]


def _data_of(raw: bytes) -> str:
    lines = raw.decode("utf-8", errors="replace").splitlines()
    parts = []
    for line in lines:
        if line.startswith("data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(parts)


async def events(chunks: AsyncIterable[bytes]) -> AsyncIterator[Event]:
    """Whole events from arbitrary byte chunks; a trailing event without separator ends the stream."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (cut := _split(buffer)) is not None:
            raw, buffer = cut
            yield Event(raw, _data_of(raw))
    if buffer.strip():
        yield Event(buffer, _data_of(buffer))


def encode(payload: Any) -> bytes:
    """One ``data:`` event carrying JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"
