"""Statistics, and deleting finished rollouts."""

from __future__ import annotations

import time
from collections.abc import Sequence

from lightning_grpc import logs
from lightning_grpc.errors import FailedPreconditionError, InvalidArgumentError, Reason
from lightning_grpc.types import DeleteResult, Statistics

from ..state import Txn
from .staging import SpanStaging

log = logs.get_logger(__name__)


class HousekeepingSection(SpanStaging):
    """Statistics and deletion."""

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
            storage_bytes=self.backend.storage_bytes(),
        )

    async def delete_rollouts(
        self, rollout_ids: Sequence[str] = (), finished_before: float | None = None
    ) -> DeleteResult:
        """Delete finished rollouts (with attempts and spans) by id, or every one that ended before a time.

        Taken while the store is full, ahead of the writes held for want of space, so that deleting makes
        room for them."""
        self._check_writable(frees_space=True)
        if not rollout_ids and finished_before is None:
            raise InvalidArgumentError("rollout_ids", "give rollout ids or finished_before")
        ids = list(dict.fromkeys(rollout_ids))
        for i, rid in enumerate(ids):
            rs = self._rollout(rid, f"rollout_ids[{i}]")
            if not rs.rollout.status.is_terminal:
                raise FailedPreconditionError(
                    f"rollout {rid} is {rs.rollout.status}; only finished rollouts can be deleted",
                    reason=Reason.ROLLOUT_NOT_FINISHED,
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
        await self._apply(tx, frees_space=True)
        if result.deleted_rollouts:
            log.info(
                "event=rollouts_deleted count=%d spans=%d", result.deleted_rollouts, result.deleted_spans
            )
        return result
