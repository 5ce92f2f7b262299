"""For cores built on the store (the trainer core, access control): reads of the state, and their own writes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning_grpc.types import Attempt, Rollout

from ..state import Txn
from .staging import SpanStaging
from .validation import check_json


class InProcessSection(SpanStaging):
    """What the trainer core reads and writes through the store."""

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

    def find_attempt(self, rollout_id: str, attempt_id: str) -> Attempt | None:
        """The store's own attempt object (read-only), or None; no I/O (access control asks it on every call)."""
        ast = self._attempts.get(attempt_id)
        if ast is None or ast.attempt.rollout_id != rollout_id:
            return None
        return ast.attempt

    def find_latest_attempt(self, rollout_id: str) -> Attempt | None:
        """The latest attempt of a rollout (the store's own object, read-only), or None; no I/O."""
        rs = self._rollouts.get(rollout_id)
        return rs.latest.attempt if rs is not None and rs.latest is not None else None

    def attempt_span_count(self, attempt_id: str) -> int:
        """How many spans an attempt has stored (0 for an unknown attempt)."""
        ast = self._attempts.get(attempt_id)
        return ast.span_count if ast is not None else 0

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
