"""The store core: every state transition of rollouts, attempts, spans, resources and workers.

It knows nothing of gRPC. All state changes happen in plain (non-async) code on the event loop,
so each operation is atomic; what it changed is collected in a :class:`Txn`, handed to the
backend in one piece, and the caller is answered only once the backend says it is durable.

Rules (see DESIGN section 3):
- A SUCCEEDED/FAILED/CANCELLED rollout never changes status again.
- A rollout has at most one active attempt, and it is the latest; only the latest attempt moves
  the rollout; an ended attempt never changes again.
- Deadlines fire from a timer (the watchdog task), whether or not anyone calls the store.
- Spans and attempt heartbeats both keep an attempt alive.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

from lightning_grpc.errors import (
    AbortedError,
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    ResourceExhaustedError,
    UnavailableError,
)
from lightning_grpc.types import (
    RETRYABLE_ATTEMPT_STATUSES,
    AddSpansResult,
    Attempt,
    AttemptHeartbeat,
    AttemptStatus,
    DeleteResult,
    Page,
    Resource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutSpec,
    RolloutStatus,
    Statistics,
    WatchEvent,
    Worker,
    WorkerStatus,
    copy_rollout,
)

from . import paging, rows
from .backend import Backend, SpanQuery
from .state import (
    AttemptState,
    Change,
    ResourcesState,
    RolloutState,
    SpanRecord,
    Txn,
    WorkerState,
)

log = logging.getLogger("lightning_grpc.store")

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
MAX_BATCH_ROLLOUTS = 10_000
MAX_BATCH_SPANS = 100_000
MAX_SPAN_SEQUENCE_RESERVATION = 1_000_000
MAX_WAIT_SECONDS = 3600.0
MAX_ATTEMPTS_LIMIT = 1000
MAX_WAIT_IDS = 100_000
MAX_SEQUENCE_ID = 2**62
ROLLOUT_OVERHEAD_BYTES = 1024
ATTEMPT_OVERHEAD_BYTES = 320
SPAN_OVERHEAD_BYTES = 160
LATEST = "latest"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


#: The name the store used for :class:`~lightning_grpc.types.AttemptHeartbeat` before it moved there.
HeartbeatResult = AttemptHeartbeat


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


class Store:
    """The rollout queue, attempts, spans, resources and workers, over a pluggable backend."""

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
        self._attempts: dict[str, AttemptState] = {}
        self._queue: dict[str, None] = {}
        self._queue_seq = itertools.count(1)
        self._create_seq = itertools.count(1)
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
        self._broken: BaseException | None = None
        self._meta: dict[str, str] = {}
        self._closing = False
        self._closed = False

    # ================================================================== lifecycle
    async def start(self) -> Store:
        loaded = await self.backend.open()
        self.store_id = loaded.store_id
        max_queue_seq = 0
        for rs in loaded.rollouts:
            rs.create_seq = next(self._create_seq)
            self._rollouts[rs.rollout.rollout_id] = rs
            rs.bytes = self._estimate_rollout_bytes(rs)
            self._memory_bytes += rs.bytes
            max_queue_seq = max(max_queue_seq, rs.queue_seq)
            for ast in rs.attempts:
                self._attempts[ast.attempt.attempt_id] = ast
                if ast.request_id:
                    self._dequeue_requests.setdefault(ast.request_id, []).append(rs.rollout.rollout_id)
                if ast.attempt.status.is_active and ast.attempt.worker_id:
                    self._worker(ast.attempt.worker_id).active_attempts.add(ast.attempt.attempt_id)
        for rs in sorted(
            (r for r in loaded.rollouts if r.rollout.status.is_queued), key=lambda r: r.queue_seq
        ):
            self._queue[rs.rollout.rollout_id] = None
        self._queue_seq = itertools.count(max_queue_seq + 1)
        for ws in loaded.workers:
            active = self._workers.get(ws.worker.worker_id)
            if active is not None:
                ws.active_attempts = active.active_attempts
            self._workers[ws.worker.worker_id] = ws
        for res in loaded.resources:
            self._resources[res.resources.resources_id] = res
        self._latest_resources_id = loaded.latest_resources_id
        self._changes = loaded.changes
        self._revision = self._committed_revision = loaded.revision
        self._total_spans = loaded.total_spans
        self._meta = dict(loaded.meta)
        self._watchdog_wake = asyncio.Event()
        for ast in self._attempts.values():
            if ast.attempt.status.is_active:
                self._schedule(ast)
        self._tasks = [
            asyncio.create_task(self._watchdog(), name="lightning-store-watchdog"),
            asyncio.create_task(self._housekeeping(), name="lightning-store-housekeeping"),
        ]
        log.info(
            "event=store_started backend=%s store_id=%s rollouts=%d queued=%d",
            self.backend.name,
            self.store_id,
            len(self._rollouts),
            len(self._queue),
        )
        return self

    def begin_shutdown(self) -> None:
        """Stop waiting: long-polling dequeues answer empty, watches and tails end."""
        self._closing = True
        self._wake_dequeuers()
        fut, self._changes_committed = self._changes_committed, None
        if fut is not None and not fut.done():
            fut.set_result(None)
        for sfut in self._span_waiters.values():
            if not sfut.done():
                sfut.set_result(None)
        for waiters in self._finish_waiters.values():
            for waiter in waiters:
                waiter.event.set()

    async def close(self) -> None:
        self.begin_shutdown()
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self._durable()
        await self.backend.close()
        log.info("event=store_closed backend=%s", self.backend.name)

    # ================================================================== commit plumbing
    def _check_writable(self) -> None:
        if self._closed:
            raise UnavailableError("the store is shutting down", reason="STORE_CLOSED")
        if self._broken is not None:
            raise UnavailableError(f"the store cannot write: {self._broken}", reason="STORAGE_FAILED")

    async def _apply(self, tx: Txn) -> None:
        """Persist ``tx`` and return once it (and everything submitted before it) is durable."""
        if tx.is_empty():
            await self._durable()
            return
        if tx.changes:
            tx.meta.setdefault("revision", str(tx.changes[-1].revision))
        fut = self.backend.submit(tx)
        if fut is None:
            self._after_commit(tx)
            return
        self._last_commit = fut
        fut.add_done_callback(lambda f: self._on_commit_done(f, tx))
        await asyncio.shield(fut)

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
                await asyncio.shield(fut)
            except Exception as exc:
                raise UnavailableError(f"the store cannot write: {exc}", reason="STORAGE_FAILED") from None
        if self._broken is not None:
            raise UnavailableError(f"the store cannot write: {self._broken}", reason="STORAGE_FAILED")

    # ================================================================== lookups
    def _rollout(self, rollout_id: str, field: str = "rollout_id") -> RolloutState:
        if not rollout_id:
            raise InvalidArgumentError(field, "is required")
        rs = self._rollouts.get(rollout_id)
        if rs is None:
            raise NotFoundError(
                f"rollout {rollout_id} not found", reason="ROLLOUT_NOT_FOUND", rolloutId=rollout_id
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
                reason="ATTEMPT_NOT_FOUND",
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
                f"resources {resources_id} not found", reason="RESOURCES_NOT_FOUND", resourcesId=resources_id
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

    # ================================================================== validation
    @staticmethod
    def _check_id(value: str, field: str) -> None:
        if not _ID_RE.fullmatch(value):
            raise InvalidArgumentError(
                field,
                "must be 1-128 characters of letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
            )

    @staticmethod
    def _check_worker_id(value: str, field: str = "worker_id") -> None:
        """Worker ids are optional; a given one follows the id syntax."""
        if value:
            Store._check_id(value, field)

    def _check_config(self, config: RolloutConfig, field: str) -> RolloutConfig:
        for name in ("timeout", "unresponsive_timeout"):
            value = getattr(config, name)
            if value is not None:
                self.timeout_rule(value, f"{field}.{name}")
        if config.max_attempts < 0 or config.max_attempts > MAX_ATTEMPTS_LIMIT:
            raise InvalidArgumentError(
                f"{field}.max_attempts",
                f"must be between 0 and {MAX_ATTEMPTS_LIMIT} (got {config.max_attempts})",
            )
        retry_on = []
        for i, status in enumerate(config.retry_on):
            if status not in RETRYABLE_ATTEMPT_STATUSES:
                got = status.name if isinstance(status, AttemptStatus) else repr(status)
                raise InvalidArgumentError(
                    f"{field}.retry_on[{i}]", f"must be FAILED, TIMEOUT or UNRESPONSIVE (got {got})"
                )
            if status not in retry_on:
                retry_on.append(status)
        return replace(config, max_attempts=max(1, config.max_attempts), retry_on=tuple(retry_on))

    @staticmethod
    def _check_mode(mode: int, field: str) -> RolloutMode:
        try:
            return RolloutMode(mode)
        except ValueError:
            raise InvalidArgumentError(field, f"is not a rollout mode (got {mode})") from None

    @staticmethod
    def _check_metadata(metadata: Any, field: str) -> dict[str, Any]:
        if metadata is None:
            return {}
        if not isinstance(metadata, dict):
            raise InvalidArgumentError(field, "must be an object")
        check_json(metadata, field)
        return metadata

    @staticmethod
    def _check_limit(value: int, field: str, maximum: int) -> None:
        if value < 0 or value > maximum:
            raise InvalidArgumentError(field, f"must be between 0 and {maximum} (got {value})")

    def check_wait(self, seconds: float | None, field: str) -> float:
        """Validate a wait in seconds (None: no wait); returns it."""
        return self._check_wait(seconds, field)

    @staticmethod
    def _check_wait(seconds: float | None, field: str) -> float:
        if seconds is None:
            return 0.0
        if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_WAIT_SECONDS:
            raise InvalidArgumentError(
                field, f"must be between 0 and {MAX_WAIT_SECONDS:.0f} s (got {seconds})"
            )
        return seconds

    def _prepare_spec(self, spec: RolloutSpec, field: str) -> tuple[RolloutSpec, str]:
        if spec.rollout_id:
            self._check_id(spec.rollout_id, f"{field}.rollout_id")
        if spec.group_id and len(spec.group_id) > 256:
            raise InvalidArgumentError(f"{field}.group_id", "must be at most 256 characters")
        check_json(spec.input, f"{field}.input")
        mode = self._check_mode(spec.mode, f"{field}.mode")
        config = self._check_config(spec.config, f"{field}.config")
        metadata = self._check_metadata(spec.metadata, f"{field}.metadata")
        if spec.resources_id:
            self._resources_state(spec.resources_id, f"{field}.resources_id")
        fingerprint = _fingerprint(
            spec.input, int(mode), spec.resources_id, spec.group_id, rows.config_to_dict(config), metadata
        )
        return replace(spec, mode=mode, config=config, metadata=metadata), fingerprint

    # ================================================================== rollouts
    def _create_rollout(self, spec: RolloutSpec, fingerprint: str, now: float, tx: Txn) -> RolloutState:
        rollout = Rollout(
            rollout_id=spec.rollout_id or new_id("ro"),
            input=spec.input,
            mode=spec.mode,
            resources_id=spec.resources_id or self._latest_resources_id,
            group_id=spec.group_id,
            status=RolloutStatus.QUEUING,
            config=spec.config,
            metadata=spec.metadata,
            create_time=now,
        )
        rs = RolloutState(rollout=rollout, fingerprint=fingerprint, create_seq=next(self._create_seq))
        rs.bytes = self._estimate_rollout_bytes(rs)
        self._memory_bytes += rs.bytes
        self._rollouts[rollout.rollout_id] = rs
        tx.rollouts[rollout.rollout_id] = rs
        return rs

    def _existing_for_spec(self, spec: RolloutSpec, fingerprint: str, field: str) -> RolloutState | None:
        if not spec.rollout_id:
            return None
        rs = self._rollouts.get(spec.rollout_id)
        if rs is None:
            return None
        if rs.fingerprint != fingerprint:
            raise AlreadyExistsError(
                f"rollout {spec.rollout_id} already exists with other contents ({field})",
                reason="ROLLOUT_ALREADY_EXISTS",
                rolloutId=spec.rollout_id,
            )
        return rs

    async def start_rollout(self, spec: RolloutSpec, worker_id: str = "") -> Rollout:
        """Create a rollout already claimed by the caller, with its first attempt."""
        self._check_writable()
        self._check_worker_id(worker_id)
        spec, fingerprint = self._prepare_spec(spec, "rollout")
        existing = self._existing_for_spec(spec, fingerprint, "rollout")
        if existing is not None:
            await self._durable()
            return self._snapshot(existing)
        now = self.clock()
        tx = Txn()
        self._ensure_memory(0)
        rs = self._create_rollout(spec, fingerprint, now, tx)
        self._begin_attempt(rs, worker_id, now, tx)
        await self._apply(tx)
        return self._snapshot(rs)

    async def enqueue_rollouts(self, specs: list[RolloutSpec]) -> list[Rollout]:
        """Queue rollouts in order. A known rollout id returns the stored rollout (same contents) or fails."""
        self._check_writable()
        if not specs:
            raise InvalidArgumentError("rollouts", "must hold at least one rollout")
        if len(specs) > MAX_BATCH_ROLLOUTS:
            raise InvalidArgumentError("rollouts", f"must hold at most {MAX_BATCH_ROLLOUTS} rollouts")
        prepared = [self._prepare_spec(spec, f"rollouts[{i}]") for i, spec in enumerate(specs)]
        seen: dict[str, str] = {}
        plan: list[tuple[RolloutSpec, str, RolloutState | None]] = []
        for i, (spec, fingerprint) in enumerate(prepared):
            existing = self._existing_for_spec(spec, fingerprint, f"rollouts[{i}]")
            if spec.rollout_id:
                if spec.rollout_id in seen and seen[spec.rollout_id] != fingerprint:
                    raise InvalidArgumentError(
                        f"rollouts[{i}].rollout_id",
                        f"{spec.rollout_id} appears twice with different contents",
                    )
                seen[spec.rollout_id] = fingerprint
            plan.append((spec, fingerprint, existing))
        self._ensure_memory(0)
        now = self.clock()
        tx = Txn()
        out: list[RolloutState] = []
        for spec, fingerprint, existing in plan:
            if existing is None and spec.rollout_id:
                existing = self._rollouts.get(spec.rollout_id)  # earlier in this batch
            if existing is not None:
                out.append(existing)
                continue
            rs = self._create_rollout(spec, fingerprint, now, tx)
            self._push_queue(rs, tx)
            self._record_change(rs, tx)
            out.append(rs)
        self._wake_dequeuers()
        await self._apply(tx)
        return [self._snapshot(rs) for rs in out]

    def _push_queue(self, rs: RolloutState, tx: Txn) -> None:
        rs.queue_seq = next(self._queue_seq)
        self._queue[rs.rollout.rollout_id] = None
        tx.rollouts[rs.rollout.rollout_id] = rs

    def _wake_dequeuers(self) -> None:
        waiters, self._dequeue_waiters = self._dequeue_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def dequeue_rollouts(
        self,
        worker_id: str = "",
        max_rollouts: int = 1,
        wait_timeout: float | None = None,
        request_id: str = "",
    ) -> list[Rollout]:
        """Claim up to ``max_rollouts`` queued rollouts (FIFO), each with a new attempt, in one commit."""
        self._check_writable()
        wait = self.check_dequeue(worker_id, max_rollouts, wait_timeout, request_id)
        if request_id:
            done = self._dequeue_requests.get(request_id)
            if done is not None:
                await self._durable()
                return [self._snapshot(self._rollouts[rid]) for rid in done if rid in self._rollouts]
        limit = max(1, max_rollouts)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            self._check_writable()
            if self._queue or self._closing:
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            fut: asyncio.Future[None] = loop.create_future()
            self._dequeue_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                pass
            finally:
                if fut in self._dequeue_waiters:
                    self._dequeue_waiters.remove(fut)
        now = self.clock()
        tx = Txn()
        claimed: list[RolloutState] = []
        while self._queue and len(claimed) < limit:
            rid = next(iter(self._queue))
            del self._queue[rid]
            rs = self._rollouts[rid]
            self._begin_attempt(rs, worker_id, now, tx, request_id=request_id)
            claimed.append(rs)
        if worker_id:
            ws = self._worker(worker_id)
            ws.worker.last_dequeue_time = now
            if not ws.active_attempts:
                ws.worker.status = (
                    WorkerStatus.IDLE if ws.worker.status != WorkerStatus.UNKNOWN else ws.worker.status
                )
            tx.workers[worker_id] = ws
        if request_id and claimed:
            self._dequeue_requests[request_id] = [rs.rollout.rollout_id for rs in claimed]
            if len(self._dequeue_requests) > 100_000:
                for key in list(itertools.islice(self._dequeue_requests, 10_000)):
                    del self._dequeue_requests[key]
        await self._apply(tx)
        return [self._snapshot(rs) for rs in claimed]

    def check_dequeue(
        self, worker_id: str, max_rollouts: int, wait_timeout: float | None, request_id: str = ""
    ) -> float:
        """Validate dequeue arguments; returns the wait in seconds."""
        self._check_worker_id(worker_id)
        self._check_limit(max_rollouts, "max_rollouts", MAX_BATCH_ROLLOUTS)
        if len(request_id) > 128:
            raise InvalidArgumentError("request_id", "must be at most 128 characters")
        return self._check_wait(wait_timeout, "wait_timeout")

    def _begin_attempt(
        self, rs: RolloutState, worker_id: str, now: float, tx: Txn, request_id: str = ""
    ) -> None:
        r = rs.rollout
        attempt = Attempt(
            rollout_id=r.rollout_id,
            attempt_id=new_id("at"),
            sequence_number=len(rs.attempts) + 1,
            status=AttemptStatus.PREPARING,
            worker_id=worker_id,
            start_time=now,
        )
        ast = AttemptState(attempt=attempt, request_id=request_id, span_ids={}, index_used_at=now)
        rs.attempts.append(ast)
        self._attempts[attempt.attempt_id] = ast
        r.status = RolloutStatus.PREPARING
        r.start_time = r.start_time or now
        r.attempt_count = attempt.sequence_number
        r.latest_attempt = attempt
        rs.bytes += ATTEMPT_OVERHEAD_BYTES
        self._memory_bytes += ATTEMPT_OVERHEAD_BYTES
        tx.rollouts[r.rollout_id] = rs
        tx.attempts[attempt.attempt_id] = ast
        if worker_id:
            ws = self._worker(worker_id)
            ws.active_attempts.add(attempt.attempt_id)
            w = ws.worker
            w.status = WorkerStatus.BUSY
            w.current_rollout_id, w.current_attempt_id = r.rollout_id, attempt.attempt_id
            w.last_dequeue_time = now
            tx.workers[worker_id] = ws
        self._schedule(ast)
        self._record_change(rs, tx)

    async def start_attempt(self, rollout_id: str, worker_id: str = "") -> Rollout:
        """Start a new attempt of a queued or requeuing rollout by hand (ignores max_attempts)."""
        self._check_writable()
        self._check_worker_id(worker_id)
        rs = self._rollout(rollout_id)
        r = rs.rollout
        if r.status.is_terminal:
            raise FailedPreconditionError(
                f"rollout {rollout_id} already finished as {r.status}; a finished rollout stays finished",
                reason="ROLLOUT_FINISHED",
                rolloutId=rollout_id,
                status=str(r.status),
            )
        latest = rs.latest
        if latest is not None and latest.attempt.status.is_active:
            raise FailedPreconditionError(
                f"rollout {rollout_id} has an active attempt {latest.attempt.attempt_id}; it must end first",
                reason="ATTEMPT_STILL_ACTIVE",
                rolloutId=rollout_id,
                attemptId=latest.attempt.attempt_id,
            )
        now = self.clock()
        tx = Txn()
        self._queue.pop(rollout_id, None)
        self._begin_attempt(rs, worker_id, now, tx)
        await self._apply(tx)
        return self._snapshot(rs)

    #: The rollout fields :meth:`update_rollout` changes, in the order error messages list them.
    UPDATABLE = ("input", "mode", "resources_id", "group_id", "config", "metadata")

    async def update_rollout(self, rollout_id: str, changes: dict[str, Any]) -> Rollout:
        """Change some of input, mode, resources_id, group_id, config, metadata (never the status)."""
        self._check_writable()
        rs = self._rollout(rollout_id)
        unknown = sorted(set(changes) - set(self.UPDATABLE))
        if unknown:
            raise InvalidArgumentError(
                "changes", f"cannot update {', '.join(unknown)}; updatable: {', '.join(self.UPDATABLE)}"
            )
        values = dict(changes)
        if "input" in values:
            check_json(values["input"], "input")
        if "mode" in values:
            values["mode"] = self._check_mode(values["mode"], "mode")
        if "config" in values:
            values["config"] = self._check_config(values["config"], "config")
        if "metadata" in values:
            values["metadata"] = self._check_metadata(values["metadata"], "metadata")
        if values.get("resources_id"):
            self._resources_state(values["resources_id"])
        if "group_id" in values and len(values["group_id"]) > 256:
            raise InvalidArgumentError("group_id", "must be at most 256 characters")
        tx = Txn()
        for name, value in values.items():
            setattr(rs.rollout, name, value)
        if "config" in values and rs.latest is not None and rs.latest.attempt.status.is_active:
            self._schedule(rs.latest)
        tx.rollouts[rollout_id] = rs
        self._record_change(rs, tx)
        await self._apply(tx)
        return self._snapshot(rs)

    async def cancel_rollout(self, rollout_id: str, reason: str = "") -> Rollout:
        """Cancel: out of the queue, active attempt CANCELLED. Idempotent on a cancelled rollout."""
        self._check_writable()
        rs = self._rollout(rollout_id)
        r = rs.rollout
        if r.status == RolloutStatus.CANCELLED:
            await self._durable()
            return self._snapshot(rs)
        if r.status.is_terminal:
            raise FailedPreconditionError(
                f"rollout {rollout_id} already finished as {r.status}; it cannot be cancelled",
                reason="ROLLOUT_FINISHED",
                rolloutId=rollout_id,
                status=str(r.status),
            )
        now = self.clock()
        tx = Txn()
        message = reason or "cancelled"
        self._queue.pop(rollout_id, None)
        latest = rs.latest
        if latest is not None and latest.attempt.status.is_active:
            self._end_attempt(latest, AttemptStatus.CANCELLED, message, now, tx)
        self._finish_rollout(rs, RolloutStatus.CANCELLED, message, now, tx)
        await self._apply(tx)
        log.info("event=rollout_cancelled rollout_id=%s", rollout_id)
        return self._snapshot(rs)

    async def get_rollout(self, rollout_id: str) -> Rollout:
        rs = self._rollout(rollout_id)
        await self._durable()
        return self._snapshot(rs)

    _ORDER_KEYS: ClassVar[dict[str, Callable[[Rollout], Any]]] = {
        "create_time": lambda r: r.create_time,
        "start_time": lambda r: math.inf if r.start_time is None else r.start_time,
        "end_time": lambda r: math.inf if r.end_time is None else r.end_time,
        "rollout_id": lambda r: r.rollout_id,
        "status": lambda r: int(r.status),
    }

    async def list_rollouts(
        self,
        *,
        statuses: Iterable[int] = (),
        rollout_ids: Iterable[str] = (),
        rollout_id_contains: str = "",
        mode: int = 0,
        group_id: str = "",
        order_by: str = "",
        descending: bool = False,
        page_size: int = 0,
        page_token: str = "",
    ) -> Page:
        status_set = set()
        for i, s in enumerate(statuses):
            try:
                status_set.add(RolloutStatus(s))
            except ValueError:
                raise InvalidArgumentError(f"statuses[{i}]", f"is not a rollout status (got {s})") from None
        id_set = set(rollout_ids)
        order = order_by or "create_time"
        key = self._ORDER_KEYS.get(order)
        if key is None:
            raise InvalidArgumentError(
                "order_by", f"must be one of {', '.join(self._ORDER_KEYS)} (got {order!r})"
            )
        mode_filter = self._check_mode(mode, "mode")
        size = paging.page_size(page_size)
        filters = paging.filter_hash(
            sorted(status_set),
            sorted(id_set),
            rollout_id_contains,
            int(mode_filter),
            group_id,
            order,
            descending,
        )
        after = paging.read_token(page_token, filters)
        source: Iterable[RolloutState] = (
            (self._rollouts[i] for i in rollout_ids if i in self._rollouts)
            if id_set
            else self._rollouts.values()
        )
        matches = [
            rs
            for rs in source
            if (not status_set or rs.rollout.status in status_set)
            and (not rollout_id_contains or rollout_id_contains in rs.rollout.rollout_id)
            and (not mode_filter or rs.rollout.mode == mode_filter)
            and (not group_id or rs.rollout.group_id == group_id)
        ]
        if id_set:
            matches = list({rs.rollout.rollout_id: rs for rs in matches}.values())

        def cursor(rs: RolloutState) -> tuple[Any, ...]:
            return (key(rs.rollout), rs.create_seq)

        matches.sort(key=cursor, reverse=descending)
        page, nxt = paging.keyset_page(matches, cursor, size, after, descending)
        token = paging.make_token(nxt, filters) if nxt is not None else ""
        await self._durable()
        return Page(
            items=[copy_rollout(rs.rollout) for rs in page], next_page_token=token, total_size=len(matches)
        )

    # ================================================================== attempts
    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        rs = self._rollout(rollout_id)
        await self._durable()
        return replace(rs.latest.attempt) if rs.latest else None

    async def list_attempts(
        self, rollout_id: str, *, descending: bool = False, page_size: int = 0, page_token: str = ""
    ) -> Page:
        rs = self._rollout(rollout_id)
        size = paging.page_size(page_size)
        filters = paging.filter_hash(rollout_id, descending)
        attempts = [a.attempt for a in rs.attempts]
        if descending:
            attempts.reverse()
        page, nxt = paging.keyset_page(
            attempts, lambda a: (a.sequence_number,), size, paging.read_token(page_token, filters), descending
        )
        await self._durable()
        return Page(
            items=[replace(a) for a in page],
            next_page_token=paging.make_token(nxt, filters) if nxt is not None else "",
            total_size=len(attempts),
        )

    def _touch(self, rs: RolloutState, ast: AttemptState, now: float, tx: Txn) -> None:
        """A sign of life from an attempt (span or heartbeat)."""
        a = ast.attempt
        if not a.status.is_active:
            return
        a.last_heartbeat_time = now
        tx.attempts[a.attempt_id] = ast
        if a.status == AttemptStatus.PREPARING:
            a.status = AttemptStatus.RUNNING
            if rs.rollout.status == RolloutStatus.PREPARING and rs.latest is ast:
                rs.rollout.status = RolloutStatus.RUNNING
                tx.rollouts[a.rollout_id] = rs
            self._record_change(rs, tx)

    async def heartbeat_attempt(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        """Keep an attempt alive; tell the runner whether to go on."""
        self._check_writable()
        rs, ast = self._attempt(rollout_id, attempt_id)
        tx = Txn()
        self._touch(rs, ast, self.clock(), tx)
        await self._apply(tx)
        a = ast.attempt
        cancelled = rs.rollout.status == RolloutStatus.CANCELLED
        return AttemptHeartbeat(
            attempt=replace(a),
            rollout_status=rs.rollout.status,
            cancelled=cancelled,
            should_stop=cancelled or not a.status.is_active or rs.latest is not ast,
        )

    async def complete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: int,
        message: str = "",
        metadata: dict[str, Any] | None = None,
        spans: list[SpanRecord] | None = None,
    ) -> tuple[Attempt, Rollout]:
        """Report SUCCEEDED or FAILED for an attempt; only an active (hence latest) attempt can change.

        ``spans`` of the attempt are stored in the same commit as the outcome.
        """
        self._check_writable()
        rs, ast = self._attempt(rollout_id, attempt_id)
        try:
            outcome = AttemptStatus(status)
        except ValueError:
            outcome = AttemptStatus.UNSPECIFIED
        if outcome not in (AttemptStatus.SUCCEEDED, AttemptStatus.FAILED):
            raise InvalidArgumentError("status", f"must be SUCCEEDED or FAILED (got {status})")
        extra = self._check_metadata(metadata, "metadata")
        a = ast.attempt
        if not a.status.is_active:
            if a.status == outcome:  # a retried report of the same outcome
                await self._durable()
                return replace(a), self._snapshot(rs)
            raise FailedPreconditionError(
                f"attempt {attempt_id} of rollout {rollout_id} already ended as {a.status}; "
                f"its report of {outcome} is refused",
                reason="ATTEMPT_ALREADY_ENDED",
                rolloutId=rollout_id,
                attemptId=attempt_id,
                status=str(a.status),
            )
        now = self.clock()
        tx = Txn()
        if spans:
            for record in spans:
                if (record.rollout_id or rollout_id, record.attempt_id or attempt_id) != (
                    rollout_id,
                    attempt_id,
                ):
                    raise InvalidArgumentError(
                        "spans", f"must belong to attempt {attempt_id} of rollout {rollout_id}"
                    )
            self._stage_spans(spans, rollout_id, attempt_id, tx)
        if extra:
            a.metadata = {**a.metadata, **extra}
        self._end_attempt(ast, outcome, message, now, tx)
        self._propagate(rs, ast, now, tx)
        await self._apply(tx)
        return replace(a), self._snapshot(rs)

    async def complete_and_dequeue(
        self,
        rollout_id: str,
        attempt_id: str,
        status: int,
        message: str = "",
        metadata: dict[str, Any] | None = None,
        spans: list[SpanRecord] | None = None,
        *,
        dequeue_next: DequeueRequest,
        bound_wait: Callable[[float], float] | None = None,
    ) -> tuple[Attempt, Rollout, list[Rollout]]:
        """:meth:`complete_attempt`, then :meth:`dequeue_rollouts` as ``dequeue_next`` says.

        A bad dequeue is refused before anything is stored. ``bound_wait`` may shorten the dequeue's wait
        (in seconds) when it begins, for example to answer before the caller's deadline.
        """
        nxt = dequeue_next
        self.check_dequeue(nxt.worker_id, nxt.max_rollouts, nxt.wait_timeout, nxt.request_id)
        attempt, rollout = await self.complete_attempt(
            rollout_id, attempt_id, status, message, metadata, spans
        )
        wait = self._check_wait(nxt.wait_timeout, "wait_timeout")
        if bound_wait is not None:
            wait = bound_wait(wait)
        claimed = await self.dequeue_rollouts(nxt.worker_id, nxt.max_rollouts, wait, nxt.request_id)
        return attempt, rollout, claimed

    def _end_attempt(
        self, ast: AttemptState, status: AttemptStatus, message: str, now: float, tx: Txn
    ) -> None:
        a = ast.attempt
        a.status = status
        a.end_time = now
        a.status_message = message
        tx.attempts[a.attempt_id] = ast
        if a.worker_id:
            ws = self._worker(a.worker_id)
            ws.active_attempts.discard(a.attempt_id)
            w = ws.worker
            if not ws.active_attempts:
                normal = status in (AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.CANCELLED)
                w.status = WorkerStatus.IDLE if normal else WorkerStatus.UNKNOWN
                w.current_rollout_id = w.current_attempt_id = ""
            elif w.current_attempt_id == a.attempt_id:
                other = self._attempts[next(iter(ws.active_attempts))].attempt
                w.current_rollout_id, w.current_attempt_id = other.rollout_id, other.attempt_id
            tx.workers[a.worker_id] = ws
        rs = self._rollouts[a.rollout_id]
        tx.rollouts[a.rollout_id] = rs
        self._record_change(rs, tx)

    def _propagate(self, rs: RolloutState, ast: AttemptState, now: float, tx: Txn) -> None:
        """Move the rollout after its latest attempt ended (terminal rollouts never move)."""
        r = rs.rollout
        a = ast.attempt
        if r.status.is_terminal or rs.latest is not ast:
            return
        if a.status == AttemptStatus.SUCCEEDED:
            self._finish_rollout(rs, RolloutStatus.SUCCEEDED, "", now, tx)
        elif a.status in RETRYABLE_ATTEMPT_STATUSES:
            if a.status in r.config.retry_on and a.sequence_number < r.config.max_attempts:
                r.status = RolloutStatus.REQUEUING
                self._push_queue(rs, tx)
                self._record_change(rs, tx)
                self._wake_dequeuers()
            else:
                self._finish_rollout(rs, RolloutStatus.FAILED, a.status_message or str(a.status), now, tx)

    def _finish_rollout(
        self, rs: RolloutState, status: RolloutStatus, message: str, now: float, tx: Txn
    ) -> None:
        r = rs.rollout
        r.status = status
        r.end_time = now
        r.status_message = message
        tx.rollouts[r.rollout_id] = rs
        tx.finished.append(r.rollout_id)
        self._record_change(rs, tx)

    def _record_change(self, rs: RolloutState, tx: Txn) -> None:
        """Append the rollout as it is now to the change log (one entry per rollout per operation)."""
        rid = rs.rollout.rollout_id
        if (
            tx.changes
            and tx.changes[-1].rollout.rollout_id == rid
            and tx.changes[-1].revision == self._revision
        ):
            tx.changes[-1].rollout = copy_rollout(rs.rollout)
            self._changes[-1] = tx.changes[-1]
            return
        self._revision += 1
        change = Change(self._revision, copy_rollout(rs.rollout))
        self._changes.append(change)
        tx.changes.append(change)

    # ================================================================== watchdog
    def _deadline(self, ast: AttemptState) -> float | None:
        a = ast.attempt
        config = self._rollouts[a.rollout_id].rollout.config
        deadlines = []
        if config.timeout:
            deadlines.append(a.start_time + config.timeout)
        if config.unresponsive_timeout:
            deadlines.append((a.last_heartbeat_time or a.start_time) + config.unresponsive_timeout)
        return min(deadlines) if deadlines else None

    def _schedule(self, ast: AttemptState) -> None:
        deadline = self._deadline(ast)
        if deadline is None:
            return
        earliest = self._deadlines[0][0] if self._deadlines else math.inf
        heapq.heappush(self._deadlines, (deadline, next(self._deadline_tiebreak), ast.attempt.attempt_id))
        if deadline < earliest and self._watchdog_wake is not None:
            self._watchdog_wake.set()

    def _expire(self, now: float) -> Txn:
        tx = Txn()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, attempt_id = heapq.heappop(self._deadlines)
            ast = self._attempts.get(attempt_id)
            if ast is None or not ast.attempt.status.is_active:
                continue
            deadline = self._deadline(ast)
            if deadline is None:
                continue
            if deadline > now:  # a heartbeat moved it
                heapq.heappush(self._deadlines, (deadline, next(self._deadline_tiebreak), attempt_id))
                continue
            a = ast.attempt
            rs = self._rollouts[a.rollout_id]
            config = rs.rollout.config
            if config.timeout and now >= a.start_time + config.timeout:
                status, message = (
                    AttemptStatus.TIMEOUT,
                    f"attempt ran longer than its timeout of {config.timeout:g} s",
                )
            else:
                status = AttemptStatus.UNRESPONSIVE
                message = f"no span or heartbeat for {config.unresponsive_timeout:g} s"
            self._end_attempt(ast, status, message, now, tx)
            self._propagate(rs, ast, now, tx)
            log.info(
                "event=attempt_expired rollout_id=%s attempt_id=%s status=%s rollout_status=%s",
                a.rollout_id,
                attempt_id,
                status,
                rs.rollout.status,
            )
        return tx

    async def _watchdog(self) -> None:
        assert self._watchdog_wake is not None
        while True:
            tx = self._expire(self.clock())
            if not tx.is_empty():
                try:
                    await self._apply(tx)
                except Exception as exc:
                    log.error("event=watchdog_commit_failed error=%r", exc)
            self._watchdog_wake.clear()
            timeout = max(0.0, self._deadlines[0][0] - self.clock()) if self._deadlines else None
            try:
                await asyncio.wait_for(self._watchdog_wake.wait(), timeout)
            except TimeoutError:
                pass

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._durable()
            except Exception:
                continue
            self._trim_span_indexes()
            if len(self._changes) > self.change_retention * 1.1:
                del self._changes[: len(self._changes) - self.change_retention]

    # ================================================================== spans
    def _span_index(self, rs: RolloutState, ast: AttemptState) -> dict[str, int]:
        ids = ast.span_ids
        if ids is None:
            ids = ast.span_ids = self.backend.load_span_ids(
                rs.rollout.rollout_id, ast.attempt.sequence_number
            )
            self._indexed_spans += len(ids)
        return ids

    def _trim_span_indexes(self) -> None:
        """Drop span-id indexes of ended attempts, least recently used first, above the capacity.

        Runs only right after everything submitted is durable, so a dropped index reloads complete.
        """
        if self._indexed_spans <= self.span_index_capacity:
            return
        loaded = sorted(
            (a for a in self._attempts.values() if a.span_ids and not a.attempt.status.is_active),
            key=lambda a: a.index_used_at,
        )
        for ast in loaded:
            if self._indexed_spans <= self.span_index_capacity * 0.8:
                break
            self._indexed_spans -= len(ast.span_ids or ())
            ast.span_ids = None
            ast.used_sequence_ids = None

    async def add_spans(
        self, records: list[SpanRecord], rollout_id: str = "", attempt_id: str = ""
    ) -> AddSpansResult:
        """Store spans; a span id already stored in its attempt is skipped (so batches can be resent)."""
        self._check_writable()
        tx = Txn()
        result = self._stage_spans(records, rollout_id, attempt_id, tx)
        await self._apply(tx)
        return result

    def _stage_spans(
        self, records: list[SpanRecord], rollout_id: str, attempt_id: str, tx: Txn
    ) -> AddSpansResult:
        """Validate spans (refusing the whole batch on any fault), then add them to ``tx``."""
        if len(records) > MAX_BATCH_SPANS:
            raise InvalidArgumentError(
                "spans", f"must hold at most {MAX_BATCH_SPANS} spans (got {len(records)})"
            )
        now = self.clock()
        # Pass 1: resolve and validate everything; no state changes, so a refusal leaves nothing behind.
        targets: list[tuple[RolloutState, AttemptState]] = []
        cache_key: tuple[str, str] = ("", "")
        cache_val: tuple[RolloutState, AttemptState] | None = None
        batch_bytes = 0
        hex16, hex32 = _HEX16.fullmatch, _HEX32.fullmatch
        for i, rec in enumerate(records):
            rid = rec.rollout_id = rec.rollout_id or rollout_id
            aid = rec.attempt_id = rec.attempt_id or attempt_id
            if (rid, aid) != cache_key or cache_val is None:
                if not rid:
                    raise InvalidArgumentError(
                        f"spans[{i}].rollout_id", "is required (on the span or the request)"
                    )
                if not aid:
                    raise InvalidArgumentError(
                        f"spans[{i}].attempt_id", "is required (on the span or the request)"
                    )
                cache_val = self._attempt(rid, aid)
                cache_key = (rid, aid)
            targets.append(cache_val)
            if not hex16(rec.span_id):
                raise InvalidArgumentError(f"spans[{i}].span_id", "must be 16 lowercase hex characters")
            if not hex32(rec.trace_id):
                raise InvalidArgumentError(f"spans[{i}].trace_id", "must be 32 lowercase hex characters")
            if rec.parent_span_id and not hex16(rec.parent_span_id):
                raise InvalidArgumentError(
                    f"spans[{i}].parent_span_id", "must be empty or 16 lowercase hex characters"
                )
            if rec.sequence_id < 0 or rec.sequence_id > MAX_SEQUENCE_ID:
                raise InvalidArgumentError(
                    f"spans[{i}].sequence_id", f"must be between 0 and {MAX_SEQUENCE_ID}"
                )
            size = len(rec.body)
            if size > self.max_span_bytes:
                raise ResourceExhaustedError(
                    f"spans[{i}] is {size} bytes; the limit is {self.max_span_bytes}",
                    reason="SPAN_TOO_LARGE",
                    field=f"spans[{i}]",
                )
            batch_bytes += size + SPAN_OVERHEAD_BYTES
        # Client-numbered spans: their ids must be unused in the attempt.
        claimed: dict[str, set[int]] = {}
        batch_ids: dict[str, set[str]] = {}
        for i, rec in enumerate(records):
            if rec.sequence_id:
                rs, ast = targets[i]
                ids = self._span_index(rs, ast)
                if rec.span_id in ids or rec.span_id in batch_ids.get(rec.attempt_id, ()):
                    continue
                if ast.used_sequence_ids is None:
                    ast.used_sequence_ids = set(ids.values())
                mine = claimed.setdefault(rec.attempt_id, set())
                if rec.sequence_id in ast.used_sequence_ids or rec.sequence_id in mine:
                    raise InvalidArgumentError(
                        f"spans[{i}].sequence_id",
                        f"{rec.sequence_id} is already used in attempt {rec.attempt_id}",
                    )
                mine.add(rec.sequence_id)
                batch_ids.setdefault(rec.attempt_id, set()).add(rec.span_id)
        self._ensure_memory(batch_bytes)
        # Client-numbered spans claim their ids first, so automatic numbers go above them.
        for i, rec in enumerate(records):
            if rec.sequence_id:
                ast = targets[i][1]
                if rec.sequence_id >= ast.next_sequence_id:
                    ast.next_sequence_id = rec.sequence_id + 1
        # Pass 2: assign sequence ids and store.
        sequence_ids = [0] * len(records)
        stored = duplicates = 0
        stored_bytes = 0
        for i, rec in enumerate(records):
            rs, ast = targets[i]
            ids = ast.span_ids if ast.span_ids is not None else self._span_index(rs, ast)
            seq = ids.get(rec.span_id)
            if seq is not None:
                sequence_ids[i] = seq
                duplicates += 1
                continue
            if rec.sequence_id:  # its number was claimed above
                seq = rec.sequence_id
            else:
                seq = ast.next_sequence_id
                ast.next_sequence_id = seq + 1
            if ast.used_sequence_ids is not None:
                ast.used_sequence_ids.add(seq)
            ids[rec.span_id] = seq
            rec.sequence_id = seq
            rec.attempt_no = ast.attempt.sequence_number
            sequence_ids[i] = seq
            tx.spans.append(rec)
            ast.span_count += 1
            stored += 1
            size = len(rec.body) + SPAN_OVERHEAD_BYTES
            rs.bytes += size
            stored_bytes += size
        for rs, ast in {t[1].attempt.attempt_id: t for t in targets}.values():
            ast.index_used_at = now
            self._touch(rs, ast, now, tx)
            tx.attempts[ast.attempt.attempt_id] = ast
            tx.span_rollouts.add(rs.rollout.rollout_id)
        self._indexed_spans += stored
        self._total_spans += stored
        self._memory_bytes += stored_bytes
        return AddSpansResult(sequence_ids=sequence_ids, stored_count=stored, duplicate_count=duplicates)

    async def next_span_sequence_id(self, rollout_id: str, attempt_id: str, count: int = 1) -> int:
        """Reserve ``count`` sequence ids of an attempt; returns the first."""
        self._check_writable()
        _, ast = self._attempt(rollout_id, attempt_id)
        self._check_limit(count, "count", MAX_SPAN_SEQUENCE_RESERVATION)
        first = ast.next_sequence_id
        if first + max(1, count) > MAX_SEQUENCE_ID:
            raise ResourceExhaustedError(
                f"attempt {attempt_id} has used up its sequence ids", reason="SEQUENCE_IDS_EXHAUSTED"
            )
        ast.next_sequence_id += max(1, count)
        tx = Txn()
        tx.attempts[attempt_id] = ast
        await self._apply(tx)
        return first

    def _span_query(self, sel: SpanSelection) -> SpanQuery | None:
        rs = self._rollout(sel.rollout_id, "selector.rollout_id")
        attempt_no = 0
        if sel.attempt_id == LATEST:
            if rs.latest is None:
                return None
            attempt_no = rs.latest.attempt.sequence_number
        elif sel.attempt_id:
            _, ast = self._attempt(sel.rollout_id, sel.attempt_id)
            attempt_no = ast.attempt.sequence_number
        return SpanQuery(
            rollout_id=sel.rollout_id,
            attempt_no=attempt_no,
            trace_id=sel.trace_id,
            span_id=sel.span_id,
            parent_span_id=sel.parent_span_id,
            name=sel.name,
            name_contains=sel.name_contains,
        )

    async def list_spans(self, sel: SpanSelection, page_size: int = 0, page_token: str = "") -> Page:
        """Spans of a rollout ordered by attempt then sequence id; keyset page tokens."""
        query = self._span_query(sel)
        size = paging.page_size(page_size, default=1000, maximum=10_000)
        filters = paging.filter_hash(asdict(sel)) if page_token else ""
        position = paging.read_token(page_token, filters)
        await self._durable()
        if query is None:
            return Page(items=[])
        if position is not None:
            if not (
                isinstance(position, list)
                and len(position) == 2
                and all(isinstance(p, int) and 0 <= p <= MAX_SEQUENCE_ID for p in position)
            ):
                raise InvalidArgumentError("page_token", "is not a page token this store issued")
            query.after = (position[0], position[1])
        query.limit = size + 1
        found = await self.backend.query_spans(query)
        more = len(found) > size
        found = found[:size]
        token = ""
        if more:  # the filters' hash is only worth computing when a next page exists
            token = paging.make_token(
                [found[-1].attempt_no, found[-1].sequence_id], filters or paging.filter_hash(asdict(sel))
            )
        return Page(items=found, next_page_token=token)

    async def tail_spans(
        self, sel: SpanSelection, follow: bool = False, batch_size: int = 1000
    ) -> AsyncIterator[list[SpanRecord]]:
        """Yield the spans of a rollout in batches; with ``follow``, keep yielding new ones until the rollout
        has ended (succeeded, failed for good or cancelled) and every span stored by then was yielded."""
        query = self._span_query(sel)
        if query is None and not follow:
            return
        after = (0, 0)
        while True:
            await self._durable()
            status = self.rollout_status(sel.rollout_id)
            ended = status is not None and status.is_terminal  # spans stored before this are read below
            if query is None:
                query = self._span_query(sel)
            if query is not None:
                query.after, query.limit = after, batch_size
                found = await self.backend.query_spans(query)
                if found:
                    after = (found[-1].attempt_no, found[-1].sequence_id)
                    yield found
                    if len(found) == batch_size:
                        continue
            if not follow or self._closing or ended:
                return
            fut = self._span_waiters.get(sel.rollout_id)
            if fut is None or fut.done():
                fut = self._span_waiters[sel.rollout_id] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(fut), 1.0)
            except TimeoutError:
                pass
            if sel.rollout_id not in self._rollouts:
                return

    # ================================================================== resources
    def _check_resources(self, resources: dict[str, Resource], field: str = "resources") -> None:
        if len(resources) > 1000:
            raise InvalidArgumentError(field, "must hold at most 1000 entries")
        for name, resource in resources.items():
            if not name or len(name) > 256:
                raise InvalidArgumentError(f"{field}[{name[:40]!r}]", "names must be 1-256 characters")
            check_json(rows.resource_to_dict(resource), f"{field}[{name!r}]")

    async def add_resources(self, resources: dict[str, Resource], resources_id: str = "") -> ResourcesUpdate:
        self._check_writable()
        self._check_resources(resources)
        if resources_id:
            self._check_id(resources_id, "resources_id")
        fingerprint = hashlib.sha256(rows.resources_body(resources).encode()).hexdigest()
        existing = self._resources.get(resources_id) if resources_id else None
        if existing is not None:
            if existing.fingerprint != fingerprint or existing.resources.version != 1:
                raise AlreadyExistsError(
                    f"resources {resources_id} already exist with other contents",
                    reason="RESOURCES_ALREADY_EXIST",
                    resourcesId=resources_id,
                )
            await self._durable()
            return replace(existing.resources)
        now = self.clock()
        update = ResourcesUpdate(
            resources_id=resources_id or new_id("rs"),
            version=1,
            resources=dict(resources),
            create_time=now,
            update_time=now,
        )
        state = ResourcesState(update, fingerprint)
        self._resources[update.resources_id] = state
        self._latest_resources_id = update.resources_id
        tx = Txn(resources={update.resources_id: state}, meta={"latest_resources_id": update.resources_id})
        await self._apply(tx)
        return replace(update)

    async def update_resources(
        self, resources_id: str, resources: dict[str, Resource], expected_version: int = 0
    ) -> ResourcesUpdate:
        self._check_writable()
        state = self._resources_state(resources_id)
        self._check_resources(resources)
        if expected_version < 0:
            raise InvalidArgumentError("expected_version", "must not be negative")
        current = state.resources
        if expected_version and expected_version != current.version:
            raise AbortedError(
                f"resources {resources_id} are at version {current.version}, not {expected_version}",
                reason="RESOURCES_VERSION_MISMATCH",
                resourcesId=resources_id,
                version=str(current.version),
            )
        update = replace(
            current, resources=dict(resources), version=current.version + 1, update_time=self.clock()
        )
        state.resources = update
        state.fingerprint = hashlib.sha256(rows.resources_body(resources).encode()).hexdigest()
        self._latest_resources_id = resources_id
        tx = Txn(resources={resources_id: state}, meta={"latest_resources_id": resources_id})
        await self._apply(tx)
        return replace(update)

    async def get_resources(self, resources_id: str) -> ResourcesUpdate:
        state = self._resources_state(resources_id)
        await self._durable()
        return replace(state.resources)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        state = self._resources.get(self._latest_resources_id)
        await self._durable()
        return replace(state.resources) if state else None

    async def list_resources(
        self,
        *,
        resources_id_contains: str = "",
        descending: bool = False,
        page_size: int = 0,
        page_token: str = "",
    ) -> Page:
        size = paging.page_size(page_size)
        filters = paging.filter_hash(resources_id_contains, descending)

        def cursor(r: ResourcesUpdate) -> tuple[Any, ...]:
            return (r.update_time, r.resources_id)

        matches = sorted(
            (
                s.resources
                for s in self._resources.values()
                if resources_id_contains in s.resources.resources_id
            ),
            key=cursor,
            reverse=descending,
        )
        page, nxt = paging.keyset_page(
            matches, cursor, size, paging.read_token(page_token, filters), descending
        )
        await self._durable()
        return Page(
            items=[replace(r) for r in page],
            next_page_token=paging.make_token(nxt, filters) if nxt is not None else "",
            total_size=len(matches),
        )

    # ================================================================== workers
    async def heartbeat_worker(self, worker_id: str, stats: dict[str, Any] | None = None) -> Worker:
        self._check_writable()
        if not worker_id:
            raise InvalidArgumentError("worker_id", "is required")
        self._check_id(worker_id, "worker_id")
        if stats is not None:
            stats = self._check_metadata(stats, "heartbeat_stats")
        ws = self._worker(worker_id)
        ws.worker.last_heartbeat_time = self.clock()
        if stats is not None:
            ws.worker.heartbeat_stats = stats
        await self._apply(Txn(workers={worker_id: ws}))
        return replace(ws.worker)

    async def get_worker(self, worker_id: str) -> Worker:
        if not worker_id:
            raise InvalidArgumentError("worker_id", "is required")
        ws = self._workers.get(worker_id)
        if ws is None:
            raise NotFoundError(
                f"worker {worker_id} not found", reason="WORKER_NOT_FOUND", workerId=worker_id
            )
        await self._durable()
        return replace(ws.worker)

    async def list_workers(
        self,
        *,
        statuses: Iterable[int] = (),
        worker_id_contains: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> Page:
        wanted = set()
        for i, s in enumerate(statuses):
            try:
                wanted.add(WorkerStatus(s))
            except ValueError:
                raise InvalidArgumentError(f"statuses[{i}]", f"is not a worker status (got {s})") from None
        size = paging.page_size(page_size)
        filters = paging.filter_hash(sorted(wanted), worker_id_contains)
        matches = sorted(
            (
                ws.worker
                for ws in self._workers.values()
                if (not wanted or ws.worker.status in wanted) and worker_id_contains in ws.worker.worker_id
            ),
            key=lambda w: w.worker_id,
        )
        page, nxt = paging.keyset_page(
            matches, lambda w: (w.worker_id,), size, paging.read_token(page_token, filters)
        )
        await self._durable()
        return Page(
            items=[replace(w) for w in page],
            next_page_token=paging.make_token(nxt, filters) if nxt is not None else "",
            total_size=len(matches),
        )

    # ================================================================== waiting
    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """Wait until all given rollouts are finished or ``timeout`` passes; return the finished ones."""
        if len(rollout_ids) > MAX_WAIT_IDS:
            raise InvalidArgumentError("rollout_ids", f"must hold at most {MAX_WAIT_IDS} ids")
        for i, rid in enumerate(rollout_ids):
            self._rollout(rid, f"rollout_ids[{i}]")
        wait = self._check_wait(timeout, "timeout")
        ids = list(dict.fromkeys(rollout_ids))
        await self._durable()
        pending = [rid for rid in ids if not self._rollouts[rid].rollout.status.is_terminal]
        if pending and wait > 0:
            waiter = _FinishWaiter(len(pending))
            for rid in pending:
                self._finish_waiters.setdefault(rid, []).append(waiter)
            try:
                await asyncio.wait_for(waiter.event.wait(), wait)
            except TimeoutError:
                pass
            finally:
                for rid in pending:
                    lst = self._finish_waiters.get(rid)
                    if lst is not None:
                        lst.remove(waiter)
                        if not lst:
                            del self._finish_waiters[rid]
            await self._durable()
        out = []
        for rid in ids:
            rs = self._rollouts.get(rid)
            if rs is not None and rs.rollout.status.is_terminal:
                out.append(self._snapshot(rs))
        return out

    def _token(self, revision: int) -> str:
        return f"{self.store_id}.{revision}"

    def _parse_token(self, token: str) -> int:
        store_id, _, rev = token.rpartition(".")
        if not store_id or not (rev.isascii() and rev.isdigit()) or len(rev) > 18:
            raise InvalidArgumentError("resume_token", "is not a resume token this store issued")
        if store_id != self.store_id:
            raise OutOfRangeError(
                "resume_token belongs to another store (or to an in-memory store that restarted)",
                reason="RESUME_TOKEN_EXPIRED",
            )
        revision = int(rev)
        first = self._changes[0].revision if self._changes else self._committed_revision + 1
        if revision > self._committed_revision or revision < first - 1:
            raise OutOfRangeError(
                f"resume_token revision {revision} is outside the retained history "
                f"({first - 1}..{self._committed_revision}); list the rollouts again and watch from now",
                reason="RESUME_TOKEN_EXPIRED",
                revision=str(revision),
            )
        return revision

    async def watch_rollouts(
        self,
        resume_token: str = "",
        rollout_ids: Iterable[str] = (),
        statuses: Iterable[int] = (),
        progress_interval: float | None = None,
    ) -> AsyncIterator[WatchEvent]:
        """Rollout changes after ``resume_token`` (or from now), with progress messages while idle."""
        interval = self._check_wait(progress_interval, "progress_interval") or 5.0
        ids = set(rollout_ids)
        status_set = set()
        for i, s in enumerate(statuses):
            try:
                status_set.add(RolloutStatus(s))
            except ValueError:
                raise InvalidArgumentError(f"statuses[{i}]", f"is not a rollout status (got {s})") from None
        await self._durable()
        cursor = self._parse_token(resume_token) if resume_token else self._committed_revision
        yield WatchEvent(None, self._token(cursor), cursor)
        loop = asyncio.get_running_loop()
        while True:
            first = self._changes[0].revision if self._changes else self._committed_revision + 1
            if cursor < first - 1:
                raise OutOfRangeError(
                    "this watcher fell behind the retained history; resume from a fresh list",
                    reason="RESUME_TOKEN_EXPIRED",
                    revision=str(cursor),
                )
            sent = False
            while cursor < self._committed_revision:
                # the log may have been trimmed while this generator was suspended at a yield
                first = self._changes[0].revision if self._changes else self._committed_revision + 1
                if cursor < first - 1:
                    raise OutOfRangeError(
                        "this watcher fell behind the retained history; resume from a fresh list",
                        reason="RESUME_TOKEN_EXPIRED",
                        revision=str(cursor),
                    )
                change = self._changes[cursor + 1 - first]
                cursor = change.revision
                r = change.rollout
                if (not ids or r.rollout_id in ids) and (not status_set or r.status in status_set):
                    sent = True
                    yield WatchEvent(copy_rollout(r), self._token(cursor), cursor)
            if self._closing:
                return
            if self._changes_committed is None or self._changes_committed.done():
                self._changes_committed = loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._changes_committed), interval)
            except TimeoutError:
                if not sent:
                    yield WatchEvent(None, self._token(cursor), cursor)

    # ================================================================== for cores built on the store
    async def durable(self) -> None:
        """Return once everything changed so far is committed."""
        await self._durable()

    def rollouts_where(self, predicate: Callable[[Rollout], bool]) -> list[Rollout]:
        """Snapshots of the rollouts ``predicate`` accepts (await :meth:`durable` first to read committed state)."""
        return [self._snapshot(rs) for rs in self._rollouts.values() if predicate(rs.rollout)]

    def rollout_snapshots(self, rollout_ids: Iterable[str], *, copy: bool = True) -> dict[str, Rollout]:
        """Snapshots of the given rollouts that exist, by id.

        ``copy=False`` hands out the store's own objects, read-only, for finished rollouts whose status
        and attempts can no longer change (metadata updates replace the mapping, never change it).
        """
        found = (self._rollouts.get(rid) for rid in rollout_ids)
        return {
            rs.rollout.rollout_id: self._snapshot(rs) if copy else rs.rollout
            for rs in found
            if rs is not None
        }

    def attempt_span_count(self, attempt_id: str) -> int:
        """How many spans an attempt has stored (0 for an unknown attempt)."""
        ast = self._attempts.get(attempt_id)
        return ast.span_count if ast is not None else 0

    def rollout_status(self, rollout_id: str) -> RolloutStatus | None:
        rs = self._rollouts.get(rollout_id)
        return rs.rollout.status if rs is not None else None

    async def merge_rollout_metadata(self, rollout_ids: Sequence[str], values: dict[str, Any]) -> None:
        """Set metadata keys on many rollouts (finished ones included) in one commit."""
        self._check_writable()
        check_json(values, "metadata")
        states = [self._rollout(rid, f"rollout_ids[{i}]") for i, rid in enumerate(rollout_ids)]
        tx = Txn()
        for rs in states:
            rs.rollout.metadata = {**rs.rollout.metadata, **values}
            tx.rollouts[rs.rollout.rollout_id] = rs
            self._record_change(rs, tx)
        await self._apply(tx)

    async def wait_for_commit(self, timeout: float) -> None:
        """Return after the next commit of rollout changes, or after ``timeout`` seconds."""
        if self._closing:
            return
        if self._changes_committed is None or self._changes_committed.done():
            self._changes_committed = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._changes_committed), timeout)
        except TimeoutError:
            pass

    @property
    def closing(self) -> bool:
        return self._closing

    def meta_items(self, prefix: str) -> dict[str, str]:
        """The store's key/value metadata whose keys start with ``prefix``."""
        return {k: v for k, v in self._meta.items() if k.startswith(prefix)}

    async def put_meta(self, items: dict[str, str]) -> None:
        """Keep key/value metadata durably (committed before this returns)."""
        self._check_writable()
        self._meta.update(items)
        await self._apply(Txn(meta=dict(items)))

    # ================================================================== statistics and housekeeping
    async def statistics(self) -> Statistics:
        by_status: dict[str, int] = {}
        for rs in self._rollouts.values():
            name = rs.rollout.status.name
            by_status[name] = by_status.get(name, 0) + 1
        await self._durable()
        return Statistics(
            rollouts_by_status=by_status,
            total_rollouts=len(self._rollouts),
            total_attempts=len(self._attempts),
            total_spans=self._total_spans,
            total_resources=len(self._resources),
            total_workers=len(self._workers),
            uptime=time.monotonic() - self._started_at,
            backend=self.backend.name,
            memory_bytes=self._memory_bytes if self.backend.in_memory else 0,
            queue_length=len(self._queue),
        )

    def _delete(self, ids: list[str], tx: Txn) -> DeleteResult:
        result = DeleteResult()
        for rid in ids:
            rs = self._rollouts.pop(rid)
            result.deleted_rollouts += 1
            for ast in rs.attempts:
                self._attempts.pop(ast.attempt.attempt_id, None)
                result.deleted_attempts += 1
                result.deleted_spans += ast.span_count
                self._indexed_spans -= len(ast.span_ids or ())
            self._total_spans -= sum(a.span_count for a in rs.attempts)
            self._memory_bytes -= rs.bytes
            self._finish_waiters.pop(rid, None)
            tx.deleted_rollouts.append(rid)
        return result

    async def delete_rollouts(
        self, rollout_ids: Sequence[str] = (), finished_before: float | None = None
    ) -> DeleteResult:  # type: ignore[assignment]
        """Delete finished rollouts (with attempts and spans) by id, or every one that ended before a time."""
        self._check_writable()
        if not rollout_ids and finished_before is None:
            raise InvalidArgumentError("rollout_ids", "give rollout ids or finished_before")
        ids = list(dict.fromkeys(rollout_ids))
        for i, rid in enumerate(ids):
            rs = self._rollout(rid, f"rollout_ids[{i}]")
            if not rs.rollout.status.is_terminal:
                raise FailedPreconditionError(
                    f"rollout {rid} is {rs.rollout.status}; only finished rollouts can be deleted",
                    reason="ROLLOUT_NOT_FINISHED",
                    rolloutId=rid,
                )
        if finished_before is not None:
            ids += [
                rid
                for rid, rs in self._rollouts.items()
                if rs.rollout.status.is_terminal
                and rs.rollout.end_time is not None
                and rs.rollout.end_time < finished_before
                and rid not in ids
            ]
        tx = Txn()
        result = self._delete(ids, tx)
        await self._apply(tx)
        if result.deleted_rollouts:
            log.info(
                "event=rollouts_deleted count=%d spans=%d", result.deleted_rollouts, result.deleted_spans
            )
        return result

    # ================================================================== memory bound (in-memory backend)
    @staticmethod
    def _estimate_rollout_bytes(rs: RolloutState) -> int:
        return ROLLOUT_OVERHEAD_BYTES + ATTEMPT_OVERHEAD_BYTES * len(rs.attempts)

    def _ensure_memory(self, incoming: int) -> None:
        """Make room for ``incoming`` bytes by evicting the oldest finished rollouts; never running ones."""
        limit = self.max_memory_bytes
        if limit is None or self._memory_bytes + incoming <= limit:
            return
        target = limit * 0.9 - incoming
        finished = sorted(
            (rs for rs in self._rollouts.values() if rs.rollout.status.is_terminal),
            key=lambda rs: (rs.rollout.end_time or 0.0, rs.rollout.create_time),
        )
        evict: list[str] = []
        freed = 0
        for rs in finished:
            if self._memory_bytes - freed <= target:
                break
            evict.append(rs.rollout.rollout_id)
            freed += rs.bytes
        if evict:
            tx = Txn()
            self._delete(evict, tx)
            self.backend.submit(tx)
            log.info("event=memory_evicted rollouts=%d bytes=%d", len(evict), freed)
        if self._memory_bytes + incoming > limit:
            raise ResourceExhaustedError(
                f"the in-memory store holds {self._memory_bytes} bytes of unfinished rollouts; "
                f"the limit is {limit}. Finish or delete rollouts, or raise --max-memory",
                reason="STORE_MEMORY_FULL",
            )


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def check_timeout(seconds: float, field: str) -> None:
    """A rollout timeout is a finite, positive number of seconds."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgumentError(field, f"must be a positive number of seconds (got {seconds:g} s)")


def check_json(value: Any, field: str, depth: int = 0) -> None:
    """JSON values must be finite and not absurdly deep (they are stored and echoed as JSON)."""
    if depth > 64:
        raise InvalidArgumentError(field, "is nested more than 64 levels deep")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(field, f"must hold finite numbers only (got {value})")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json(v, f"{field}.{k}" if len(field) < 200 else field, depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_json(v, f"{field}[{i}]" if len(field) < 200 else field, depth + 1)
