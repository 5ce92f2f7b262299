"""The store's timers: the watchdog that ends attempts past their deadlines, and housekeeping."""

from __future__ import annotations

import asyncio
import heapq

from lightning_grpc import logs
from lightning_grpc.types import AttemptStatus

from ..state import Txn
from .staging import SpanStaging

log = logs.get_logger("lightning_grpc.store")


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
