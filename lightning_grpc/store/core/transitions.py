"""The state machine: how rollouts and attempts move, what the change log records, the queue and
the deadlines. Every operation that changes a rollout or an attempt goes through these."""

from __future__ import annotations

import heapq
import math

from lightning_grpc.types import (
    RETRYABLE_ATTEMPT_STATUSES,
    Attempt,
    AttemptStatus,
    RolloutStatus,
    WorkerStatus,
    copy_rollout,
)

from ..span_ids import SpanIdIndex
from ..state import AttemptState, Change, RolloutState, Txn
from .limits import ATTEMPT_OVERHEAD_BYTES, new_id
from .memory import MemoryBound


class Transitions(MemoryBound):
    """Moves rollouts and attempts; each move is collected in the caller's :class:`Txn`."""

    # ------------------------------------------------------------------ change log and queue
    def _record_change(self, rs: RolloutState, tx: Txn) -> None:
        """Append the rollout as it is now to the change log (one entry per rollout per operation)."""
        self._file_by_status(rs)
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

    def _push_queue(self, rs: RolloutState, tx: Txn) -> None:
        rs.queue_seq = next(self._queue_seq)
        self._queue[rs.rollout.rollout_id] = None
        tx.rollouts[rs.rollout.rollout_id] = rs

    def _wake_dequeuers(self) -> None:
        waiters, self._dequeue_waiters = self._dequeue_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------ deadlines
    def _deadline(self, ast: AttemptState) -> float | None:
        a = ast.attempt
        config = self._rollouts[a.rollout_id].rollout.config
        deadlines = []
        if config.timeout:
            deadlines.append(self._timeout_deadline(ast))
        if config.unresponsive_timeout:
            deadlines.append(
                (a.last_heartbeat_time or a.start_time) + config.unresponsive_timeout + ast.silence_grace
            )
        return min(deadlines) if deadlines else None

    def _timeout_deadline(self, ast: AttemptState) -> float:
        """When the attempt's wall-time limit ends (its rollout has a timeout)."""
        timeout = self._rollouts[ast.attempt.rollout_id].rollout.config.timeout or 0.0
        return ast.attempt.start_time + timeout + ast.timeout_grace

    def _schedule(self, ast: AttemptState) -> None:
        deadline = self._deadline(ast)
        if deadline is None:
            return
        earliest = self._deadlines[0][0] if self._deadlines else math.inf
        heapq.heappush(self._deadlines, (deadline, next(self._deadline_tiebreak), ast.attempt.attempt_id))
        if deadline < earliest and self._watchdog_wake is not None:
            self._watchdog_wake.set()

    # ------------------------------------------------------------------ attempts and rollouts
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
        ast = AttemptState(attempt=attempt, request_id=request_id, span_ids=SpanIdIndex(), index_used_at=now)
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

    def _touch(self, rs: RolloutState, ast: AttemptState, now: float, tx: Txn) -> None:
        """A sign of life from an attempt (span or heartbeat)."""
        a = ast.attempt
        if not a.status.is_active:
            return
        a.last_heartbeat_time = now
        ast.silence_grace = 0.0
        tx.attempts[a.attempt_id] = ast
        if a.status == AttemptStatus.PREPARING:
            a.status = AttemptStatus.RUNNING
            if rs.rollout.status == RolloutStatus.PREPARING and rs.latest is ast:
                rs.rollout.status = RolloutStatus.RUNNING
                tx.rollouts[a.rollout_id] = rs
            self._record_change(rs, tx)

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
