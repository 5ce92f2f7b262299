"""Workers: their heartbeats, and reading and listing them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from lightning_grpc.errors import InvalidArgumentError, NotFoundError, Reason
from lightning_grpc.types import Page, Worker, WorkerStatus

from .. import paging
from ..state import Txn
from .staging import SpanStaging
from .validation import check_id, check_metadata

#: The orders ListWorkers offers; a time a worker never had sorts as the latest.
WORKER_ORDER_KEYS: dict[str, Callable[[Worker], Any]] = {
    "worker_id": lambda w: w.worker_id,
    "status": lambda w: int(w.status),
    "last_heartbeat_time": lambda w: math.inf if w.last_heartbeat_time is None else w.last_heartbeat_time,
    "last_dequeue_time": lambda w: math.inf if w.last_dequeue_time is None else w.last_dequeue_time,
}


class WorkersSection(SpanStaging):
    """Workers, as their heartbeats and their attempts show them."""

    async def heartbeat_worker(self, worker_id: str, stats: dict[str, Any] | None = None) -> Worker:
        self._check_writable()
        if not worker_id:
            raise InvalidArgumentError("worker_id", "is required")
        check_id(worker_id, "worker_id")
        if stats is not None:
            stats = check_metadata(stats, "heartbeat_stats")
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
                f"worker {worker_id} not found", reason=Reason.WORKER_NOT_FOUND, workerId=worker_id
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
        order_by: str = "",
        descending: bool = False,
    ) -> Page:
        order = order_by or "worker_id"
        key = WORKER_ORDER_KEYS.get(order)
        if key is None:
            raise InvalidArgumentError(
                "order_by", f"must be one of {', '.join(WORKER_ORDER_KEYS)} (got {order!r})"
            )
        wanted = set()
        for i, s in enumerate(statuses):
            try:
                wanted.add(WorkerStatus(s))
            except ValueError:
                raise InvalidArgumentError(f"statuses[{i}]", f"is not a worker status (got {s})") from None
        size = paging.page_size(page_size)
        filters = paging.filter_hash(sorted(wanted), worker_id_contains, order, descending)

        def cursor(w: Worker) -> tuple[Any, ...]:
            return (key(w), w.worker_id)

        matches = sorted(
            (
                ws.worker
                for ws in self._workers.values()
                if (not wanted or ws.worker.status in wanted) and worker_id_contains in ws.worker.worker_id
            ),
            key=cursor,
            reverse=descending,
        )
        page, nxt = paging.keyset_page(
            matches, cursor, size, paging.read_token(page_token, filters), descending
        )
        await self._durable()
        return Page(
            items=[replace(w) for w in page],
            next_page_token=paging.make_token(nxt, filters) if nxt is not None else "",
            total_size=len(matches),
        )
