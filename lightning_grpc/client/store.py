"""StoreClient: the friendly face of the StoreService stubs, returning plain Python objects.

Every method raises a subclass of :class:`lightning_grpc.errors.LightningError` when a call fails.
Methods whose RPC the contract marks safe to repeat are retried by the channel on UNAVAILABLE
(:data:`lightning_grpc.client.config.RETRYABLE_METHODS`); each method's docstring says whether it is.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from lightning_grpc import convert
from lightning_grpc import types as t
from lightning_grpc.convert.store import statistics_from_pb
from lightning_grpc.errors import InvalidArgumentError, NotFoundError, UnavailableError
from lightning_grpc.types import AddSpansResult, AttemptHeartbeat, WatchEvent
from lightning_grpc.v1 import common_pb2, span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc

from .arguments import enum_member
from .channel import call_metadata, make_channel
from .config import ClientConfig, RetryConfig, TlsConfig
from .errors import from_rpc_error
from .runner_calls import RunnerCalls

if TYPE_CHECKING:
    from .session import RunnerSession

T = TypeVar("T")

#: The defaults of a :class:`ClientConfig`, shown in the clients' signatures.
_DEFAULTS = ClientConfig()


class _Unset(enum.Enum):
    """The marker of a keyword argument left out (where None is a value of its own)."""

    UNSET = enum.auto()


_UNSET = _Unset.UNSET


def client_config(
    target: str | ClientConfig,
    *,
    token: str | None,
    tls: TlsConfig | None,
    retry: RetryConfig | None,
    timeout: float,
    gzip: bool,
    keepalive_seconds: float,
) -> ClientConfig:
    """The configuration of a client: ``target`` itself when it is one, else one built from the options."""
    if isinstance(target, ClientConfig):
        return target
    return ClientConfig(
        target=target,
        token=token,
        tls=tls,
        retry=retry,
        timeout=timeout,
        gzip=gzip,
        keepalive_seconds=keepalive_seconds,
    )


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
        mode=enum_member(t.RolloutMode, mode) if mode is not None else t.RolloutMode.UNSPECIFIED,
        resources_id=resources_id,
        group_id=group_id,
        config=config or t.RolloutConfig(),
        metadata=dict(metadata or {}),
    )


class StoreClient(RunnerCalls):
    """Async client of the StoreService. Create it inside the event loop that uses it.

    Every method raises a subclass of :class:`lightning_grpc.errors.LightningError` on failure:
    :class:`~lightning_grpc.errors.NotFoundError` for unknown ids (except the ``get_*_by_id`` helpers,
    which return None), :class:`~lightning_grpc.errors.InvalidArgumentError` for refused arguments,
    :class:`~lightning_grpc.errors.UnavailableError` when the store cannot be reached (after the
    retries, for the methods that are retried), :class:`~lightning_grpc.errors.UnauthenticatedError` or
    :class:`~lightning_grpc.errors.PermissionDeniedError` when the token does not allow the call.

    Args:
        target: The store's address (``host:port``), or a whole :class:`ClientConfig` (then the
            other arguments are ignored).
        token: The bearer token sent with every call.
        tls: TLS settings; None for a plaintext channel.
        retry: The retry policy of the idempotent methods; None turns retries off.
        timeout: The default deadline of a call, in seconds (long-polls add their wait on top).
        gzip: Compress messages with gzip.
        keepalive_seconds: The interval of the channel's keepalive pings.
    """

    def __init__(
        self,
        target: str | ClientConfig = _DEFAULTS.target,
        *,
        token: str | None = _DEFAULTS.token,
        tls: TlsConfig | None = _DEFAULTS.tls,
        retry: RetryConfig | None = _DEFAULTS.retry,
        timeout: float = _DEFAULTS.timeout,
        gzip: bool = _DEFAULTS.gzip,
        keepalive_seconds: float = _DEFAULTS.keepalive_seconds,
    ) -> None:
        self.config = client_config(
            target,
            token=token,
            tls=tls,
            retry=retry,
            timeout=timeout,
            gzip=gzip,
            keepalive_seconds=keepalive_seconds,
        )
        self._channel = make_channel(self.config)
        self._stub = pb_grpc.StoreServiceStub(self._channel)
        self._metadata = call_metadata(self.config)

    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled."""
        await self._channel.close()

    async def wait_until_reachable(self, timeout: float) -> None:
        """Return once a connection to the store is up.

        Args:
            timeout: How long to wait, in seconds.

        Raises:
            UnavailableError: No connection within ``timeout`` seconds (reason ``STORE_UNREACHABLE``).
        """
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

    def runner_session(self) -> RunnerSession:
        """A :class:`~lightning_grpc.client.session.RunnerSession`: this client's claims, heartbeats and
        reports (``dequeue_rollouts``, ``heartbeat_attempt``, ``complete_attempt``, ``complete_and_dequeue``)
        over one stream instead of one call each. Use it as ``async with client.runner_session() as s``."""
        from .session import RunnerSession

        return RunnerSession(self.config, self._stub, self._metadata, self._call)

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
    async def start_rollout(
        self,
        input: Any,
        *,
        worker_id: str = "",
        rollout_id: str = "",
        mode: t.RolloutMode | str | int | None = None,
        resources_id: str = "",
        group_id: str = "",
        config: t.RolloutConfig | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> t.Rollout:
        """Create a rollout and its first attempt at once, skipping the queue.

        Retried on UNAVAILABLE: the rollout id is chosen here when not given, so a retry creates
        nothing twice.

        Args:
            input: The task input (any JSON value).
            worker_id: The worker that runs the attempt.
            rollout_id: The rollout's id; generated (``ro-...``) when empty.
            mode: train, val or test (a :class:`RolloutMode`, its name or its number).
            resources_id: The resources set the rollout runs with.
            group_id: The GRPO group the rollout belongs to.
            config: Timeouts and retries of the rollout's attempts.
            metadata: Free-form JSON metadata.

        Returns:
            The rollout, RUNNING, with its ``latest_attempt``.

        Raises:
            InvalidArgumentError: A refused input, mode, config or metadata.
            AlreadyExistsError: ``rollout_id`` names a rollout with other content.
            NotFoundError: ``resources_id`` names no resources set.
        """
        request = pb.StartRolloutRequest(worker_id=worker_id)
        spec = _spec(
            input,
            rollout_id=rollout_id,
            mode=mode,
            resources_id=resources_id,
            group_id=group_id,
            config=config,
            metadata=metadata,
        )
        convert.spec_to_pb(spec, request.rollout)
        resp = await self._call("StartRollout", request)
        return convert.rollout_from_pb(resp.rollout)

    async def enqueue_rollout(
        self,
        input: Any,
        *,
        rollout_id: str = "",
        mode: t.RolloutMode | str | int | None = None,
        resources_id: str = "",
        group_id: str = "",
        config: t.RolloutConfig | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> t.Rollout:
        """Queue one rollout for a worker to claim (see :meth:`enqueue_rollouts`).

        Retried on UNAVAILABLE (the rollout id is chosen here when not given).

        Args:
            input: The task input (any JSON value).
            rollout_id: The rollout's id; generated (``ro-...``) when empty.
            mode: train, val or test (a :class:`RolloutMode`, its name or its number).
            resources_id: The resources set the rollout runs with.
            group_id: The GRPO group the rollout belongs to.
            config: Timeouts and retries of the rollout's attempts.
            metadata: Free-form JSON metadata.

        Returns:
            The rollout, QUEUING.

        Raises:
            InvalidArgumentError: A refused input, mode, config or metadata.
            AlreadyExistsError: ``rollout_id`` names a rollout with other content.
        """
        spec = _spec(
            input,
            rollout_id=rollout_id,
            mode=mode,
            resources_id=resources_id,
            group_id=group_id,
            config=config,
            metadata=metadata,
        )
        return (await self.enqueue_rollouts([spec]))[0]

    async def enqueue_rollouts(self, specs: Sequence[t.RolloutSpec | Mapping[str, Any]]) -> list[t.Rollout]:
        """Queue rollouts in one commit.

        Retried on UNAVAILABLE (rollout ids left empty are chosen here).

        Args:
            specs: :class:`RolloutSpec` objects, or mappings of the keyword arguments of
                :meth:`enqueue_rollout` (``input`` included).

        Returns:
            The rollouts, QUEUING, in the order of ``specs``.

        Raises:
            InvalidArgumentError: A refused spec (the field names its index); nothing is queued.
            AlreadyExistsError: A rollout id taken by a rollout with other content.
        """
        request = pb.EnqueueRolloutsRequest()
        for spec in specs:
            s = spec if isinstance(spec, t.RolloutSpec) else _spec(**spec)
            if not s.rollout_id:
                s = t.RolloutSpec(**{**s.__dict__, "rollout_id": f"ro-{uuid.uuid4().hex[:16]}"})
            convert.spec_to_pb(s, request.rollouts.add())
        resp = await self._call("EnqueueRollouts", request)
        return [convert.rollout_from_pb(r) for r in resp.rollouts]

    async def start_attempt(self, rollout_id: str, *, worker_id: str = "") -> t.Rollout:
        """Start a new attempt of a rollout now, outside the queue.

        Not retried: a repeated call would start another attempt.

        Args:
            rollout_id: The rollout.
            worker_id: The worker that runs the attempt.

        Returns:
            The rollout with its new ``latest_attempt``.

        Raises:
            NotFoundError: No such rollout.
            FailedPreconditionError: The rollout has finished.
        """
        resp = await self._call(
            "StartAttempt", pb.StartAttemptRequest(rollout_id=rollout_id, worker_id=worker_id)
        )
        return convert.rollout_from_pb(resp.rollout)

    async def update_rollout(
        self,
        rollout_id: str,
        *,
        input: Any = _UNSET,
        mode: t.RolloutMode | str | int | None = None,
        resources_id: str | None = None,
        group_id: str | None = None,
        config: t.RolloutConfig | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> t.Rollout:
        """Change fields of a rollout; only the fields given change. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            input: The new input (None is a value: JSON null); left out, the input stays.
            mode: The new mode (None: unchanged).
            resources_id: The new resources set (None: unchanged).
            group_id: The new group (None: unchanged).
            config: The new config (None: unchanged).
            metadata: The new metadata, replacing the old (None: unchanged; ``{}`` clears it).

        Returns:
            The updated rollout.

        Raises:
            NotFoundError: No such rollout, or no such resources set.
            InvalidArgumentError: A refused value.
        """
        request = pb.UpdateRolloutRequest(rollout_id=rollout_id)
        if input is not _UNSET:
            convert.python_to_value(input, request.input, "input")
            request.update_mask.paths.append("input")
        if mode is not None:
            request.mode = int(enum_member(t.RolloutMode, mode))  # type: ignore[assignment]
            request.update_mask.paths.append("mode")
        if resources_id is not None:
            request.resources_id = resources_id
            request.update_mask.paths.append("resources_id")
        if group_id is not None:
            request.group_id = group_id
            request.update_mask.paths.append("group_id")
        if config is not None:
            convert.config_to_pb(config, request.config)
            request.update_mask.paths.append("config")
        if metadata is not None:
            convert.dict_to_struct(metadata, request.metadata, "metadata")
            request.update_mask.paths.append("metadata")
        resp = await self._call("UpdateRollout", request)
        return convert.rollout_from_pb(resp.rollout)

    async def cancel_rollout(self, rollout_id: str, reason: str = "") -> t.Rollout:
        """Cancel a rollout; its running attempt is told to stop. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            reason: Why, kept as the rollout's status message.

        Returns:
            The rollout, CANCELLED (or as it was, if it had already finished).

        Raises:
            NotFoundError: No such rollout.
        """
        resp = await self._call(
            "CancelRollout", pb.CancelRolloutRequest(rollout_id=rollout_id, reason=reason)
        )
        return convert.rollout_from_pb(resp.rollout)

    async def retry_rollout(self, rollout_id: str, reason: str = "") -> t.Rollout:
        """End the rollout's stuck attempt (FAILED, with ``reason``) and queue it for a new one.

        Not retried: a repeated call would end the next attempt too.

        Args:
            rollout_id: The rollout.
            reason: Why, kept as the ended attempt's status message.

        Returns:
            The rollout, requeued.

        Raises:
            NotFoundError: No such rollout.
            FailedPreconditionError: The rollout has finished, or has no attempt running.
        """
        resp = await self._call("RetryRollout", pb.RetryRolloutRequest(rollout_id=rollout_id, reason=reason))
        return convert.rollout_from_pb(resp.rollout)

    async def get_rollout(self, rollout_id: str) -> t.Rollout:
        """One rollout, with its latest attempt. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.

        Returns:
            The rollout.

        Raises:
            NotFoundError: No such rollout.
        """
        resp = await self._call("GetRollout", pb.GetRolloutRequest(rollout_id=rollout_id))
        return convert.rollout_from_pb(resp.rollout)

    async def get_rollout_by_id(self, rollout_id: str) -> t.Rollout | None:
        """One rollout, or None when there is no such rollout. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.

        Returns:
            The rollout, or None.
        """
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
        """One page of rollouts; the filters given must all hold, or with ``match_any`` one of them.

        Retried on UNAVAILABLE.

        Args:
            status_in: Only rollouts in one of these statuses.
            rollout_ids: Only these rollouts.
            rollout_id_contains: Only rollouts whose id contains this text.
            mode: Only rollouts of this mode.
            group_id: Only rollouts of this group.
            order_by: The field to sort by (the store's default order when empty).
            descending: Sort newest (largest) first.
            page_size: The most rollouts on the page (0: the server's default).
            page_token: The ``next_page_token`` of the previous page.
            match_any: Keep rollouts that match any of the filters given, not all.

        Returns:
            The page: its rollouts, the token of the next page and the number of matches in all pages.

        Raises:
            InvalidArgumentError: A refused filter, order or page token.
        """
        request = pb.ListRolloutsRequest(
            statuses=[int(enum_member(t.RolloutStatus, s)) for s in status_in],  # type: ignore[misc]
            rollout_ids=list(rollout_ids),
            rollout_id_contains=rollout_id_contains,
            mode=int(enum_member(t.RolloutMode, mode)) if mode is not None else 0,  # type: ignore[arg-type]
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

    async def query_rollouts(
        self,
        *,
        status_in: Iterable[t.RolloutStatus | str | int] = (),
        rollout_ids: Iterable[str] = (),
        rollout_id_contains: str = "",
        mode: t.RolloutMode | str | int | None = None,
        group_id: str = "",
        order_by: str = "",
        descending: bool = False,
        match_any: bool = False,
    ) -> list[t.Rollout]:
        """Every rollout matching the filters of :meth:`list_rollouts`, across all pages.

        Each page's call is retried on UNAVAILABLE.

        Args:
            status_in: Only rollouts in one of these statuses.
            rollout_ids: Only these rollouts.
            rollout_id_contains: Only rollouts whose id contains this text.
            mode: Only rollouts of this mode.
            group_id: Only rollouts of this group.
            order_by: The field to sort by (the store's default order when empty).
            descending: Sort newest (largest) first.
            match_any: Keep rollouts that match any of the filters given, not all.

        Returns:
            The rollouts.

        Raises:
            InvalidArgumentError: A refused filter or order.
        """
        statuses, ids = list(status_in), list(rollout_ids)
        out: list[t.Rollout] = []
        token = ""
        while True:
            page = await self.list_rollouts(
                status_in=statuses,
                rollout_ids=ids,
                rollout_id_contains=rollout_id_contains,
                mode=mode,
                group_id=group_id,
                order_by=order_by,
                descending=descending,
                match_any=match_any,
                page_size=1000,
                page_token=token,
            )
            out.extend(page.items)
            token = page.next_page_token
            if not token:
                return out

    # ------------------------------------------------------------ attempts
    async def get_latest_attempt(self, rollout_id: str) -> t.Attempt | None:
        """A rollout's latest attempt. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.

        Returns:
            The attempt, or None when the rollout has none yet.

        Raises:
            NotFoundError: No such rollout.
        """
        resp = await self._call("GetLatestAttempt", pb.GetLatestAttemptRequest(rollout_id=rollout_id))
        return convert.attempt_from_pb(resp.attempt) if resp.HasField("attempt") else None

    async def query_attempts(
        self, rollout_id: str, *, descending: bool = False, limit: int | None = None
    ) -> list[t.Attempt]:
        """A rollout's attempts by sequence number, across all pages. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            descending: Latest first.
            limit: The most attempts to return (None: all).

        Returns:
            The attempts.

        Raises:
            NotFoundError: No such rollout.
            InvalidArgumentError: A negative ``limit``.
        """
        request = pb.ListAttemptsRequest(rollout_id=rollout_id, order=_order(descending), page_size=1000)
        return await self._all_pages("ListAttempts", request, "attempts", convert.attempt_from_pb, limit)

    async def list_attempts(
        self, rollout_id: str, *, descending: bool = False, page_size: int = 0, page_token: str = ""
    ) -> t.Page:
        """One page of a rollout's attempts (``total_size``: all of them). Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            descending: Latest first.
            page_size: The most attempts on the page (0: the server's default).
            page_token: The ``next_page_token`` of the previous page.

        Returns:
            The page of attempts.

        Raises:
            NotFoundError: No such rollout.
            InvalidArgumentError: A refused page token.
        """
        request = pb.ListAttemptsRequest(
            rollout_id=rollout_id, order=_order(descending), page_size=page_size, page_token=page_token
        )
        return await self._page("ListAttempts", request, "attempts", convert.attempt_from_pb)

    # ------------------------------------------------------------ spans
    async def add_spans(
        self,
        spans: Iterable[t.Span | span_pb2.Span],
        *,
        rollout_id: str = "",
        attempt_id: str = "",
    ) -> AddSpansResult:
        """Store spans in one commit. Retried on UNAVAILABLE: spans are keyed by span id.

        Args:
            spans: The spans (domain objects or ``lightning.v1.Span`` messages).
            rollout_id: The rollout of spans that do not name one.
            attempt_id: The attempt of spans that do not name one.

        Returns:
            Each span's sequence id, in order, and how many were stored or already there.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A malformed span (the field names its index).
            ResourceExhaustedError: The store is full, or the request too large.
        """
        request = pb.AddSpansRequest(rollout_id=rollout_id, attempt_id=attempt_id)
        for s in spans:
            if isinstance(s, span_pb2.Span):
                request.spans.append(s)
            else:
                convert.span_to_pb(s, request.spans.add())
        resp = await self._call("AddSpans", request)
        return AddSpansResult(list(resp.sequence_ids), resp.stored_count, resp.duplicate_count)

    async def add_span(self, span: t.Span | span_pb2.Span) -> int:
        """Store one span (see :meth:`add_spans`). Retried on UNAVAILABLE.

        Args:
            span: The span; it names its rollout and attempt.

        Returns:
            Its sequence id.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A malformed span.
        """
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
        """The spans of a rollout, across all pages. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            attempt_id: None for all attempts, "latest", or an attempt id.
            trace_id: Only spans of this trace.
            span_id: Only this span.
            parent_span_id: Only children of this span.
            name: Only spans of this name.
            name_contains: Only spans whose name contains this text.
            limit: The most spans to return (None: all).

        Returns:
            The spans, in sequence order.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A negative ``limit``.
        """
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
        """One page of a rollout's spans, oldest first, with their total. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            attempt_id: None for all attempts, "latest", or an attempt id.
            trace_id: Only spans of this trace.
            span_id: Only this span.
            parent_span_id: Only children of this span.
            name: Only spans of this name.
            name_contains: Only spans whose name contains this text.
            descending: Newest first.
            page_size: The most spans on the page (0: the server's default).
            page_token: The ``next_page_token`` of the previous page.

        Returns:
            The page of spans.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A refused page token.
        """
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
        """Batches of a rollout's spans in order; with ``follow``, new ones as they arrive.

        Not retried (a stream): on UNAVAILABLE call again.

        Args:
            rollout_id: The rollout.
            attempt_id: None for all attempts, "latest", or an attempt id.
            follow: Keep the stream open for new spans (no deadline).

        Yields:
            Lists of spans.

        Raises:
            NotFoundError: No such rollout or attempt.
        """
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
        """Reserve sequence ids for spans of an attempt.

        Not retried: a repeated call would reserve more.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.
            count: How many ids to reserve.

        Returns:
            The first reserved id.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A refused ``count``.
        """
        resp = await self._call(
            "GetNextSpanSequenceId",
            pb.GetNextSpanSequenceIdRequest(rollout_id=rollout_id, attempt_id=attempt_id, count=count),
        )
        return int(resp.sequence_id)

    # ------------------------------------------------------------ resources
    async def add_resources(
        self, resources: Mapping[str, t.Resource], resources_id: str = ""
    ) -> t.ResourcesUpdate:
        """Store a resources set (version 1); it becomes the latest. Retried on UNAVAILABLE.

        Args:
            resources: The resources by name (LLMs, prompt templates, JSON values).
            resources_id: The set's id; generated (``rs-...``) when empty, so a retry adds it once.

        Returns:
            The stored set.

        Raises:
            InvalidArgumentError: A refused resource.
            AlreadyExistsError: ``resources_id`` names a set with other content.
        """
        request = pb.AddResourcesRequest(resources_id=resources_id or f"rs-{uuid.uuid4().hex[:16]}")
        for name, r in resources.items():
            convert.resource_to_pb(r, request.resources[name])
        resp = await self._call("AddResources", request)
        return convert.resources_update_from_pb(resp.resources)

    async def update_resources(
        self, resources_id: str, resources: Mapping[str, t.Resource], *, expected_version: int = 0
    ) -> t.ResourcesUpdate:
        """Replace a resources set's resources (a new version).

        Not retried: a repeat would add another version (use ``expected_version`` to fence).

        Args:
            resources_id: The set.
            resources: The new resources by name.
            expected_version: The version being replaced (0: any).

        Returns:
            The updated set.

        Raises:
            NotFoundError: No such set.
            InvalidArgumentError: A refused resource.
            AbortedError: The set is no longer at ``expected_version``.
        """
        request = pb.UpdateResourcesRequest(resources_id=resources_id, expected_version=expected_version)
        for name, r in resources.items():
            convert.resource_to_pb(r, request.resources[name])
        resp = await self._call("UpdateResources", request)
        return convert.resources_update_from_pb(resp.resources)

    async def get_resources(self, resources_id: str) -> t.ResourcesUpdate:
        """One resources set. Retried on UNAVAILABLE.

        Args:
            resources_id: The set.

        Returns:
            The set.

        Raises:
            NotFoundError: No such set.
        """
        resp = await self._call("GetResources", pb.GetResourcesRequest(resources_id=resources_id))
        return convert.resources_update_from_pb(resp.resources)

    async def get_resources_by_id(self, resources_id: str) -> t.ResourcesUpdate | None:
        """One resources set, or None when there is no such set. Retried on UNAVAILABLE.

        Args:
            resources_id: The set.

        Returns:
            The set, or None.
        """
        try:
            return await self.get_resources(resources_id)
        except NotFoundError:
            return None

    async def get_latest_resources(self) -> t.ResourcesUpdate | None:
        """The latest resources set, or None when there is none. Retried on UNAVAILABLE.

        Returns:
            The set, or None.
        """
        resp = await self._call("GetLatestResources", pb.GetLatestResourcesRequest())
        return convert.resources_update_from_pb(resp.resources) if resp.HasField("resources") else None

    async def query_resources(
        self, *, resources_id_contains: str = "", descending: bool = False, limit: int | None = None
    ) -> list[t.ResourcesUpdate]:
        """Every resources set, across all pages. Retried on UNAVAILABLE.

        Args:
            resources_id_contains: Only sets whose id contains this text.
            descending: Newest first.
            limit: The most sets to return (None: all).

        Returns:
            The sets.

        Raises:
            InvalidArgumentError: A negative ``limit``.
        """
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
        """One page of resources sets (``total_size``: all that match). Retried on UNAVAILABLE.

        Args:
            resources_id_contains: Only sets whose id contains this text.
            descending: Newest first.
            page_size: The most sets on the page (0: the server's default).
            page_token: The ``next_page_token`` of the previous page.

        Returns:
            The page of sets.

        Raises:
            InvalidArgumentError: A refused page token.
        """
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
        """A worker's heartbeat: creates the worker on its first call. Retried on UNAVAILABLE.

        Args:
            worker_id: The worker.
            heartbeat_stats: JSON stats replacing the worker's (None: kept as they are).

        Returns:
            The worker.

        Raises:
            InvalidArgumentError: A refused worker id or stats.
            PermissionDeniedError: The token belongs to another worker.
        """
        request = pb.HeartbeatWorkerRequest(worker_id=worker_id)
        if heartbeat_stats is not None:
            convert.dict_to_struct(heartbeat_stats, request.heartbeat_stats, "heartbeat_stats")
        resp = await self._call("HeartbeatWorker", request)
        return convert.worker_from_pb(resp.worker)

    async def get_worker_by_id(self, worker_id: str) -> t.Worker | None:
        """One worker, or None when there is no such worker. Retried on UNAVAILABLE.

        Args:
            worker_id: The worker.

        Returns:
            The worker, or None.
        """
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
        """Every worker matching the filters, across all pages. Retried on UNAVAILABLE.

        Args:
            status_in: Only workers in one of these statuses.
            worker_id_contains: Only workers whose id contains this text.
            order_by: worker_id, status, last_heartbeat_time or last_dequeue_time.
            descending: Largest first.
            limit: The most workers to return (None: all).

        Returns:
            The workers.

        Raises:
            InvalidArgumentError: A refused filter, order or ``limit``.
        """
        request = pb.ListWorkersRequest(
            statuses=[int(enum_member(t.WorkerStatus, s)) for s in status_in],  # type: ignore[misc]
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
        """One page of workers (``total_size``: all that match). Retried on UNAVAILABLE.

        Args:
            status_in: Only workers in one of these statuses.
            worker_id_contains: Only workers whose id contains this text.
            order_by: worker_id, status, last_heartbeat_time or last_dequeue_time.
            descending: Largest first.
            page_size: The most workers on the page (0: the server's default).
            page_token: The ``next_page_token`` of the previous page.

        Returns:
            The page of workers.

        Raises:
            InvalidArgumentError: A refused filter, order or page token.
        """
        request = pb.ListWorkersRequest(
            statuses=[int(enum_member(t.WorkerStatus, s)) for s in status_in],  # type: ignore[misc]
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
        """Wait until the rollouts finish. Each long-poll is retried on UNAVAILABLE.

        Args:
            rollout_ids: The rollouts.
            timeout: The most seconds to wait (None: no limit).

        Returns:
            The finished rollouts among ``rollout_ids``, once all finish or ``timeout`` passes.

        Raises:
            InvalidArgumentError: A refused id list.
        """
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
        """Rollout changes as they are committed, until the server ends the stream.

        Not retried as a call (a stream), but when the server goes away (UNAVAILABLE) after an event,
        the watch reconnects from the last resume token by itself.

        Args:
            resume_token: Start after the event of this token ("": from now).
            rollout_ids: Only these rollouts.
            status_in: Only changes into one of these statuses.
            progress_interval: Ask for progress events (no rollout, a fresh token) this often, in seconds.
            include_progress: Yield the progress events too.

        Yields:
            Each change: the rollout, its resume token and the store's revision.

        Raises:
            InvalidArgumentError: A refused filter or resume token.
            UnavailableError: The store went away before the first event.
        """
        token = resume_token
        ids = list(rollout_ids)
        statuses = [int(enum_member(t.RolloutStatus, s)) for s in status_in]
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
        """The store's counts, backend and sizes. Retried on UNAVAILABLE.

        The keys of ``rollouts_by_status`` are lower-case status names ("queuing"), as
        :meth:`lightning_grpc.client.local.LocalStoreClient.statistics` answers them.

        Returns:
            The statistics.

        Raises:
            PermissionDeniedError: The token is not an admin's.
        """
        resp = await self._call("GetStatistics", pb.GetStatisticsRequest())
        return statistics_from_pb(resp)

    async def delete_rollouts(
        self, rollout_ids: Sequence[str] = (), *, finished_before: float | None = None
    ) -> t.DeleteResult:
        """Delete finished rollouts, with their attempts and spans.

        Not retried (the answer's counts would be lost on a repeat).

        Args:
            rollout_ids: These rollouts.
            finished_before: Every rollout that ended before this time (seconds since the epoch).

        Returns:
            How many rollouts, attempts and spans were deleted.

        Raises:
            InvalidArgumentError: Neither ids nor a time given.
            NotFoundError: No such rollout.
            FailedPreconditionError: A rollout has not finished.
        """
        request = pb.DeleteRolloutsRequest(rollout_ids=list(rollout_ids))
        if finished_before is not None:
            convert.set_ts(request.finished_before, finished_before)
        resp = await self._call("DeleteRollouts", request)
        return t.DeleteResult(resp.deleted_rollouts, resp.deleted_attempts, resp.deleted_spans)


__all__ = [
    "AddSpansResult",
    "AttemptHeartbeat",
    "StoreClient",
    "WatchEvent",
]
