"""A Store in the same process, reached without gRPC, for the parts of a client that the proxy uses.

``lightning-grpc serve --proxy-backend ...`` hosts the proxy next to the Store. Every LLM call heartbeats
its attempt and records a span; over loopback gRPC each of those costs serialisation and a round trip on
both sides of the same process. :class:`LocalStoreClient` answers them from the Store core directly,
with the same results and the same typed errors as :class:`~lightning_grpc.client.StoreClient`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Sequence

from lightning_grpc import convert
from lightning_grpc import types as t
from lightning_grpc.convert.store import statistics_view
from lightning_grpc.store import Store
from lightning_grpc.types import AddSpansResult, AttemptHeartbeat
from lightning_grpc.v1 import span_pb2


class LocalStoreClient:
    """The Store calls the proxy makes, answered by a Store in this process.

    Raises the same :class:`lightning_grpc.errors.LightningError` subclasses as
    :class:`~lightning_grpc.client.StoreClient`; nothing is retried, since there is no network.

    Args:
        store: The Store of the server this process hosts.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    async def heartbeat_attempt(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        """Tell the store an attempt is alive; learn whether it should stop.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.

        Returns:
            The attempt, its rollout's status, and whether it was cancelled or should stop.

        Raises:
            NotFoundError: No such rollout or attempt.
        """
        return await self.store.heartbeat_attempt(rollout_id, attempt_id)

    async def admit_call(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        """:meth:`heartbeat_attempt` (same arguments, answer and errors) for an LLM call about to be
        forwarded, whose span this process stores once it ends: a heartbeat that moves only the attempt's
        heartbeat time is written with that span, not committed on its own."""
        return await self.store.heartbeat_attempt(rollout_id, attempt_id, for_call=True)

    async def get_rollout(self, rollout_id: str) -> t.Rollout:
        """One rollout, with its latest attempt.

        Args:
            rollout_id: The rollout.

        Returns:
            The rollout.

        Raises:
            NotFoundError: No such rollout.
        """
        return await self.store.get_rollout(rollout_id)

    async def query_attempts(self, rollout_id: str, *, descending: bool = False) -> list[t.Attempt]:
        """A rollout's attempts by sequence number (the first 1000).

        Args:
            rollout_id: The rollout.
            descending: Latest first.

        Returns:
            The attempts.

        Raises:
            NotFoundError: No such rollout.
        """
        page = await self.store.list_attempts(rollout_id, descending=descending, page_size=1000)
        return list(page.items)

    async def add_spans(
        self, spans: Iterable[t.Span | span_pb2.Span], *, rollout_id: str = "", attempt_id: str = ""
    ) -> AddSpansResult:
        """Store spans in one commit.

        Args:
            spans: The spans (domain objects or ``lightning.v1.Span`` messages).
            rollout_id: The rollout of spans that do not name one.
            attempt_id: The attempt of spans that do not name one.

        Returns:
            Each span's sequence id, in order, and how many were stored or already there.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A malformed span.
        """
        bodies = [
            (s if isinstance(s, span_pb2.Span) else convert.span_to_pb(s)).SerializeToString() for s in spans
        ]
        return await self.add_span_bytes(bodies, rollout_id, attempt_id)

    async def add_span_bytes(
        self, spans: Sequence[bytes], rollout_id: str = "", attempt_id: str = ""
    ) -> AddSpansResult:
        """Store serialized ``lightning.v1.Span`` messages as they are (what the span shipper sends).

        Args:
            spans: The serialized spans.
            rollout_id: The rollout of spans that do not name one.
            attempt_id: The attempt of spans that do not name one.

        Returns:
            Each span's sequence id, in order, and how many were stored or already there.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A malformed span.
        """
        return await self.store.add_spans(convert.span_records(spans), rollout_id, attempt_id)

    def submit_span_bytes(
        self, spans: Sequence[bytes], rollout_id: str = "", attempt_id: str = ""
    ) -> Awaitable[None] | None:
        """:meth:`add_span_bytes` up to the wait for its commit: the spans are checked, numbered and handed to
        the Store now (in this call, with nothing awaited).

        Args:
            spans: The serialized spans.
            rollout_id: The rollout of spans that do not name one.
            attempt_id: The attempt of spans that do not name one.

        Returns:
            None when the spans are already stored (a Store in memory); else the wait for their commit,
            which raises what the commit raised (await it to know they are stored).

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A malformed span.
        """
        return self.store.submit_spans(convert.span_records(spans), rollout_id, attempt_id).durable

    def submit_span(
        self, span: span_pb2.Span, body: bytes, rollout_id: str = "", attempt_id: str = ""
    ) -> Awaitable[None] | None:
        """:meth:`submit_span_bytes` of one span built in this process, given as its message and its serialized
        form ``body`` (``span.SerializeToString()``): nothing is parsed.

        Returns:
            None when the span is already stored (a Store in memory); else the wait for its commit.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A span the Store does not take (its ids, its size).
        """
        record = convert.span_record(span, body)
        return self.store.submit_spans([record], rollout_id, attempt_id).durable

    async def statistics(self) -> t.Statistics:
        """The store's counts, backend and sizes, with the keys :meth:`StoreClient.statistics` answers.

        Returns:
            The statistics (``rollouts_by_status`` keyed by lower-case status name).
        """
        return statistics_view(await self.store.statistics())

    async def close(self) -> None:
        """Nothing to close: the Store belongs to the server."""
