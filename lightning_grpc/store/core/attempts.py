"""Attempts: reading them, their heartbeats and their outcomes."""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

from lightning_grpc.errors import FailedPreconditionError, InvalidArgumentError, Reason
from lightning_grpc.types import Attempt, AttemptHeartbeat, AttemptStatus, Page, Rollout, RolloutStatus

from .. import paging
from ..state import SpanRecord, Txn
from .staging import SpanStaging
from .validation import check_metadata


class AttemptsSection(SpanStaging):
    """What runners report about their attempts."""

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

    async def heartbeat_attempt(
        self, rollout_id: str, attempt_id: str, *, for_call: bool = False
    ) -> AttemptHeartbeat:
        """Keep an attempt alive; tell the runner whether to go on.

        ``for_call``: the sign of life of an LLM call the proxy in this process is about to forward, which
        stores the call's span, and with it the attempt, once the call ends. A heartbeat that moves nothing
        but the attempt's heartbeat time is then written with that span, not committed on its own while the
        call waits (one commit less a call); one that moves the attempt's status is committed first, as
        always.
        """
        self._check_writable()
        rs, ast = self._attempt(rollout_id, attempt_id)
        tx = Txn()
        self._touch(rs, ast, self.clock(), tx)
        if tx.changes or not for_call:
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
        attempt, rollout, durable = await self._report_outcome(
            rollout_id, attempt_id, status, message, metadata, spans
        )
        if durable is not None:
            await durable
        return attempt, rollout

    async def _report_outcome(
        self,
        rollout_id: str,
        attempt_id: str,
        status: int,
        message: str,
        metadata: dict[str, Any] | None,
        spans: list[SpanRecord] | None,
    ) -> tuple[Attempt, Rollout, Coroutine[Any, Any, None] | None]:
        """:meth:`complete_attempt` up to its commit: the outcome checked, applied and handed to the backend.
        Returns the attempt and rollout as the outcome left them, and what waits until it is durable (None
        when it already is)."""
        self._check_writable()
        rs, ast = self._attempt(rollout_id, attempt_id)
        try:
            outcome = AttemptStatus(status)
        except ValueError:
            outcome = AttemptStatus.UNSPECIFIED
        if outcome not in (AttemptStatus.SUCCEEDED, AttemptStatus.FAILED):
            raise InvalidArgumentError("status", f"must be SUCCEEDED or FAILED (got {status})")
        extra = check_metadata(metadata, "metadata")
        a = ast.attempt
        if not a.status.is_active:
            if a.status == outcome:  # a retried report of the same outcome
                await self._durable()
                return replace(a), self._snapshot(rs), None
            raise FailedPreconditionError(
                f"attempt {attempt_id} of rollout {rollout_id} already ended as {a.status}; "
                f"its report of {outcome} is refused",
                reason=Reason.ATTEMPT_ALREADY_ENDED,
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
        durable = self._submit(tx)
        return replace(a), self._snapshot(rs), durable
