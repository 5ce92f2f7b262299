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

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator


@dataclass(frozen=True)
class AttemptContext:
    rollout_id: str
    attempt_id: str
    #: Set when the store says the attempt must stop (cancelled, timed out, superseded).
    stop: threading.Event = field(default_factory=threading.Event, compare=False)


_current: contextvars.ContextVar[AttemptContext | None] = contextvars.ContextVar(
    "lightning_attempt", default=None
)


#: The trace id the next root span takes (a rollout's), read by :class:`RolloutTraceIds`.
_root_trace_id: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "lightning_root_trace_id", default=None
)


class RolloutTraceIds(RandomIdGenerator):
    """Span ids at random; the root span of an attempt takes its rollout's trace id."""

    def generate_trace_id(self) -> int:
        return _root_trace_id.get() or super().generate_trace_id()


@contextmanager
def root_trace_id(trace_id: int) -> Iterator[None]:
    """Root spans started inside take ``trace_id`` (when the provider uses :class:`RolloutTraceIds`)."""
    token = _root_trace_id.set(trace_id)
    try:
        yield
    finally:
        _root_trace_id.reset(token)


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
