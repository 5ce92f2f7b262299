"""The memory bound of an in-memory store, and taking rollouts out of the state."""

from __future__ import annotations

from lightning_grpc import logs
from lightning_grpc.errors import Reason, ResourceExhaustedError
from lightning_grpc.types import DeleteResult

from ..state import RolloutState, Txn
from .base import StoreBase
from .limits import ATTEMPT_OVERHEAD_BYTES, ROLLOUT_OVERHEAD_BYTES

log = logs.get_logger(__name__)


class MemoryBound(StoreBase):
    """Counts what rollouts take, and evicts the oldest finished ones when the bound is reached."""

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
                reason=Reason.STORE_MEMORY_FULL,
            )

    def _delete(self, ids: list[str], tx: Txn) -> DeleteResult:
        result = DeleteResult()
        for rid in ids:
            rs = self._rollouts.pop(rid)
            self._unfile(rid)
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
