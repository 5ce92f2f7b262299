"""Which rollout attempt the running code works for, kept in a context variable.

Each asyncio task (and each thread started with a copied context) sees its own value, so one
process can run many rollouts at once and every span lands in its own attempt.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AttemptContext:
    rollout_id: str
    attempt_id: str
    #: Set when the store says the attempt must stop (cancelled, timed out, superseded).
    stop: threading.Event = field(default_factory=threading.Event, compare=False)


_current: contextvars.ContextVar[AttemptContext | None] = contextvars.ContextVar(
    "lightning_attempt", default=None
)


def current_attempt() -> AttemptContext | None:
    """The attempt the calling code runs for, or None outside a rollout."""
    return _current.get()


def should_stop() -> bool:
    """True once the current attempt was cancelled or ended by the store (for sync agents to poll)."""
    ctx = _current.get()
    return ctx is not None and ctx.stop.is_set()


@contextmanager
def attempt_context(ctx: AttemptContext) -> Iterator[AttemptContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
