"""The :class:`Store`: composed of its sections, with its lifecycle."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from lightning_grpc import logs
from lightning_grpc.errors import LightningError
from lightning_grpc.types import Attempt, Rollout

from ..state import LoadedState, SpanRecord
from .attempts import AttemptsSection
from .base import DequeueRequest
from .housekeeping import HousekeepingSection
from .inprocess import InProcessSection
from .resources import ResourcesSection
from .rollouts import RolloutsSection
from .spans import SpansSection
from .validation import check_wait
from .waiting import WaitingSection
from .watchdog import WatchdogSection
from .workers import WorkersSection

log = logs.get_logger(__name__)


class Store(
    RolloutsSection,
    AttemptsSection,
    SpansSection,
    ResourcesSection,
    WorkersSection,
    WaitingSection,
    InProcessSection,
    HousekeepingSection,
    WatchdogSection,
):
    """The rollout queue, attempts, spans, resources and workers, over a pluggable backend."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> Store:
        """Load what the backend holds, schedule the deadlines of active attempts, start the timers."""
        self._load(await self.backend.open())
        self._watchdog_wake = asyncio.Event()
        self.backend.on_outage(self._on_backend_outage)
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

    def _load(self, loaded: LoadedState) -> None:
        self.store_id = loaded.store_id
        max_queue_seq = 0
        for rs in loaded.rollouts:
            self._hold(rs)
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
        try:
            await self._durable()
        except LightningError as exc:
            # out of space: what is held was never acknowledged, and the backend drops it
            log.warning("event=store_closed_with_writes_unstored reason=%s", exc.reason)
        await self.backend.close()
        log.info("event=store_closed backend=%s", self.backend.name)

    # ------------------------------------------------------------------ across sections
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

        The claim does not wait for the outcome's commit: the backend commits in the order it is handed
        writes, often both in one commit, and the answer waits for both. Whatever fails, the outcome is
        durable (or its error raised) before this returns; a claim made for an answer that is then an error
        is the claim a retry of its request id gets back.
        """
        nxt = dequeue_next
        self.check_dequeue(nxt.worker_id, nxt.max_rollouts, nxt.wait_timeout, nxt.request_id)
        attempt, rollout, reported = await self._report_outcome(
            rollout_id, attempt_id, status, message, metadata, spans
        )
        try:
            wait = check_wait(nxt.wait_timeout, "wait_timeout")
            if bound_wait is not None:
                wait = bound_wait(wait)
            claimed = await self.dequeue_rollouts(nxt.worker_id, nxt.max_rollouts, wait, nxt.request_id)
        finally:
            if reported is not None:
                await reported
        return attempt, rollout, claimed
