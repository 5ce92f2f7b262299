"""The state every section of the store core shares, the commit plumbing and the lookups."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from lightning_grpc import logs
from lightning_grpc.errors import (
    InvalidArgumentError,
    LightningError,
    NotFoundError,
    Reason,
    ResourceExhaustedError,
    UnavailableError,
)
from lightning_grpc.types import Rollout, RolloutStatus, Worker, copy_rollout

from ..backend import Backend
from ..state import AttemptState, Change, ResourcesState, RolloutState, Txn, WorkerState
from .validation import check_timeout

log = logs.get_logger(__name__)

#: How long a write that frees space (a delete) waits for its commit while the store is full.
FREEING_PATIENCE = 5.0
#: How often a write waiting for its commit looks whether the backend can still write (seconds).
HEALTH_LOOK_INTERVAL = 0.25


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _first_done(*futures: asyncio.Future[Any]) -> None:
    """Wait until one of ``futures`` is done, cancelling none of them when the waiting task is cancelled
    (a commit's future is shared by every write in it)."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def wake(_: asyncio.Future[Any]) -> None:
        _set_done(woken)

    for fut in futures:
        fut.add_done_callback(wake)
    try:
        await woken
    finally:
        for fut in futures:
            fut.remove_done_callback(wake)


def _out_of_space_now(held: bool) -> UnavailableError:
    if held:
        why = (
            "the store's disk filled up while this write was being stored: it is held, and written once "
            "space returns; send it again (same ids) to learn its outcome"
        )
    else:
        why = "the store is waiting for disk space to store earlier writes; read again once there is room"
    return UnavailableError(why, reason=Reason.STORE_OUT_OF_SPACE)


def _database_unavailable(database: str, *, held: bool | None = None) -> UnavailableError:
    """The store cannot reach its database (``database`` names it and says why): a new write is refused
    (``held`` None), a write caught in the failing commit is held and written once it returns (``held``),
    and a read that must wait for earlier writes is refused (not ``held``)."""
    if held is None:
        why = (
            "writes are refused until it returns; everything acknowledged is stored, and what was in flight "
            "is written once it is back"
        )
    elif held:
        why = "this write is held and written once it returns; send it again (same ids) to learn its outcome"
    else:
        why = "earlier writes wait for it; read again once it is back"
    return UnavailableError(
        f"the store cannot reach its database ({database}): {why}", reason=Reason.DATABASE_UNAVAILABLE
    )


def _out_of_space() -> ResourceExhaustedError:
    return ResourceExhaustedError(
        "the store's disk is full (or the database at its size limit): writes are refused until space "
        "returns; everything acknowledged is stored, and what was in flight is written once there is room",
        reason=Reason.STORE_OUT_OF_SPACE,
    )


@dataclass
class DequeueRequest:
    """A dequeue to run once an attempt's outcome is stored (see :meth:`Store.complete_and_dequeue`)."""

    worker_id: str = ""
    max_rollouts: int = 1
    wait_timeout: float | None = None
    request_id: str = ""


@dataclass
class SpanSelection:
    rollout_id: str
    attempt_id: str = ""
    trace_id: str = ""
    span_id: str = ""
    parent_span_id: str = ""
    name: str = ""
    name_contains: str = ""


class _FinishWaiter:
    __slots__ = ("event", "pending")

    def __init__(self, pending: int) -> None:
        self.pending = pending
        self.event = asyncio.Event()


class StoreBase:
    """The state of a store, how changes are committed, and how ids are looked up."""

    def __init__(
        self,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.time,
        max_memory_bytes: int | None = None,
        max_span_bytes: int = 16 * 1024 * 1024,
        change_retention: int = 10_000,
        span_index_capacity: int = 250_000,
        timeout_rule: Callable[[float, str], None] | None = None,
    ) -> None:
        """``timeout_rule(seconds, field)`` refuses a rollout timeout the store cannot take (raising
        InvalidArgumentError); by default :func:`check_timeout`. A server passes the rule of its wire."""
        self.backend = backend
        self.clock = clock
        self.max_memory_bytes = max_memory_bytes if backend.in_memory else None
        self.max_span_bytes = max_span_bytes
        self.change_retention = change_retention
        self.span_index_capacity = span_index_capacity
        self.timeout_rule = timeout_rule or check_timeout
        self.store_id = ""
        self._started_at = time.monotonic()
        self._rollouts: dict[str, RolloutState] = {}
        #: The rollouts of each status (a status filter of ListRollouts walks only its own), and the status
        #: each rollout is filed under; kept by :meth:`_file_by_status`, on every change of a rollout.
        self._by_status: dict[RolloutStatus, dict[str, RolloutState]] = {s: {} for s in RolloutStatus}
        self._filed_status: dict[str, RolloutStatus] = {}
        self._attempts: dict[str, AttemptState] = {}
        self._queue: dict[str, None] = {}
        self._queue_seq = itertools.count(1)
        self._create_seq = itertools.count(1)
        #: Whether ``_rollouts`` (kept in the order rollouts were taken in) is also in (create_time, create_seq)
        #: order, so that a page in creation order can be read off it; False for good once a clock stepped back.
        self._in_creation_order = True
        self._last_create_time = -math.inf
        self._workers: dict[str, WorkerState] = {}
        self._resources: dict[str, ResourcesState] = {}
        self._latest_resources_id = ""
        self._dequeue_requests: dict[str, list[str]] = {}
        self._total_spans = 0
        self._memory_bytes = 0
        self._indexed_spans = 0
        # change log (contiguous revisions) and who waits on it
        self._changes: list[Change] = []
        self._revision = 0
        self._committed_revision = 0
        self._changes_committed: asyncio.Future[None] | None = None
        self._finish_waiters: dict[str, list[_FinishWaiter]] = {}
        self._span_waiters: dict[str, asyncio.Future[None]] = {}
        self._dequeue_waiters: list[asyncio.Future[None]] = []
        # watchdog
        self._deadlines: list[tuple[float, int, str]] = []
        self._deadline_tiebreak = itertools.count()
        self._watchdog_wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_commit: asyncio.Future[None] | None = None
        self._next_look: asyncio.Future[None] | None = None
        self._broken: BaseException | None = None
        self._meta: dict[str, str] = {}
        self._closing = False
        self._closed = False
        # when the store last began and stopped being unable to write (a full disk, its database out of reach),
        # for the watchdog
        self._outage_started: float | None = None
        self._outage_ended: float | None = None

    def check_not_draining(self) -> None:
        """A wait or a follow that the shutdown interrupts ends with UNAVAILABLE, so its caller reconnects."""
        if self._closing:
            raise UnavailableError(
                "the server is shutting down; reconnect and call again (a watch resumes from its last token)",
                reason=Reason.SHUTTING_DOWN,
            )

    # ------------------------------------------------------------------ the index by status
    def _hold(self, rs: RolloutState) -> None:
        """Take a rollout created or loaded: number it, keep it, file it under its status."""
        rs.create_seq = next(self._create_seq)
        self._rollouts[rs.rollout.rollout_id] = rs
        created = rs.rollout.create_time
        if created < self._last_create_time:
            self._in_creation_order = False
        self._last_create_time = max(self._last_create_time, created)
        self._file_by_status(rs)

    def _file_by_status(self, rs: RolloutState) -> None:
        """File ``rs`` under its status now (called with every recorded change, and at load)."""
        rid, status = rs.rollout.rollout_id, rs.rollout.status
        filed = self._filed_status.get(rid)
        if filed is status:
            return
        if filed is not None:
            self._by_status[filed].pop(rid, None)
        self._by_status[status][rid] = rs
        self._filed_status[rid] = status

    def _unfile(self, rid: str) -> None:
        filed = self._filed_status.pop(rid, None)
        if filed is not None:
            self._by_status[filed].pop(rid, None)

    # ------------------------------------------------------------------ commit plumbing
    def _check_writable(self, *, frees_space: bool = False) -> None:
        """Refuse a write the store cannot take now; one that ``frees_space`` (a delete) is taken while full."""
        if self._closed:
            raise UnavailableError("the store is shutting down", reason=Reason.STORE_CLOSED)
        if self._broken is not None:
            raise UnavailableError(f"the store cannot write: {self._broken}", reason=Reason.STORAGE_FAILED)
        if self.backend.unavailable:
            self._note_outage()
            raise _database_unavailable(self.backend.unavailable)
        if self.backend.out_of_space and not frees_space:
            self._note_outage()
            raise _out_of_space()

    def _cannot_write(self) -> bool:
        """Whether the backend cannot commit now (a full disk, a database out of reach)."""
        return self.backend.out_of_space or bool(self.backend.unavailable)

    def _note_outage(self) -> None:
        if self._outage_started is None:
            self._outage_started = self.clock()
            self._outage_ended = None

    async def _apply(self, tx: Txn, *, frees_space: bool = False) -> None:
        """Persist ``tx`` and return once it (and everything submitted before it) is durable.

        A write that ``frees_space`` goes ahead of writes held for want of space (the backend commits it
        first), so it waits for its own commit a while even when the store is full."""
        durable = self._submit(tx, frees_space=frees_space)
        if durable is not None:
            await durable

    def _submit(self, tx: Txn, *, frees_space: bool = False) -> Coroutine[Any, Any, None] | None:
        """Hand ``tx`` to the backend now: :meth:`_apply` without its wait. Returns the coroutine that waits
        until ``tx`` (and everything submitted before it) is durable, or None when it already is."""
        if tx.is_empty():
            last = self._last_commit
            if (last is None or last.done()) and self._broken is None:
                return None
            return self._durable()
        if tx.changes:
            tx.meta.setdefault("revision", str(tx.changes[-1].revision))
        fut = self.backend.submit(tx)
        if fut is None:
            self._after_commit(tx)
            return None
        if not (frees_space and self.backend.out_of_space):  # else it is committed ahead of the held writes
            self._last_commit = fut
        fut.add_done_callback(lambda f: self._on_commit_done(f, tx))
        return self._until_committed(fut, held=True, patience=FREEING_PATIENCE if frees_space else 0.0)

    async def _until_committed(
        self, fut: asyncio.Future[None], *, held: bool = False, patience: float = 0.0
    ) -> None:
        """Wait for a commit, unless the backend is out of space: then answer (UNAVAILABLE) after at most
        ``patience`` seconds, never waiting for space to return (``held``: this call's own write, which the
        backend keeps and writes later; else a read, which must not show what is not stored yet)."""
        give_up = time.monotonic() + patience
        while not fut.done():
            if self._cannot_write() and time.monotonic() >= give_up:
                self._note_outage()
                if self.backend.unavailable:
                    raise _database_unavailable(self.backend.unavailable, held=held)
                raise _out_of_space_now(held)
            await _first_done(fut, self._health_look())
        fut.result()

    def _health_look(self) -> asyncio.Future[None]:
        """Done at the next look at the backend's health, shared by every write waiting for its commit: one
        timer for them all, not one per wait."""
        look = self._next_look
        if look is None or look.done():
            loop = asyncio.get_running_loop()
            look = self._next_look = loop.create_future()
            loop.call_later(HEALTH_LOOK_INTERVAL, _set_done, look)
        return look

    def _on_commit_done(self, fut: asyncio.Future[None], tx: Txn) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._broken = exc
            log.error("event=store_broken error=%r", exc)
            return
        self._after_commit(tx)

    def _after_commit(self, tx: Txn) -> None:
        if self._outage_started is not None and self._outage_ended is None and not self._cannot_write():
            self._outage_ended = self.clock()  # the watchdog excuses the attempts what it could not write
            if self._watchdog_wake is not None:
                self._watchdog_wake.set()
        if tx.changes:
            self._committed_revision = max(self._committed_revision, tx.changes[-1].revision)
            fut, self._changes_committed = self._changes_committed, None
            if fut is not None and not fut.done():
                fut.set_result(None)
        for rid in tx.finished:
            for waiter in self._finish_waiters.get(rid, ()):
                waiter.pending -= 1
                if waiter.pending <= 0:
                    waiter.event.set()
        for rid in tx.span_rollouts:
            sfut = self._span_waiters.pop(rid, None)
            if sfut is not None and not sfut.done():
                sfut.set_result(None)

    async def _durable(self) -> None:
        fut = self._last_commit
        if fut is not None and not fut.done():
            try:
                await self._until_committed(fut)
            except LightningError:
                raise
            except Exception as exc:
                raise UnavailableError(
                    f"the store cannot write: {exc}", reason=Reason.STORAGE_FAILED
                ) from None
        if self._broken is not None:
            raise UnavailableError(f"the store cannot write: {self._broken}", reason=Reason.STORAGE_FAILED)

    # ------------------------------------------------------------------ lookups
    def _rollout(self, rollout_id: str, field: str = "rollout_id") -> RolloutState:
        if not rollout_id:
            raise InvalidArgumentError(field, "is required")
        rs = self._rollouts.get(rollout_id)
        if rs is None:
            raise NotFoundError(
                f"rollout {rollout_id} not found", reason=Reason.ROLLOUT_NOT_FOUND, rolloutId=rollout_id
            )
        return rs

    def _attempt(self, rollout_id: str, attempt_id: str) -> tuple[RolloutState, AttemptState]:
        rs = self._rollout(rollout_id)
        if not attempt_id:
            raise InvalidArgumentError("attempt_id", "is required")
        ast = self._attempts.get(attempt_id)
        if ast is None or ast.attempt.rollout_id != rollout_id:
            raise NotFoundError(
                f"attempt {attempt_id} not found in rollout {rollout_id}",
                reason=Reason.ATTEMPT_NOT_FOUND,
                rolloutId=rollout_id,
                attemptId=attempt_id,
            )
        return rs, ast

    def _resources_state(self, resources_id: str, field: str = "resources_id") -> ResourcesState:
        if not resources_id:
            raise InvalidArgumentError(field, "is required")
        res = self._resources.get(resources_id)
        if res is None:
            raise NotFoundError(
                f"resources {resources_id} not found",
                reason=Reason.RESOURCES_NOT_FOUND,
                resourcesId=resources_id,
            )
        return res

    def _worker(self, worker_id: str) -> WorkerState:
        ws = self._workers.get(worker_id)
        if ws is None:
            ws = self._workers[worker_id] = WorkerState(Worker(worker_id=worker_id))
        return ws

    @staticmethod
    def _snapshot(rs: RolloutState) -> Rollout:
        return copy_rollout(rs.rollout)

    def rollout_status(self, rollout_id: str) -> RolloutStatus | None:
        rs = self._rollouts.get(rollout_id)
        return rs.rollout.status if rs is not None else None
