"""The store's timers: the watchdog that ends attempts past their deadlines, and housekeeping."""

from __future__ import annotations

import asyncio
import heapq

from lightning_grpc import logs
from lightning_grpc.types import AttemptStatus

from ..state import Txn
from .staging import SpanStaging

log = logs.get_logger(__name__)


class WatchdogSection(SpanStaging):
    """Background tasks, started by :meth:`Store.start`."""

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
            if config.timeout and now >= self._timeout_deadline(ast):
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

    def _excuse_outage(self, start: float, end: float) -> None:
        """The seconds the store could not write, from ``start`` to ``end``, do not count against any attempt
        then running: its heartbeats and its outcome were refused, so its deadlines move by that much."""
        for ast in self._attempts.values():
            a = ast.attempt
            if not a.status.is_active:
                continue
            ast.timeout_grace += max(0.0, end - max(start, a.start_time))
            ast.silence_grace += max(0.0, end - max(start, a.last_heartbeat_time or a.start_time))
        log.info("event=store_outage_excused seconds=%.3f", end - start)

    def _on_backend_outage(self) -> None:
        """The backend found it cannot write while no write was refused yet: the outage counts from now (not
        from the watchdog's next look, which may be a whole deadline away), and no deadline fires meanwhile."""
        if self._outage_started is not None and self._outage_ended is not None:
            self._settle_outage()  # an earlier outage ended before this one began
        self._note_outage()
        if self._watchdog_wake is not None:
            self._watchdog_wake.set()

    def _settle_outage(self) -> None:
        assert self._outage_started is not None
        self._excuse_outage(self._outage_started, self._outage_ended or self.clock())
        self._outage_started = self._outage_ended = None

    async def _watchdog(self) -> None:
        assert self._watchdog_wake is not None
        while True:
            if self._cannot_write():  # no deadline fires while the store cannot write
                if self._outage_ended is not None:  # an earlier outage ended before this one began
                    self._settle_outage()
                self._note_outage()
                self._watchdog_wake.clear()
                try:
                    await asyncio.wait_for(self._watchdog_wake.wait(), 0.25)
                except TimeoutError:
                    pass
                continue
            if self._outage_started is not None:
                self._settle_outage()
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
