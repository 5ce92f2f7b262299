"""Spans: adding them, reserving sequence ids, listing and tailing them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from dataclasses import asdict, dataclass
from typing import Any

from lightning_grpc.errors import InvalidArgumentError, Reason, ResourceExhaustedError
from lightning_grpc.types import AddSpansResult, Page

from .. import paging
from ..backend import SpanQuery
from ..state import SpanRecord, Txn
from .base import SpanSelection
from .limits import LATEST, MAX_SEQUENCE_ID, MAX_SPAN_SEQUENCE_RESERVATION
from .staging import SpanStaging
from .validation import check_limit

#: Where a newest-first listing starts: after every span a store can number.
END_OF_SPANS = MAX_SEQUENCE_ID + 1


@dataclass(slots=True)
class SubmittedSpans:
    """A batch :meth:`SpansSection.submit_spans` took: what it became, and the wait for its commit."""

    result: AddSpansResult
    #: Returns once the batch is durable (raises what the commit raised); None when it already is.
    durable: Coroutine[Any, Any, None] | None


class SpansSection(SpanStaging):
    """Spans of attempts (see :mod:`.staging` for how a batch is stored)."""

    async def add_spans(
        self, records: list[SpanRecord], rollout_id: str = "", attempt_id: str = ""
    ) -> AddSpansResult:
        """Store spans; a span id already stored in its attempt is skipped (so batches can be resent)."""
        submitted = self.submit_spans(records, rollout_id, attempt_id)
        if submitted.durable is not None:
            await submitted.durable
        return submitted.result

    def submit_spans(
        self, records: list[SpanRecord], rollout_id: str = "", attempt_id: str = ""
    ) -> SubmittedSpans:
        """:meth:`add_spans` up to the wait for its commit: the batch is checked, numbered and handed to the
        backend now (a later batch sees its span ids), and is durable once ``durable`` (when not None) has
        been awaited without an error. A caller holding several batches awaits each one's ``durable``."""
        self._check_writable()
        tx = Txn()
        result = self._stage_spans(records, rollout_id, attempt_id, tx)
        return SubmittedSpans(result, self._submit(tx))

    async def next_span_sequence_id(self, rollout_id: str, attempt_id: str, count: int = 1) -> int:
        """Reserve ``count`` sequence ids of an attempt; returns the first."""
        self._check_writable()
        _, ast = self._attempt(rollout_id, attempt_id)
        check_limit(count, "count", MAX_SPAN_SEQUENCE_RESERVATION)
        first = ast.next_sequence_id
        if first + max(1, count) > MAX_SEQUENCE_ID:
            raise ResourceExhaustedError(
                f"attempt {attempt_id} has used up its sequence ids", reason=Reason.SEQUENCE_IDS_EXHAUSTED
            )
        ast.next_sequence_id += max(1, count)
        tx = Txn()
        tx.attempts[attempt_id] = ast
        await self._apply(tx)
        return first

    def _span_query(self, sel: SpanSelection) -> SpanQuery | None:
        rs = self._rollout(sel.rollout_id, "selector.rollout_id")
        attempt_no = 0
        if sel.attempt_id == LATEST:
            if rs.latest is None:
                return None
            attempt_no = rs.latest.attempt.sequence_number
        elif sel.attempt_id:
            _, ast = self._attempt(sel.rollout_id, sel.attempt_id)
            attempt_no = ast.attempt.sequence_number
        return SpanQuery(
            rollout_id=sel.rollout_id,
            attempt_no=attempt_no,
            trace_id=sel.trace_id,
            span_id=sel.span_id,
            parent_span_id=sel.parent_span_id,
            name=sel.name,
            name_contains=sel.name_contains,
        )

    async def list_spans(
        self, sel: SpanSelection, page_size: int = 0, page_token: str = "", *, descending: bool = False
    ) -> Page:
        """Spans of a rollout ordered by attempt then sequence id (newest first with ``descending``)."""
        query = self._span_query(sel)
        size = paging.page_size(page_size, default=1000, maximum=10_000)
        filters = paging.filter_hash(asdict(sel), descending) if page_token else ""
        position = paging.read_token(page_token, filters)
        await self._durable()
        if query is None:
            return Page(items=[])
        query.descending = descending
        if descending:
            query.after = (END_OF_SPANS, END_OF_SPANS)
        if position is not None:
            if not (
                isinstance(position, list)
                and len(position) == 2
                and all(isinstance(p, int) and 0 <= p <= MAX_SEQUENCE_ID for p in position)
            ):
                raise InvalidArgumentError("page_token", "is not a page token this store issued")
            query.after = (position[0], position[1])
        query.limit = size + 1
        found = await self.backend.query_spans(query)
        more = len(found) > size
        found = found[:size]
        token = ""
        if more:  # the filters' hash is only worth computing when a next page exists
            token = paging.make_token(
                [found[-1].attempt_no, found[-1].sequence_id],
                filters or paging.filter_hash(asdict(sel), descending),
            )
        return Page(items=found, next_page_token=token, total_size=await self._count_spans(query, sel))

    async def _count_spans(self, query: SpanQuery, sel: SpanSelection) -> int:
        """The spans a selection matches: the attempts' own counts, unless a filter narrows them."""
        if query.filtered:
            return await self.backend.count_spans(query)
        rs = self._rollouts[sel.rollout_id]
        return sum(
            a.span_count
            for a in rs.attempts
            if not query.attempt_no or a.attempt.sequence_number == query.attempt_no
        )

    async def tail_spans(
        self, sel: SpanSelection, follow: bool = False, batch_size: int = 1000
    ) -> AsyncIterator[list[SpanRecord]]:
        """Yield the spans of a rollout in batches; with ``follow``, keep yielding new ones until the rollout
        has ended (succeeded, failed for good or cancelled) and every span stored by then was yielded."""
        query = self._span_query(sel)
        if query is None and not follow:
            return
        after = (0, 0)
        while True:
            await self._durable()
            status = self.rollout_status(sel.rollout_id)
            ended = status is not None and status.is_terminal  # spans stored before this are read below
            if query is None:
                query = self._span_query(sel)
            if query is not None:
                query.after, query.limit = after, batch_size
                found = await self.backend.query_spans(query)
                if found:
                    after = (found[-1].attempt_no, found[-1].sequence_id)
                    yield found
                    if len(found) == batch_size:
                        continue
            if not follow or ended:
                return
            self.check_not_draining()
            fut = self._span_waiters.get(sel.rollout_id)
            if fut is None or fut.done():
                fut = self._span_waiters[sel.rollout_id] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(fut), 1.0)
            except TimeoutError:
                pass
            if sel.rollout_id not in self._rollouts:
                return
