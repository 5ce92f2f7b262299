"""A Store in the same process, reached without gRPC, for the parts of a client that the proxy uses.

``lightning-grpc serve --proxy-backend ...`` hosts the proxy next to the Store. Every LLM call heartbeats
its attempt and records a span; over loopback gRPC each of those costs serialisation and a round trip on
both sides of the same process. :class:`LocalStoreClient` answers them from the Store core directly,
with the same results and the same typed errors as :class:`~lightning_grpc.client.StoreClient`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lightning_grpc import convert
from lightning_grpc import types as t
from lightning_grpc.store import Store
from lightning_grpc.types import AddSpansResult, AttemptHeartbeat
from lightning_grpc.v1 import span_pb2


class LocalStoreClient:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def heartbeat_attempt(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        return await self.store.heartbeat_attempt(rollout_id, attempt_id)

    async def get_rollout(self, rollout_id: str) -> t.Rollout:
        return await self.store.get_rollout(rollout_id)

    async def query_attempts(self, rollout_id: str, *, descending: bool = False) -> list[t.Attempt]:
        page = await self.store.list_attempts(rollout_id, descending=descending, page_size=1000)
        return list(page.items)

    async def add_spans(
        self, spans: Iterable[t.Span | span_pb2.Span], *, rollout_id: str = "", attempt_id: str = ""
    ) -> AddSpansResult:
        bodies = [
            (s if isinstance(s, span_pb2.Span) else convert.span_to_pb(s)).SerializeToString() for s in spans
        ]
        return await self.add_span_bytes(bodies, rollout_id, attempt_id)

    async def add_span_bytes(
        self, spans: Sequence[bytes], rollout_id: str = "", attempt_id: str = ""
    ) -> AddSpansResult:
        """Store serialized ``lightning.v1.Span`` messages as they are (what the span shipper sends)."""
        return await self.store.add_spans(convert.span_records(spans), rollout_id, attempt_id)

    async def close(self) -> None:
        """Nothing to close: the Store belongs to the server."""
