"""StoreClient: the friendly face of the StoreService stubs, returning plain Python objects."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from lightning_grpc import convert
from lightning_grpc import types as t
from lightning_grpc.errors import InvalidArgumentError, LightningError, NotFoundError, UnavailableError
from lightning_grpc.types import AddSpansResult, AttemptHeartbeat, WatchEvent
from lightning_grpc.v1 import common_pb2, span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc

from .channel import call_metadata, make_channel
from .config import ClientConfig
from .errors import from_rpc_error

T = TypeVar("T")


def _span_selector(
    rollout_id: str,
    attempt_id: str | None,
    trace_id: str,
    span_id: str,
    parent_span_id: str,
    name: str,
    name_contains: str,
) -> pb.SpanSelector:
    """The selector of ListSpans: a rollout's spans (``attempt_id``: None, "latest" or an id), filtered."""
    return pb.SpanSelector(
        rollout_id=rollout_id,
        attempt_id=attempt_id or "",
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name=name,
        name_contains=name_contains,
    )


def _order(descending: bool) -> Any:
    return common_pb2.SORT_ORDER_DESCENDING if descending else common_pb2.SORT_ORDER_ASCENDING


def _enum(kind: type[T], value: Any) -> T:
    """Accept an enum member, its number, or its name in any case ("succeeded", "SUCCEEDED")."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind[value.upper()]  # type: ignore[index,no-any-return]
        except KeyError:
            raise InvalidArgumentError(kind.__name__, f"{value!r} is not a {kind.__name__}") from None
    try:
        return kind(value)  # type: ignore[call-arg]
    except ValueError:
        return value  # type: ignore[no-any-return]  # an unknown number: the server answers INVALID_ARGUMENT


def _spec(
    input: Any,
    *,
    rollout_id: str = "",
    mode: t.RolloutMode | str | int | None = None,
    resources_id: str = "",
    group_id: str = "",
    config: t.RolloutConfig | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> t.RolloutSpec:
    return t.RolloutSpec(
        input=input,
        rollout_id=rollout_id or f"ro-{uuid.uuid4().hex[:16]}",
        mode=_enum(t.RolloutMode, mode) if mode is not None else t.RolloutMode.UNSPECIFIED,
        resources_id=resources_id,
        group_id=group_id,
        config=config or t.RolloutConfig(),
        metadata=dict(metadata or {}),
    )


class StoreClient:
    """Async client of the StoreService. Create it inside the event loop that uses it.

    Every method raises a subclass of :class:`lightning_grpc.errors.LightningError` on failure.
    Unknown ids raise :class:`NotFoundError`, except the ``get_*_by_id`` helpers, which return None.
    """

    def __init__(self, target: str | ClientConfig = "127.0.0.1:4747", **options: Any) -> None:
        self.config = target if isinstance(target, ClientConfig) else ClientConfig(target=target, **options)
        self._channel = make_channel(self.config)
        self._stub = pb_grpc.StoreServiceStub(self._channel)
        self._metadata = call_metadata(self.config)

    async def close(self) -> None:
        await self._channel.close()

    async def wait_until_reachable(self, timeout: float) -> None:
        """Return once a connection to the store is up; :class:`UnavailableError` after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise UnavailableError(
                f"cannot reach the store at {self.config.target} within {timeout:g} s "
                "(is it running, and is the address right?)",
                reason="STORE_UNREACHABLE",
            ) from None

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def stub(self) -> pb_grpc.StoreServiceStub:
        """The raw generated stub, for anything this class does not wrap."""
        return self._stub

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel of this client (the span shipper streams spans over it)."""
        return self._channel

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return await getattr(self._stub, method)(
                request, timeout=timeout or self.config.timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def _all_pages(
        self, method: str, request: Any, field: str, item: Callable[[Any], T], limit: int | None = None
    ) -> list[T]:
        """Every item of a List call (at most ``limit``), following page tokens."""
        if limit is not None:
            if limit < 0:
                raise InvalidArgumentError("limit", f"must not be negative (got {limit})")
            request.page_size = min(request.page_size or 1000, max(limit, 1))
        out: list[T] = []
        while limit is None or len(out) < limit:
            resp = await self._call(method, request)
            out.extend(item(x) for x in getattr(resp, field))
            if not resp.next_page_token:
                break
            request.page_token = resp.next_page_token
        return out if limit is None else out[:limit]

    async def _page(self, method: str, request: Any, field: str, item: Callable[[Any], T]) -> t.Page:
        """One page of a List call, with the token of the next and the number of matches in all pages."""
        resp = await self._call(method, request)
        return t.Page(
            items=[item(x) for x in getattr(resp, field)],
            next_page_token=resp.next_page_token,
            total_size=getattr(resp, "total_size", 0),
        )

    # ------------------------------------------------------------ rollouts
    async def start_rollout(self, input: Any, *, worker_id: str = "", **spec: Any) -> t.Rollout:
        request = pb.StartRolloutRequest(worker_id=worker_id)
        convert.spec_to_pb(_spec(input, **spec), request.rollout)
        resp = await self._call("StartRollout", request)
        return convert.rollout_from_pb(resp.rollout)

    async def enqueue_rollout(self, input: Any, **spec: Any) -> t.Rollout:
        return (await self.enqueue_rollouts([_spec(input, **spec)]))[0]

    async def enqueue_rollouts(self, specs: Sequence[t.RolloutSpec | Mapping[str, Any]]) -> list[t.Rollout]:
        request = pb.EnqueueRolloutsRequest()
        for spec in specs:
            s = spec if isinstance(spec, t.RolloutSpec) else _spec(**spec)
            if not s.rollout_id:
                s = t.RolloutSpec(**{**s.__dict__, "rollout_id": f"ro-{uuid.uuid4().hex[:16]}"})
            convert.spec_to_pb(s, request.rollouts.add())
        resp = await self._call("EnqueueRollouts", request)
        return [convert.rollout_from_pb(r) for r in resp.rollouts]

    async def dequeue_rollouts(
        self, limit: int = 1, *, worker_id: str = "", wait: float | None = None
    ) -> list[t.Rollout]:
        request = pb.DequeueRolloutsRequest(
            worker_id=worker_id, max_rollouts=limit, request_id=f"dq-{uuid.uuid4().hex}"
        )
        if wait:
            convert.float_to_duration(wait, request.wait_timeout)
        resp = await self._call("DequeueRollouts", request, timeout=self.config.timeout + (wait or 0))
        return [convert.rollout_from_pb(r) for r in resp.rollouts]

    async def dequeue_rollout(self, *, worker_id: str = "", wait: float | None = None) -> t.Rollout | None:
        got = await self.dequeue_rollouts(1, worker_id=worker_id, wait=wait)
        return got[0] if got else None

    async def start_attempt(self, rollout_id: str, *, worker_id: str = "") -> t.Rollout:
        resp = await self._call(
            "StartAttempt", pb.StartAttemptRequest(rollout_id=rollout_id, worker_id=worker_id)
        )
        return convert.rollout_from_pb(resp.rollout)

    async def update_rollout(self, rollout_id: str, **fields: Any) -> t.Rollout:
        """Change input, mode, resources_id, group_id, config or metadata (keyword arguments)."""
        request = pb.UpdateRolloutRequest(rollout_id=rollout_id)
        for name, value in fields.items():
            if name == "input":
                convert.python_to_value(value, request.input, "input")
            elif name == "mode":
                request.mode = int(_enum(t.RolloutMode, value))  # type: ignore[assignment]
            elif name in ("resources_id", "group_id"):
                setattr(request, name, value)
            elif name == "config":
                convert.config_to_pb(value, request.config)
            elif name == "metadata":
                convert.dict_to_struct(value or {}, request.metadata, "metadata")
            else:
                raise InvalidArgumentError(name, "is not an updatable rollout field")
            request.update_mask.paths.append(name)
        resp = await self._call("UpdateRollout", request)
        return convert.rollout_from_pb(resp.rollout)

    async def cancel_rollout(self, rollout_id: str, reason: str = "") -> t.Rollout:
        resp = await self._call(
            "CancelRollout", pb.CancelRolloutRequest(rollout_id=rollout_id, reason=reason)
        )
        return convert.rollout_from_pb(resp.rollout)

    async def retry_rollout(self, rollout_id: str, reason: str = "") -> t.Rollout:
        """End the rollout's stuck attempt (FAILED, with ``reason``) and queue it for a new one."""
        resp = await self._call("RetryRollout", pb.RetryRolloutRequest(rollout_id=rollout_id, reason=reason))
        return convert.rollout_from_pb(resp.rollout)

    async def get_rollout(self, rollout_id: str) -> t.Rollout:
        resp = await self._call("GetRollout", pb.GetRolloutRequest(rollout_id=rollout_id))
        return convert.rollout_from_pb(resp.rollout)

    async def get_rollout_by_id(self, rollout_id: str) -> t.Rollout | None:
        try:
            return await self.get_rollout(rollout_id)
        except NotFoundError:
            return None

    async def list_rollouts(
        self,
        *,
        status_in: Iterable[t.RolloutStatus | str | int] = (),
        rollout_ids: Iterable[str] = (),
        rollout_id_contains: str = "",
        mode: t.RolloutMode | str | int | None = None,
        group_id: str = "",
        order_by: str = "",
        descending: bool = False,
        page_size: int = 0,
        page_token: str = "",
        match_any: bool = False,
    ) -> t.Page:
        """One page of rollouts; the filters given must all hold, or with ``match_any`` one of them."""
        request = pb.ListRolloutsRequest(
            statuses=[int(_enum(t.RolloutStatus, s)) for s in status_in],  # type: ignore[misc]
            rollout_ids=list(rollout_ids),
            rollout_id_contains=rollout_id_contains,
            mode=int(_enum(t.RolloutMode, mode)) if mode is not None else 0,  # type: ignore[arg-type]
            group_id=group_id,
            order_by=order_by,
            order=_order(descending),
            page_size=page_size,
            page_token=page_token,
            match=pb.FILTER_MATCH_ANY if match_any else pb.FILTER_MATCH_ALL,
        )
        resp = await self._call("ListRollouts", request)
        return t.Page(
            items=[convert.rollout_from_pb(r) for r in resp.rollouts],
            next_page_token=resp.next_page_token,
            total_size=resp.total_size,
        )

    async def query_rollouts(self, **filters: Any) -> list[t.Rollout]:
        """Every rollout matching the filters of :meth:`list_rollouts`, across all pages."""
        out: list[t.Rollout] = []
        token = ""
        while True:
            page = await self.list_rollouts(**filters, page_size=1000, page_token=token)
            out.extend(page.items)
            token = page.next_page_token
            if not token:
                return out

    # ------------------------------------------------------------ attempts
    async def get_latest_attempt(self, rollout_id: str) -> t.Attempt | None:
        resp = await self._call("GetLatestAttempt", pb.GetLatestAttemptRequest(rollout_id=rollout_id))
        return convert.attempt_from_pb(resp.attempt) if resp.HasField("attempt") else None

    async def query_attempts(
        self, rollout_id: str, *, descending: bool = False, limit: int | None = None
    ) -> list[t.Attempt]:
        """A rollout's attempts by sequence number (at most ``limit``), across all pages."""
        request = pb.ListAttemptsRequest(rollout_id=rollout_id, order=_order(descending), page_size=1000)
        return await self._all_pages("ListAttempts", request, "attempts", convert.attempt_from_pb, limit)

    async def list_attempts(
        self, rollout_id: str, *, descending: bool = False, page_size: int = 0, page_token: str = ""
    ) -> t.Page:
        """One page of a rollout's attempts (``total_size``: all of them)."""
        request = pb.ListAttemptsRequest(
            rollout_id=rollout_id, order=_order(descending), page_size=page_size, page_token=page_token
        )
        return await self._page("ListAttempts", request, "attempts", convert.attempt_from_pb)

    async def heartbeat_attempt(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        resp = await self._call(
            "HeartbeatAttempt", pb.HeartbeatAttemptRequest(rollout_id=rollout_id, attempt_id=attempt_id)
        )
        return AttemptHeartbeat(
            attempt=convert.attempt_from_pb(resp.attempt),
            rollout_status=t.RolloutStatus(resp.rollout_status),
            cancelled=resp.cancelled,
            should_stop=resp.should_stop,
        )

    async def complete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: t.AttemptStatus | str | int,
        message: str = "",
        metadata: Mapping[str, Any] | None = None,
        *,
        spans: Iterable[t.Span | span_pb2.Span] = (),
    ) -> tuple[t.Attempt, t.Rollout]:
        """Report an attempt's outcome; ``spans`` are stored in the same commit. Returns (attempt, rollout)."""
        request = self._completion(rollout_id, attempt_id, status, message, metadata, spans)
        resp = await self._call("CompleteAttempt", request)
        return convert.attempt_from_pb(resp.attempt), convert.rollout_from_pb(resp.rollout)

    async def complete_and_dequeue(
        self,
        rollout_id: str,
        attempt_id: str,
        status: t.AttemptStatus | str | int,
        message: str = "",
        *,
        spans: Iterable[t.Span | span_pb2.Span] = (),
        worker_id: str = "",
        limit: int = 1,
        wait: float | None = None,
    ) -> tuple[t.Attempt, t.Rollout, list[t.Rollout]]:
        """Report an outcome and claim the worker's next rollouts in one round trip.

        Returns (attempt, rollout, next rollouts). A retried call returns the same claims.
        """
        request = self._completion(rollout_id, attempt_id, status, message, None, spans)
        request.dequeue_next.worker_id = worker_id
        request.dequeue_next.max_rollouts = limit
        request.dequeue_next.request_id = f"dq-{uuid.uuid4().hex}"
        if wait:
            convert.float_to_duration(wait, request.dequeue_next.wait_timeout)
        resp = await self._call("CompleteAttempt", request, timeout=self.config.timeout + (wait or 0))
        return (
            convert.attempt_from_pb(resp.attempt),
            convert.rollout_from_pb(resp.rollout),
            [convert.rollout_from_pb(r) for r in resp.next_rollouts],
        )

    @staticmethod
    def _completion(
        rollout_id: str,
        attempt_id: str,
        status: t.AttemptStatus | str | int,
        message: str,
        metadata: Mapping[str, Any] | None,
        spans: Iterable[t.Span | span_pb2.Span],
    ) -> pb.CompleteAttemptRequest:
        request = pb.CompleteAttemptRequest(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            status=int(_enum(t.AttemptStatus, status)),  # type: ignore[arg-type]
            message=message,
        )
        if metadata is not None:
            convert.dict_to_struct(metadata, request.metadata, "metadata")
        for s in spans:
            if isinstance(s, span_pb2.Span):
                request.spans.append(s)
            else:
                convert.span_to_pb(s, request.spans.add())
        return request

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: t.AttemptStatus | str | int,
        message: str = "",
        metadata: Mapping[str, Any] | None = None,
    ) -> t.Attempt:
        """Report an attempt's outcome (SUCCEEDED, or FAILED with a message); returns the attempt."""
        attempt, _ = await self.complete_attempt(rollout_id, attempt_id, status, message, metadata)
        return attempt

    # ------------------------------------------------------------ spans
    async def add_spans(
        self,
        spans: Iterable[t.Span | span_pb2.Span],
        *,
        rollout_id: str = "",
        attempt_id: str = "",
    ) -> AddSpansResult:
        request = pb.AddSpansRequest(rollout_id=rollout_id, attempt_id=attempt_id)
        for s in spans:
            if isinstance(s, span_pb2.Span):
                request.spans.append(s)
            else:
                convert.span_to_pb(s, request.spans.add())
        resp = await self._call("AddSpans", request)
        return AddSpansResult(list(resp.sequence_ids), resp.stored_count, resp.duplicate_count)

    async def add_span(self, span: t.Span | span_pb2.Span) -> int:
        """Store one span; returns its sequence id."""
        return (await self.add_spans([span])).sequence_ids[0]

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        trace_id: str = "",
        span_id: str = "",
        parent_span_id: str = "",
        name: str = "",
        name_contains: str = "",
        limit: int | None = None,
    ) -> list[t.Span]:
        """The spans of a rollout, at most ``limit`` (``attempt_id``: None for all attempts, "latest", or an id)."""
        selector = _span_selector(
            rollout_id, attempt_id, trace_id, span_id, parent_span_id, name, name_contains
        )
        request = pb.ListSpansRequest(selector=selector, page_size=10_000)
        return await self._all_pages("ListSpans", request, "spans", convert.span_from_pb, limit)

    async def list_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        trace_id: str = "",
        span_id: str = "",
        parent_span_id: str = "",
        name: str = "",
        name_contains: str = "",
        descending: bool = False,
        page_size: int = 0,
        page_token: str = "",
    ) -> t.Page:
        """One page of a rollout's spans, oldest first (newest with ``descending``), with their total."""
        selector = _span_selector(
            rollout_id, attempt_id, trace_id, span_id, parent_span_id, name, name_contains
        )
        request = pb.ListSpansRequest(
            selector=selector, order=_order(descending), page_size=page_size, page_token=page_token
        )
        return await self._page("ListSpans", request, "spans", convert.span_from_pb)

    async def tail_spans(
        self, rollout_id: str, attempt_id: str | None = None, *, follow: bool = False
    ) -> AsyncIterator[list[t.Span]]:
        """Batches of a rollout's spans in order; with ``follow``, new ones as they arrive."""
        request = pb.TailSpansRequest(
            selector=pb.SpanSelector(rollout_id=rollout_id, attempt_id=attempt_id or ""), follow=follow
        )
        call = self._stub.TailSpans(
            request, metadata=self._metadata, timeout=None if follow else self.config.timeout
        )
        try:
            async for resp in call:
                yield [convert.span_from_pb(s) for s in resp.spans]
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str, count: int = 1) -> int:
        resp = await self._call(
            "GetNextSpanSequenceId",
            pb.GetNextSpanSequenceIdRequest(rollout_id=rollout_id, attempt_id=attempt_id, count=count),
        )
        return int(resp.sequence_id)

    # ------------------------------------------------------------ resources
    async def add_resources(
        self, resources: Mapping[str, t.Resource], resources_id: str = ""
    ) -> t.ResourcesUpdate:
        request = pb.AddResourcesRequest(resources_id=resources_id or f"rs-{uuid.uuid4().hex[:16]}")
        for name, r in resources.items():
            convert.resource_to_pb(r, request.resources[name])
        resp = await self._call("AddResources", request)
        return convert.resources_update_from_pb(resp.resources)

    async def update_resources(
        self, resources_id: str, resources: Mapping[str, t.Resource], *, expected_version: int = 0
    ) -> t.ResourcesUpdate:
        request = pb.UpdateResourcesRequest(resources_id=resources_id, expected_version=expected_version)
        for name, r in resources.items():
            convert.resource_to_pb(r, request.resources[name])
        resp = await self._call("UpdateResources", request)
        return convert.resources_update_from_pb(resp.resources)

    async def get_resources(self, resources_id: str) -> t.ResourcesUpdate:
        resp = await self._call("GetResources", pb.GetResourcesRequest(resources_id=resources_id))
        return convert.resources_update_from_pb(resp.resources)

    async def get_resources_by_id(self, resources_id: str) -> t.ResourcesUpdate | None:
        try:
            return await self.get_resources(resources_id)
        except NotFoundError:
            return None

    async def get_latest_resources(self) -> t.ResourcesUpdate | None:
        resp = await self._call("GetLatestResources", pb.GetLatestResourcesRequest())
        return convert.resources_update_from_pb(resp.resources) if resp.HasField("resources") else None

    async def query_resources(
        self, *, resources_id_contains: str = "", descending: bool = False, limit: int | None = None
    ) -> list[t.ResourcesUpdate]:
        request = pb.ListResourcesRequest(
            resources_id_contains=resources_id_contains,
            order=_order(descending),
            page_size=1000,
        )
        return await self._all_pages(
            "ListResources", request, "resources", convert.resources_update_from_pb, limit
        )

    async def list_resources(
        self,
        *,
        resources_id_contains: str = "",
        descending: bool = False,
        page_size: int = 0,
        page_token: str = "",
    ) -> t.Page:
        """One page of resources sets (``total_size``: all that match)."""
        request = pb.ListResourcesRequest(
            resources_id_contains=resources_id_contains,
            order=_order(descending),
            page_size=page_size,
            page_token=page_token,
        )
        return await self._page("ListResources", request, "resources", convert.resources_update_from_pb)

    # ------------------------------------------------------------ workers
    async def update_worker(
        self, worker_id: str, heartbeat_stats: Mapping[str, Any] | None = None
    ) -> t.Worker:
        """Worker heartbeat (creates the worker on first call); replaces its stats when given."""
        request = pb.HeartbeatWorkerRequest(worker_id=worker_id)
        if heartbeat_stats is not None:
            convert.dict_to_struct(heartbeat_stats, request.heartbeat_stats, "heartbeat_stats")
        resp = await self._call("HeartbeatWorker", request)
        return convert.worker_from_pb(resp.worker)

    heartbeat_worker = update_worker

    async def get_worker_by_id(self, worker_id: str) -> t.Worker | None:
        try:
            resp = await self._call("GetWorker", pb.GetWorkerRequest(worker_id=worker_id))
        except NotFoundError:
            return None
        return convert.worker_from_pb(resp.worker)

    async def query_workers(
        self,
        *,
        status_in: Iterable[t.WorkerStatus | str | int] = (),
        worker_id_contains: str = "",
        order_by: str = "",
        descending: bool = False,
        limit: int | None = None,
    ) -> list[t.Worker]:
        request = pb.ListWorkersRequest(
            statuses=[int(_enum(t.WorkerStatus, s)) for s in status_in],  # type: ignore[misc]
            worker_id_contains=worker_id_contains,
            order_by=order_by,
            order=_order(descending),
            page_size=1000,
        )
        return await self._all_pages("ListWorkers", request, "workers", convert.worker_from_pb, limit)

    async def list_workers(
        self,
        *,
        status_in: Iterable[t.WorkerStatus | str | int] = (),
        worker_id_contains: str = "",
        order_by: str = "",
        descending: bool = False,
        page_size: int = 0,
        page_token: str = "",
    ) -> t.Page:
        """One page of workers, by ``order_by`` (worker_id, status, last_heartbeat_time, last_dequeue_time)."""
        request = pb.ListWorkersRequest(
            statuses=[int(_enum(t.WorkerStatus, s)) for s in status_in],  # type: ignore[misc]
            worker_id_contains=worker_id_contains,
            order_by=order_by,
            order=_order(descending),
            page_size=page_size,
            page_token=page_token,
        )
        return await self._page("ListWorkers", request, "workers", convert.worker_from_pb)

    # ------------------------------------------------------------ waiting
    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], timeout: float | None = None
    ) -> list[t.Rollout]:
        """The finished rollouts among ``rollout_ids`` once all finish or ``timeout`` passes (None: no limit)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = 3600.0 if deadline is None else max(0.0, deadline - loop.time())
            chunk = min(remaining, 3600.0)
            request = pb.WaitForRolloutsRequest(rollout_ids=list(rollout_ids))
            if chunk > 0:
                convert.float_to_duration(chunk, request.timeout)
            resp = await self._call("WaitForRollouts", request, timeout=chunk + self.config.timeout)
            done = [convert.rollout_from_pb(r) for r in resp.rollouts]
            if len(done) >= len(set(rollout_ids)) or (deadline is not None and loop.time() >= deadline):
                return done

    async def watch_rollouts(
        self,
        resume_token: str = "",
        *,
        rollout_ids: Iterable[str] = (),
        status_in: Iterable[t.RolloutStatus | str | int] = (),
        progress_interval: float | None = None,
        include_progress: bool = False,
    ) -> AsyncIterator[WatchEvent]:
        """Rollout changes as they are committed; reconnects from the last token if the server goes away."""
        token = resume_token
        ids = list(rollout_ids)
        statuses = [int(_enum(t.RolloutStatus, s)) for s in status_in]
        while True:
            request = pb.WatchRolloutsRequest(resume_token=token, rollout_ids=ids, statuses=statuses)  # type: ignore[arg-type]
            if progress_interval:
                convert.float_to_duration(progress_interval, request.progress_interval)
            call = self._stub.WatchRollouts(request, metadata=self._metadata)
            try:
                async for resp in call:
                    token = resp.resume_token
                    rollout = convert.rollout_from_pb(resp.rollout) if resp.HasField("rollout") else None
                    if rollout is not None or include_progress:
                        yield WatchEvent(rollout, resp.resume_token, resp.revision)
                return
            except grpc.aio.AioRpcError as exc:
                err = from_rpc_error(exc)
                if isinstance(err, UnavailableError) and token:
                    await asyncio.sleep(0.2)
                    continue
                raise err from None
            finally:
                call.cancel()

    # ------------------------------------------------------------ statistics and housekeeping
    async def statistics(self) -> t.Statistics:
        resp = await self._call("GetStatistics", pb.GetStatisticsRequest())
        return t.Statistics(
            rollouts_by_status={
                k.removeprefix("ROLLOUT_STATUS_").lower(): v for k, v in resp.rollouts_by_status.items()
            },
            total_rollouts=resp.total_rollouts,
            total_attempts=resp.total_attempts,
            total_spans=resp.total_spans,
            total_resources=resp.total_resources,
            total_workers=resp.total_workers,
            uptime=convert.duration_to_float(resp.uptime) or 0.0,
            backend=resp.backend,
            memory_bytes=resp.memory_bytes,
            storage_bytes=resp.storage_bytes,
            queue_length=resp.queue_length,
        )

    async def delete_rollouts(
        self, rollout_ids: Sequence[str] = (), *, finished_before: float | None = None
    ) -> t.DeleteResult:
        request = pb.DeleteRolloutsRequest(rollout_ids=list(rollout_ids))
        if finished_before is not None:
            convert.set_ts(request.finished_before, finished_before)
        resp = await self._call("DeleteRollouts", request)
        return t.DeleteResult(resp.deleted_rollouts, resp.deleted_attempts, resp.deleted_spans)


__all__ = [
    "AddSpansResult",
    "AttemptHeartbeat",
    "LightningError",
    "StoreClient",
    "WatchEvent",
    "make_channel",
]
