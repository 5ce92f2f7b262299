"""The storage interface of the store core, and the in-memory backend.

The core keeps rollouts, attempts, workers and resources in memory and decides every state
change; a backend persists what each operation changed (a :class:`Txn`) and holds span bodies.
``submit`` returns an awaitable that resolves once the change is durable (``None`` when it
already is, as in memory).
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .state import LoadedState, SpanRecord, Txn

#: A span's rollout and attempt number: where the in-memory backend files it.
_ATTEMPT_OF_SPAN = operator.attrgetter("rollout_id", "attempt_no")


@dataclass
class SpanQuery:
    rollout_id: str
    #: 0: every attempt.
    attempt_no: int = 0
    #: Return spans strictly after this (attempt_no, sequence_id) position.
    after: tuple[int, int] = (0, 0)
    trace_id: str = ""
    span_id: str = ""
    parent_span_id: str = ""
    name: str = ""
    name_contains: str = ""
    limit: int = 1000
    #: Newest first: spans strictly before ``after`` (which then starts at the end).
    descending: bool = False

    @property
    def filtered(self) -> bool:
        """Whether anything but the rollout and attempt narrows the spans."""
        return bool(self.trace_id or self.span_id or self.parent_span_id or self.name or self.name_contains)

    def matches(self, r: SpanRecord) -> bool:
        return (
            (not self.trace_id or r.trace_id == self.trace_id)
            and (not self.span_id or r.span_id == self.span_id)
            and (not self.parent_span_id or r.parent_span_id == self.parent_span_id)
            and (not self.name or r.name == self.name)
            and (not self.name_contains or self.name_contains in r.name)
        )


class Backend(Protocol):
    name: str
    #: True when span bodies live in this process's memory (memory accounting applies).
    in_memory: bool
    #: True while the backend cannot commit for want of space (a full disk, a database at its size
    #: limit): the store then refuses new writes, and the backend keeps retrying what it holds.
    out_of_space: bool
    #: Non-empty while the backend cannot reach its database (a database server down or out of reach): it
    #: names the database and says why. The store then refuses new writes with UNAVAILABLE, and the backend
    #: keeps retrying, with back-off, the writes it holds (none of them acknowledged yet).
    unavailable: str

    async def open(self) -> LoadedState: ...

    def on_outage(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called (on the event loop) when the backend finds it cannot write although no
        write told the store (an idle check found the database gone), so that the outage counts from then."""
        ...

    def on_lease_lost(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called (on the event loop) when another server took over the database this
        backend wrote (a standby of a shared database): it writes nothing from then on, and its server stops."""
        ...

    def submit(self, tx: Txn) -> asyncio.Future[None] | None: ...

    async def query_spans(self, query: SpanQuery) -> list[SpanRecord]: ...

    async def count_spans(self, query: SpanQuery) -> int:
        """How many spans ``query`` matches, ignoring its position and limit."""
        ...

    def load_span_ids(self, rollout_id: str, attempt_no: int) -> dict[str, int]: ...

    def storage_bytes(self) -> int:
        """Bytes the backend keeps on disk (0 when it keeps nothing there)."""
        ...

    async def close(self) -> None: ...


class MemoryBackend:
    """Volatile storage: everything lives in this process and is gone when it exits."""

    name = "memory"
    in_memory = True
    out_of_space = False
    unavailable = ""

    def __init__(self) -> None:
        # rollout_id -> attempt_no -> spans (kept sorted by sequence id on read)
        self._spans: dict[str, dict[int, list[SpanRecord]]] = {}
        self._unsorted: set[tuple[str, int]] = set()

    async def open(self) -> LoadedState:
        return LoadedState(store_id=uuid.uuid4().hex[:12])

    def on_outage(self, callback: Callable[[], None]) -> None:
        return None  # memory never fails to write

    def on_lease_lost(self, callback: Callable[[], None]) -> None:
        return None  # nobody else can write this process's memory

    def submit(self, tx: Txn) -> None:
        for rid in tx.deleted_rollouts:
            self._spans.pop(rid, None)
        # each run of one attempt's spans at once (a batch's spans are nearly always one run)
        for key, run in itertools.groupby(tx.spans, _ATTEMPT_OF_SPAN):
            spans = list(run)
            bucket = self._spans.setdefault(key[0], {}).setdefault(key[1], [])
            numbers = [r.sequence_id for r in spans]
            if (bucket and bucket[-1].sequence_id > numbers[0]) or numbers != sorted(numbers):
                self._unsorted.add(key)
            bucket.extend(spans)
        return None

    def _bucket(self, rollout_id: str, attempt_no: int) -> list[SpanRecord]:
        bucket = self._spans.get(rollout_id, {}).get(attempt_no, [])
        key = (rollout_id, attempt_no)
        if key in self._unsorted:
            bucket.sort(key=lambda r: r.sequence_id)
            self._unsorted.discard(key)
        return bucket

    async def query_spans(self, query: SpanQuery) -> list[SpanRecord]:
        per_attempt = self._spans.get(query.rollout_id, {})
        numbers = [query.attempt_no] if query.attempt_no else sorted(per_attempt)
        out: list[SpanRecord] = []
        after = query.after
        if query.descending:
            for no in reversed(numbers):
                if no > after[0]:
                    continue
                for rec in reversed(self._bucket(query.rollout_id, no)):
                    if (no, rec.sequence_id) < after and query.matches(rec):
                        out.append(rec)
                        if len(out) >= query.limit:
                            return out
            return out
        for no in numbers:
            if no < after[0]:
                continue
            for rec in self._bucket(query.rollout_id, no):
                if no == after[0] and rec.sequence_id <= after[1]:
                    continue
                if query.matches(rec):
                    out.append(rec)
                    if len(out) >= query.limit:
                        return out
        return out

    async def count_spans(self, query: SpanQuery) -> int:
        per_attempt = self._spans.get(query.rollout_id, {})
        numbers = [query.attempt_no] if query.attempt_no else list(per_attempt)
        return sum(1 for no in numbers for rec in self._bucket(query.rollout_id, no) if query.matches(rec))

    def load_span_ids(self, rollout_id: str, attempt_no: int) -> dict[str, int]:
        return {r.span_id: r.sequence_id for r in self._spans.get(rollout_id, {}).get(attempt_no, [])}

    def storage_bytes(self) -> int:
        return 0

    async def close(self) -> None:
        return None
