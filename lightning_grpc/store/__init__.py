"""The store: core state machine plus in-memory, SQLite and PostgreSQL backends.

The PostgreSQL backend (:mod:`lightning_grpc.store.postgres`) needs the ``postgres`` extra, so it is
imported only when asked for."""

from __future__ import annotations

from pathlib import Path

from .backend import Backend, MemoryBackend
from .core import (
    AddSpansResult,
    DequeueRequest,
    HeartbeatResult,
    SpanSelection,
    Store,
    SubmittedSpans,
    WatchEvent,
)
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
    "SubmittedSpans",
    "WatchEvent",
    "make_backend",
    "open_store",
]


def make_backend(db_path: str | Path | None = None, *, postgres_url: str | None = None) -> Backend:
    """The backend to store in: the PostgreSQL database at ``postgres_url``, SQLite at ``db_path``, or memory
    when neither is given."""
    if postgres_url is not None and db_path is not None:
        raise ValueError("give a SQLite path or a PostgreSQL URL, not both")
    if postgres_url is not None:
        from .postgres import PostgresBackend

        return PostgresBackend(postgres_url)
    return SqliteBackend(db_path) if db_path is not None else MemoryBackend()


async def open_store(
    db_path: str | Path | None = None, *, postgres_url: str | None = None, **options: object
) -> Store:
    """Start a store: in the PostgreSQL database at ``postgres_url``, SQLite at ``db_path``, or in memory
    when neither is given."""
    backend = make_backend(db_path, postgres_url=postgres_url)
    return await Store(backend, **options).start()  # type: ignore[arg-type]
