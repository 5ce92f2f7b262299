"""Rollouts: creating, queueing and claiming them, changing, cancelling, reading and listing them."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, ClassVar

from lightning_grpc import logs
from lightning_grpc.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, Reason
from lightning_grpc.types import (
    AttemptStatus,
    Page,
    Rollout,
    RolloutSpec,
    RolloutStatus,
    WorkerStatus,
    copy_rollout,
)

from .. import paging, rows
from ..state import RolloutState, Txn
from .limits import MAX_BATCH_ROLLOUTS, new_id
from .staging import SpanStaging
from .validation import (
    check_config,
    check_id,
    check_json,
    check_limit,
    check_metadata,
    check_mode,
    check_wait,
    check_worker_id,
    rollout_statuses,
)

log = logs.get_logger(__name__)

#: A status filter of ListRollouts in creation order walks every rollout, as far as its page's end, where its
#: statuses hold at least 1 in this many rollouts (a page is then found within about this many pages' worth).
_DENSE = 4


class RolloutsSection(SpanStaging):
    """Rollouts and the queue."""

    def _prepare_spec(self, spec: RolloutSpec, field: str) -> tuple[RolloutSpec, str]:
        if spec.rollout_id:
            check_id(spec.rollout_id, f"{field}.rollout_id")
        if spec.group_id and len(spec.group_id) > 256:
            raise InvalidArgumentError(f"{field}.group_id", "must be at most 256 characters")
        check_json(spec.input, f"{field}.input")
        mode = check_mode(spec.mode, f"{field}.mode")
        config = check_config(spec.config, f"{field}.config", self.timeout_rule)
        metadata = check_metadata(spec.metadata, f"{field}.metadata")
        if spec.resources_id:
            self._resources_state(spec.resources_id, f"{field}.resources_id")
        fingerprint = _fingerprint(
            spec.input, int(mode), spec.resources_id, spec.group_id, rows.config_to_dict(config), metadata
        )
        return replace(spec, mode=mode, config=config, metadata=metadata), fingerprint

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
        rs = RolloutState(rollout=rollout, fingerprint=fingerprint)
        rs.bytes = self._estimate_rollout_bytes(rs)
        self._memory_bytes += rs.bytes
        self._hold(rs)
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
                reason=Reason.ROLLOUT_ALREADY_EXISTS,
                rolloutId=spec.rollout_id,
            )
        return rs

    async def start_rollout(self, spec: RolloutSpec, worker_id: str = "") -> Rollout:
        """Create a rollout already claimed by the caller, with its first attempt."""
        self._check_writable()
        check_worker_id(worker_id)
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
            return []  # nothing to queue: a no-op, as an empty batch from a generator naturally is
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
        await self._wait_for_queue(wait)
        limit = max(1, max_rollouts)
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

    async def _wait_for_queue(self, wait: float) -> None:
        """Return once the queue holds a rollout or ``wait`` seconds passed (UNAVAILABLE on shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            self._check_writable()
            if wait > 0:
                self.check_not_draining()
            if self._queue:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._dequeue_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                pass
            finally:
                if fut in self._dequeue_waiters:
                    self._dequeue_waiters.remove(fut)

    def check_dequeue(
        self, worker_id: str, max_rollouts: int, wait_timeout: float | None, request_id: str = ""
    ) -> float:
        """Validate dequeue arguments; returns the wait in seconds."""
        check_worker_id(worker_id)
        check_limit(max_rollouts, "max_rollouts", MAX_BATCH_ROLLOUTS)
        if len(request_id) > 128:
            raise InvalidArgumentError("request_id", "must be at most 128 characters")
        return check_wait(wait_timeout, "wait_timeout")

    async def start_attempt(self, rollout_id: str, worker_id: str = "") -> Rollout:
        """Start a new attempt of a queued or requeuing rollout by hand (ignores max_attempts)."""
        self._check_writable()
        check_worker_id(worker_id)
        rs = self._rollout(rollout_id)
        r = rs.rollout
        if r.status.is_terminal:
            raise FailedPreconditionError(
                f"rollout {rollout_id} already finished as {r.status}; a finished rollout stays finished",
                reason=Reason.ROLLOUT_FINISHED,
                rolloutId=rollout_id,
                status=str(r.status),
            )
        latest = rs.latest
        if latest is not None and latest.attempt.status.is_active:
            raise FailedPreconditionError(
                f"rollout {rollout_id} has an active attempt {latest.attempt.attempt_id}; it must end first",
                reason=Reason.ATTEMPT_STILL_ACTIVE,
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
            values["mode"] = check_mode(values["mode"], "mode")
        if "config" in values:
            values["config"] = check_config(values["config"], "config", self.timeout_rule)
        if "metadata" in values:
            values["metadata"] = check_metadata(values["metadata"], "metadata")
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
        _refuse_if_finished(r, "cancelled")
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

    async def retry_rollout(self, rollout_id: str, reason: str = "") -> Rollout:
        """End the active attempt (FAILED, with ``reason``) and queue the rollout for a new attempt.

        For an attempt that is stuck: the retry policy (``retry_on``, ``max_attempts``) does not
        apply. A rollout already queued is returned unchanged; a finished one cannot be retried.
        """
        self._check_writable()
        rs = self._rollout(rollout_id)
        r = rs.rollout
        _refuse_if_finished(r, "retried")
        if rollout_id in self._queue:
            await self._durable()
            return self._snapshot(rs)
        now = self.clock()
        tx = Txn()
        latest = rs.latest
        if latest is not None and latest.attempt.status.is_active:
            self._end_attempt(latest, AttemptStatus.FAILED, reason or "ended to be retried", now, tx)
        r.status = RolloutStatus.REQUEUING
        self._push_queue(rs, tx)
        self._record_change(rs, tx)
        self._wake_dequeuers()
        await self._apply(tx)
        log.info("event=rollout_retried rollout_id=%s", rollout_id)
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
        match_any: bool = False,
    ) -> Page:
        """One page of the rollouts the filters select: every filter given holds, or with ``match_any`` one."""
        status_set = rollout_statuses(statuses)
        id_set = set(rollout_ids)
        order = order_by or "create_time"
        key = self._ORDER_KEYS.get(order)
        if key is None:
            raise InvalidArgumentError(
                "order_by", f"must be one of {', '.join(self._ORDER_KEYS)} (got {order!r})"
            )
        mode_filter = check_mode(mode, "mode")
        size = paging.page_size(page_size)
        filters = paging.filter_hash(
            sorted(status_set),
            sorted(id_set),
            rollout_id_contains,
            int(mode_filter),
            group_id,
            order,
            descending,
            match_any,
        )
        after = paging.read_token(page_token, filters)
        # Where the candidates come from: the ids given, else the rollouts filed under the statuses given
        # (no scan of the whole store), else every rollout; with match_any, every rollout.
        by_ids = bool(id_set) and not match_any
        by_status = bool(status_set) and not match_any and not by_ids
        tests: list[Callable[[Rollout], bool]] = []
        if status_set and not by_status:  # filed under its status, a candidate passes the status test
            tests.append(lambda r: r.status in status_set)
        if id_set:
            tests.append(lambda r: r.rollout_id in id_set)
        if rollout_id_contains:
            tests.append(lambda r: rollout_id_contains in r.rollout_id)
        if mode_filter:
            tests.append(lambda r: r.mode == mode_filter)
        if group_id:
            tests.append(lambda r: r.group_id == group_id)

        def cursor(rs: RolloutState) -> tuple[Any, ...]:
            return (key(rs.rollout), rs.create_seq)

        walked = None
        if not tests and not by_ids and order == "create_time":  # every rollout, or those of some statuses
            walked = self._page_in_creation_order(status_set, cursor, size, after, descending)
        if walked is not None:
            page, nxt, total = walked
        else:
            matches = self._matching(status_set, rollout_ids, by_ids, by_status, tests, match_any)
            page, nxt = paging.keyset_page_of(matches, cursor, size, after, descending)
            total = len(matches)
        token = paging.make_token(nxt, filters) if nxt is not None else ""
        await self._durable()
        return Page(items=[copy_rollout(rs.rollout) for rs in page], next_page_token=token, total_size=total)

    def _matching(
        self,
        status_set: set[RolloutStatus],
        rollout_ids: Iterable[str],
        by_ids: bool,
        by_status: bool,
        tests: list[Callable[[Rollout], bool]],
        match_any: bool,
    ) -> list[RolloutState]:
        """Every rollout the filters select, in no particular order."""
        source: Iterable[RolloutState]
        if by_ids:
            source = (self._rollouts[i] for i in dict.fromkeys(rollout_ids) if i in self._rollouts)
        elif by_status:
            source = (rs for status in status_set for rs in self._by_status[status].values())
        else:
            source = self._rollouts.values()
        combine = any if match_any else all
        return [rs for rs in source if not tests or combine(test(rs.rollout) for test in tests)]

    def _page_in_creation_order(
        self,
        status_set: set[RolloutStatus],
        cursor: Callable[[RolloutState], tuple[Any, ...]],
        size: int,
        after: Any,
        descending: bool,
    ) -> tuple[list[RolloutState], list[Any] | None, int] | None:
        """A page of every rollout, or of those of ``status_set``, in creation order, read off the rollouts
        (kept in that order) as far as the page's end instead of sorting every match: the first page costs the
        same at any store size. None where that walk could be long (the statuses hold under a quarter of the
        rollouts: their own index is shorter) or the rollouts are not in creation order (a clock stepped back).
        """
        if not self._in_creation_order:
            return None
        rollouts = reversed(self._rollouts.values()) if descending else self._rollouts.values()
        if not status_set:
            page, nxt = paging.keyset_page(rollouts, cursor, size, after, descending)
            return page, nxt, len(self._rollouts)
        total = sum(len(self._by_status[status]) for status in status_set)
        if total * _DENSE < len(self._rollouts):
            return None
        matching = (rs for rs in rollouts if rs.rollout.status in status_set)
        page, nxt = paging.keyset_page(matching, cursor, size, after, descending)
        return page, nxt, total


def _fingerprint(*parts: Any) -> str:
    """What makes two rollout specs the same, so that resending one with its id is harmless."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _refuse_if_finished(r: Rollout, what: str) -> None:
    """A finished rollout never changes again: FAILED_PRECONDITION saying what cannot be done."""
    if r.status.is_terminal:
        raise FailedPreconditionError(
            f"rollout {r.rollout_id} already finished as {r.status}; it cannot be {what}",
            reason=Reason.ROLLOUT_FINISHED,
            rolloutId=r.rollout_id,
            status=str(r.status),
        )
