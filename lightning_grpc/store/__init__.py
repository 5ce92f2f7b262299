"""The store: core state machine plus in-memory and SQLite backends."""

from __future__ import annotations

from pathlib import Path

from .backend import Backend, MemoryBackend
from .core import AddSpansResult, DequeueRequest, HeartbeatResult, SpanSelection, Store, WatchEvent
from .sqlite import SqliteBackend
from .state import SpanRecord

__all__ = [
    "AddSpansResult",
    "Backend",
    "DequeueRequest",
    "HeartbeatResult",
    "MemoryBackend",
    "SpanRecord",
    "SpanSelection",
    "SqliteBackend",
    "Store",
    "WatchEvent",
    "open_store",
]


async def open_store(db_path: str | Path | None = None, **options: object) -> Store:
    """Start a store: SQLite at ``db_path``, or in memory when it is None."""
    backend: Backend = SqliteBackend(db_path) if db_path is not None else MemoryBackend()
    return await Store(backend, **options).start()  # type: ignore[arg-type]
