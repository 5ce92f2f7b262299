"""Blocking clients, for scripts and notebooks: every method of the async client, typed.

:class:`SyncStoreClient` and :class:`SyncTrainerClient` run an async client on an event loop of their
own, on a thread of their own, and block until each call returns. Their methods have the async
clients' signatures, documentation, errors and retries. A streaming method returns a list: the
items seen until the stream ends (use ``follow=False``), so prefer the async client for those.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from lightning_grpc import types as t
from lightning_grpc.batching import BatchOptions, Layout, TrainingEvent
from lightning_grpc.batching.core import TrainerStatus
from lightning_grpc.batching.options import Aggregation, FailurePolicy, PromptOverflow, RewardMatch
from lightning_grpc.types import AddSpansResult, AttemptHeartbeat, WatchEvent
from lightning_grpc.v1 import span_pb2

from .channel import close_loop
from .config import ClientConfig, RetryConfig, TlsConfig
from .store import _DEFAULTS, _UNSET, StoreClient, client_config
from .trainer import RolloutTripletReport, SubmittedGroup, TrainerClient, TrainingBatch

T = TypeVar("T")

__all__ = ["SyncStoreClient", "SyncTrainerClient"]


class _BlockingLoop:
    """An event loop on a daemon thread of its own, and the means to run coroutines on it to the end."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lightning-sync-client", daemon=True
        )
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _collect(self, items: AsyncIterator[T]) -> list[T]:
        async def collect() -> list[T]:
            return [item async for item in items]

        return self._run(collect())

    def _stop(self, close: Coroutine[Any, Any, None]) -> None:
        if self._loop.is_running():
            self._run(close)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            close_loop(self._loop)
        else:
            close.close()


class SyncStoreClient(_BlockingLoop):
    """A blocking :class:`~lightning_grpc.client.StoreClient`: the same methods, each returning its result.

    Use it as a context manager, or call :meth:`close` when done.

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
        config = client_config(
            target,
            token=token,
            tls=tls,
            retry=retry,
            timeout=timeout,
            gzip=gzip,
            keepalive_seconds=keepalive_seconds,
        )
        super().__init__()

        async def make() -> StoreClient:  # the channel belongs to the loop it is made in
            return StoreClient(config)

        self._client = self._run(make())

    @property
    def config(self) -> ClientConfig:
        """How this client reaches the store."""
        return self._client.config

    def close(self) -> None:
        """Close the channel and stop the client's event loop; the client cannot be used after."""
        self._stop(self._client.close())

    def __enter__(self) -> SyncStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_until_reachable(self, timeout: float) -> None:
        """Return once a connection to the store is up.

        Args:
            timeout: How long to wait, in seconds.

        Raises:
            UnavailableError: No connection within ``timeout`` seconds (reason ``STORE_UNREACHABLE``).
        """
        return self._run(self._client.wait_until_reachable(timeout))

    def start_rollout(
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
        return self._run(
            self._client.start_rollout(
                input,
                worker_id=worker_id,
                rollout_id=rollout_id,
                mode=mode,
                resources_id=resources_id,
                group_id=group_id,
                config=config,
                metadata=metadata,
            )
        )

    def enqueue_rollout(
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
        return self._run(
            self._client.enqueue_rollout(
                input,
                rollout_id=rollout_id,
                mode=mode,
                resources_id=resources_id,
                group_id=group_id,
                config=config,
                metadata=metadata,
            )
        )

    def enqueue_rollouts(self, specs: Sequence[t.RolloutSpec | Mapping[str, Any]]) -> list[t.Rollout]:
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
        return self._run(self._client.enqueue_rollouts(specs))

    def dequeue_rollouts(
        self, limit: int = 1, *, worker_id: str = "", wait: float | None = None
    ) -> list[t.Rollout]:
        """Claim queued rollouts: each gets a new attempt, RUNNING, owned by ``worker_id``.

        Retried on UNAVAILABLE: a request id is sent along, so a retry returns the same claims.

        Args:
            limit: The most rollouts to claim.
            worker_id: The claiming worker.
            wait: How long to wait for a rollout when the queue is empty, in seconds (None: not at all).

        Returns:
            The claimed rollouts (empty when none came in time).

        Raises:
            InvalidArgumentError: A refused ``limit`` or ``wait``.
        """
        return self._run(self._client.dequeue_rollouts(limit, worker_id=worker_id, wait=wait))

    def dequeue_rollout(self, *, worker_id: str = "", wait: float | None = None) -> t.Rollout | None:
        """Claim one queued rollout (see :meth:`dequeue_rollouts`). Retried on UNAVAILABLE.

        Args:
            worker_id: The claiming worker.
            wait: How long to wait for a rollout when the queue is empty, in seconds (None: not at all).

        Returns:
            The claimed rollout, or None when none came in time.

        Raises:
            InvalidArgumentError: A refused ``wait``.
        """
        return self._run(self._client.dequeue_rollout(worker_id=worker_id, wait=wait))

    def start_attempt(self, rollout_id: str, *, worker_id: str = "") -> t.Rollout:
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
        return self._run(self._client.start_attempt(rollout_id, worker_id=worker_id))

    def update_rollout(
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
        return self._run(
            self._client.update_rollout(
                rollout_id,
                input=input,
                mode=mode,
                resources_id=resources_id,
                group_id=group_id,
                config=config,
                metadata=metadata,
            )
        )

    def cancel_rollout(self, rollout_id: str, reason: str = "") -> t.Rollout:
        """Cancel a rollout; its running attempt is told to stop. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            reason: Why, kept as the rollout's status message.

        Returns:
            The rollout, CANCELLED (or as it was, if it had already finished).

        Raises:
            NotFoundError: No such rollout.
        """
        return self._run(self._client.cancel_rollout(rollout_id, reason))

    def retry_rollout(self, rollout_id: str, reason: str = "") -> t.Rollout:
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
        return self._run(self._client.retry_rollout(rollout_id, reason))

    def get_rollout(self, rollout_id: str) -> t.Rollout:
        """One rollout, with its latest attempt. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.

        Returns:
            The rollout.

        Raises:
            NotFoundError: No such rollout.
        """
        return self._run(self._client.get_rollout(rollout_id))

    def get_rollout_by_id(self, rollout_id: str) -> t.Rollout | None:
        """One rollout, or None when there is no such rollout. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.

        Returns:
            The rollout, or None.
        """
        return self._run(self._client.get_rollout_by_id(rollout_id))

    def list_rollouts(
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
        return self._run(
            self._client.list_rollouts(
                status_in=status_in,
                rollout_ids=rollout_ids,
                rollout_id_contains=rollout_id_contains,
                mode=mode,
                group_id=group_id,
                order_by=order_by,
                descending=descending,
                page_size=page_size,
                page_token=page_token,
                match_any=match_any,
            )
        )

    def query_rollouts(
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
        return self._run(
            self._client.query_rollouts(
                status_in=status_in,
                rollout_ids=rollout_ids,
                rollout_id_contains=rollout_id_contains,
                mode=mode,
                group_id=group_id,
                order_by=order_by,
                descending=descending,
                match_any=match_any,
            )
        )

    def get_latest_attempt(self, rollout_id: str) -> t.Attempt | None:
        """A rollout's latest attempt. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.

        Returns:
            The attempt, or None when the rollout has none yet.

        Raises:
            NotFoundError: No such rollout.
        """
        return self._run(self._client.get_latest_attempt(rollout_id))

    def query_attempts(
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
        return self._run(self._client.query_attempts(rollout_id, descending=descending, limit=limit))

    def list_attempts(
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
        return self._run(
            self._client.list_attempts(
                rollout_id, descending=descending, page_size=page_size, page_token=page_token
            )
        )

    def heartbeat_attempt(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        """Tell the store an attempt is alive; learn whether it should stop. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.

        Returns:
            The attempt, its rollout's status, and whether it was cancelled or should stop.

        Raises:
            NotFoundError: No such rollout or attempt.
        """
        return self._run(self._client.heartbeat_attempt(rollout_id, attempt_id))

    def complete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: t.AttemptStatus | str | int,
        message: str = "",
        metadata: Mapping[str, Any] | None = None,
        *,
        spans: Iterable[t.Span | span_pb2.Span] = (),
    ) -> tuple[t.Attempt, t.Rollout]:
        """Report an attempt's outcome; ``spans`` are stored in the same commit.

        Retried on UNAVAILABLE: the report is fenced by the attempt, so a repeat changes nothing.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.
            status: The outcome (SUCCEEDED, FAILED, ...: an :class:`AttemptStatus`, its name or number).
            message: A status message (why it failed).
            metadata: JSON metadata kept with the attempt.
            spans: Spans stored with the outcome.

        Returns:
            (attempt, rollout) as they are after the report.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A refused status, metadata or span.
            FailedPreconditionError: The attempt has already ended with another outcome.
        """
        return self._run(
            self._client.complete_attempt(rollout_id, attempt_id, status, message, metadata, spans=spans)
        )

    def complete_and_dequeue(
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

        Retried on UNAVAILABLE: a retried call returns the same claims.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.
            status: The outcome (an :class:`AttemptStatus`, its name or number).
            message: A status message (why it failed).
            spans: Spans stored with the outcome.
            worker_id: The worker claiming the next rollouts.
            limit: The most rollouts to claim.
            wait: How long to wait for a rollout when the queue is empty, in seconds (None: not at all).

        Returns:
            (attempt, rollout, next rollouts).

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A refused status, span, ``limit`` or ``wait``.
            FailedPreconditionError: The attempt has already ended with another outcome.
        """
        return self._run(
            self._client.complete_and_dequeue(
                rollout_id,
                attempt_id,
                status,
                message,
                spans=spans,
                worker_id=worker_id,
                limit=limit,
                wait=wait,
            )
        )

    def add_spans(
        self, spans: Iterable[t.Span | span_pb2.Span], *, rollout_id: str = "", attempt_id: str = ""
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
        return self._run(self._client.add_spans(spans, rollout_id=rollout_id, attempt_id=attempt_id))

    def add_span(self, span: t.Span | span_pb2.Span) -> int:
        """Store one span (see :meth:`add_spans`). Retried on UNAVAILABLE.

        Args:
            span: The span; it names its rollout and attempt.

        Returns:
            Its sequence id.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A malformed span.
        """
        return self._run(self._client.add_span(span))

    def query_spans(
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
        return self._run(
            self._client.query_spans(
                rollout_id,
                attempt_id,
                trace_id=trace_id,
                span_id=span_id,
                parent_span_id=parent_span_id,
                name=name,
                name_contains=name_contains,
                limit=limit,
            )
        )

    def list_spans(
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
        return self._run(
            self._client.list_spans(
                rollout_id,
                attempt_id,
                trace_id=trace_id,
                span_id=span_id,
                parent_span_id=parent_span_id,
                name=name,
                name_contains=name_contains,
                descending=descending,
                page_size=page_size,
                page_token=page_token,
            )
        )

    def tail_spans(
        self, rollout_id: str, attempt_id: str | None = None, *, follow: bool = False
    ) -> list[list[t.Span]]:
        """Batches of a rollout's spans in order; with ``follow``, new ones as they arrive.

        Not retried (a stream): on UNAVAILABLE call again.

        Args:
            rollout_id: The rollout.
            attempt_id: None for all attempts, "latest", or an attempt id.
            follow: Keep the stream open for new spans (no deadline).

        Returns:
            Every item until the stream ends: Lists of spans.

        Raises:
            NotFoundError: No such rollout or attempt.
        """
        return self._collect(self._client.tail_spans(rollout_id, attempt_id, follow=follow))

    def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str, count: int = 1) -> int:
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
        return self._run(self._client.get_next_span_sequence_id(rollout_id, attempt_id, count))

    def add_resources(self, resources: Mapping[str, t.Resource], resources_id: str = "") -> t.ResourcesUpdate:
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
        return self._run(self._client.add_resources(resources, resources_id))

    def update_resources(
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
        return self._run(
            self._client.update_resources(resources_id, resources, expected_version=expected_version)
        )

    def get_resources(self, resources_id: str) -> t.ResourcesUpdate:
        """One resources set. Retried on UNAVAILABLE.

        Args:
            resources_id: The set.

        Returns:
            The set.

        Raises:
            NotFoundError: No such set.
        """
        return self._run(self._client.get_resources(resources_id))

    def get_resources_by_id(self, resources_id: str) -> t.ResourcesUpdate | None:
        """One resources set, or None when there is no such set. Retried on UNAVAILABLE.

        Args:
            resources_id: The set.

        Returns:
            The set, or None.
        """
        return self._run(self._client.get_resources_by_id(resources_id))

    def get_latest_resources(self) -> t.ResourcesUpdate | None:
        """The latest resources set, or None when there is none. Retried on UNAVAILABLE.

        Returns:
            The set, or None.
        """
        return self._run(self._client.get_latest_resources())

    def query_resources(
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
        return self._run(
            self._client.query_resources(
                resources_id_contains=resources_id_contains, descending=descending, limit=limit
            )
        )

    def list_resources(
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
        return self._run(
            self._client.list_resources(
                resources_id_contains=resources_id_contains,
                descending=descending,
                page_size=page_size,
                page_token=page_token,
            )
        )

    def update_worker(self, worker_id: str, heartbeat_stats: Mapping[str, Any] | None = None) -> t.Worker:
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
        return self._run(self._client.update_worker(worker_id, heartbeat_stats))

    def get_worker_by_id(self, worker_id: str) -> t.Worker | None:
        """One worker, or None when there is no such worker. Retried on UNAVAILABLE.

        Args:
            worker_id: The worker.

        Returns:
            The worker, or None.
        """
        return self._run(self._client.get_worker_by_id(worker_id))

    def query_workers(
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
        return self._run(
            self._client.query_workers(
                status_in=status_in,
                worker_id_contains=worker_id_contains,
                order_by=order_by,
                descending=descending,
                limit=limit,
            )
        )

    def list_workers(
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
        return self._run(
            self._client.list_workers(
                status_in=status_in,
                worker_id_contains=worker_id_contains,
                order_by=order_by,
                descending=descending,
                page_size=page_size,
                page_token=page_token,
            )
        )

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float | None = None) -> list[t.Rollout]:
        """Wait until the rollouts finish. Each long-poll is retried on UNAVAILABLE.

        Args:
            rollout_ids: The rollouts.
            timeout: The most seconds to wait (None: no limit).

        Returns:
            The finished rollouts among ``rollout_ids``, once all finish or ``timeout`` passes.

        Raises:
            InvalidArgumentError: A refused id list.
        """
        return self._run(self._client.wait_for_rollouts(rollout_ids, timeout))

    def watch_rollouts(
        self,
        resume_token: str = "",
        *,
        rollout_ids: Iterable[str] = (),
        status_in: Iterable[t.RolloutStatus | str | int] = (),
        progress_interval: float | None = None,
        include_progress: bool = False,
    ) -> list[WatchEvent]:
        """Rollout changes as they are committed, until the server ends the stream.

        Not retried as a call (a stream), but when the server goes away (UNAVAILABLE) after an event,
        the watch reconnects from the last resume token by itself.

        Args:
            resume_token: Start after the event of this token ("": from now).
            rollout_ids: Only these rollouts.
            status_in: Only changes into one of these statuses.
            progress_interval: Ask for progress events (no rollout, a fresh token) this often, in seconds.
            include_progress: Yield the progress events too.

        Returns:
            Every item until the stream ends: Each change: the rollout, its resume token and the store's revision.

        Raises:
            InvalidArgumentError: A refused filter or resume token.
            UnavailableError: The store went away before the first event.
        """
        return self._collect(
            self._client.watch_rollouts(
                resume_token,
                rollout_ids=rollout_ids,
                status_in=status_in,
                progress_interval=progress_interval,
                include_progress=include_progress,
            )
        )

    def statistics(self) -> t.Statistics:
        """The store's counts, backend and sizes. Retried on UNAVAILABLE.

        The keys of ``rollouts_by_status`` are lower-case status names ("queuing"), as
        :meth:`lightning_grpc.client.local.LocalStoreClient.statistics` answers them.

        Returns:
            The statistics.

        Raises:
            PermissionDeniedError: The token is not an admin's.
        """
        return self._run(self._client.statistics())

    def delete_rollouts(
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
        return self._run(self._client.delete_rollouts(rollout_ids, finished_before=finished_before))


class SyncTrainerClient(_BlockingLoop):
    """A blocking :class:`~lightning_grpc.client.TrainerClient`: the same methods, each returning its result.

    Use it as a context manager, or call :meth:`close` when done.

    Args:
        target: The server's address (``host:port``), or a whole :class:`ClientConfig` (then the
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
        config = client_config(
            target,
            token=token,
            tls=tls,
            retry=retry,
            timeout=timeout,
            gzip=gzip,
            keepalive_seconds=keepalive_seconds,
        )
        super().__init__()

        async def make() -> TrainerClient:  # the channel belongs to the loop it is made in
            return TrainerClient(config)

        self._client = self._run(make())

    @property
    def config(self) -> ClientConfig:
        """How this client reaches the server."""
        return self._client.config

    def close(self) -> None:
        """Close the channel and stop the client's event loop; the client cannot be used after."""
        self._stop(self._client.close())

    def __enter__(self) -> SyncTrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit_groups(
        self,
        samples: Sequence[Any],
        group_size: int,
        *,
        mode: t.RolloutMode | str = "train",
        resources_id: str = "",
        config: t.RolloutConfig | None = None,
        step: int = 0,
    ) -> list[SubmittedGroup]:
        """Queue ``group_size`` rollouts per sample, one GRPO group per sample.

        Retried on UNAVAILABLE: group ids are chosen here when a sample has none, so a retried call
        creates nothing twice.

        Args:
            samples: Task inputs, or :class:`GroupSample` objects (input, group id, metadata).
            group_size: The rollouts of each group.
            mode: train, val or test (a :class:`RolloutMode` or its name).
            resources_id: The resources set the rollouts run with.
            config: Timeouts and retries of the rollouts' attempts.
            step: The training step the groups are for.

        Returns:
            Each group's id and rollout ids, in the order of ``samples``.

        Raises:
            InvalidArgumentError: A refused sample, group size, mode or config.
            NotFoundError: ``resources_id`` names no resources set.
        """
        return self._run(
            self._client.submit_groups(
                samples, group_size, mode=mode, resources_id=resources_id, config=config, step=step
            )
        )

    def get_batch(
        self,
        min_groups: int = 1,
        max_groups: int = 0,
        *,
        wait: float = 0.0,
        mode: t.RolloutMode | str = "train",
        options: BatchOptions | None = None,
        request_id: str = "",
        aggregation: Aggregation | str | int | None = None,
        reward_match: RewardMatch | str | int | None = None,
        reward_dimension: str | None = None,
        agent_match: str | None = None,
        failure_policy: FailurePolicy | str | int | None = None,
        fill_reward: float | None = None,
        min_policy_version: int | None = None,
        pad_token_id: int | None = None,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_overflow: PromptOverflow | str | int | None = None,
        layout: Layout | str | int | None = None,
        max_chunk_bytes: int | None = None,
        exclude_log_probs: bool | None = None,
        include_calls_under_reward: bool | None = None,
    ) -> TrainingBatch:
        """A batch of whole groups: waits up to ``wait`` s for ``min_groups``, takes at most ``max_groups``.

        The options are a :class:`BatchOptions`, or its fields as keywords (``pad_token_id=...``,
        ``failure_policy="drop_group"``, ``aggregation="trajectory"``, ...; None: the field's default),
        used only when ``options`` is None. Retried on UNAVAILABLE: a request id is sent along
        (``request_id``, or one chosen here), and a retry with the same id returns the same groups.

        Args:
            min_groups: The fewest groups to wait for.
            max_groups: The most groups to take (0: every ready one).
            wait: How long to wait for ``min_groups``, in seconds.
            mode: The mode of the groups (train, val or test).
            options: All the batch options at once.
            request_id: The id that makes a repeated request return the same batch.
            aggregation: transition (a row per call) or trajectory (a row per rollout).
            reward_match: Which reward span a call takes: final, first_occurrence or first_sibling.
            reward_dimension: The reward dimension to train on ("": the main one).
            agent_match: A regular expression of the agents whose calls are trained.
            failure_policy: What a failed rollout does: drop_rollout, drop_group or fill.
            fill_reward: The reward of failed rollouts under the fill policy.
            min_policy_version: Drop calls made by an older policy.
            pad_token_id: The token id of the padding.
            max_prompt_length: Cut or drop longer prompts (0: no limit).
            max_response_length: Cut longer responses (0: no limit).
            prompt_overflow: What a long prompt does: drop or truncate_left.
            layout: How the batch travels: ragged or padded.
            max_chunk_bytes: The largest message of the stream.
            exclude_log_probs: Leave the recorded log probabilities out.
            include_calls_under_reward: Also train calls made under a reward span.

        Returns:
            The batch, its arrays padded as verl expects them.

        Raises:
            InvalidArgumentError: A refused option, group count or wait.
            DeadlineExceededError: The call outlived its deadline.
        """
        return self._run(
            self._client.get_batch(
                min_groups,
                max_groups,
                wait=wait,
                mode=mode,
                options=options,
                request_id=request_id,
                aggregation=aggregation,
                reward_match=reward_match,
                reward_dimension=reward_dimension,
                agent_match=agent_match,
                failure_policy=failure_policy,
                fill_reward=fill_reward,
                min_policy_version=min_policy_version,
                pad_token_id=pad_token_id,
                max_prompt_length=max_prompt_length,
                max_response_length=max_response_length,
                prompt_overflow=prompt_overflow,
                layout=layout,
                max_chunk_bytes=max_chunk_bytes,
                exclude_log_probs=exclude_log_probs,
                include_calls_under_reward=include_calls_under_reward,
            )
        )

    def report_step(
        self, step: int, policy_version: int, metrics: Mapping[str, float] | None = None, *, run_id: str = ""
    ) -> TrainingEvent:
        """Report a finished training step and the policy version it produced.

        Retried on UNAVAILABLE: a step reported again with the same content is answered with the
        stored event (with other content it is recorded anew: a run resumed from a checkpoint).

        Args:
            step: The step number.
            policy_version: The policy version after the step.
            metrics: The step's metrics by name.
            run_id: The training run ("": the default run).

        Returns:
            The stored event.

        Raises:
            InvalidArgumentError: A refused step, version or metric.
        """
        return self._run(self._client.report_step(step, policy_version, metrics, run_id=run_id))

    def watch_training(
        self, run_id: str = "", *, after_sequence: int = 0, follow: bool = False
    ) -> list[TrainingEvent]:
        """Reported steps after ``after_sequence``; with ``follow``, new ones as they are reported.

        Not retried (a stream): on UNAVAILABLE call again with the last event's sequence.

        Args:
            run_id: The training run ("": the default run).
            after_sequence: Start after the event of this sequence number.
            follow: Keep the stream open for new events (no deadline).

        Returns:
            Every item until the stream ends: The training events, in order.

        Raises:
            InvalidArgumentError: A refused sequence number.
        """
        return self._collect(
            self._client.watch_training(run_id, after_sequence=after_sequence, follow=follow)
        )

    def status(self) -> TrainerStatus:
        """The trainer's groups by mode, drops, batches and policy version. Retried on UNAVAILABLE.

        Returns:
            The trainer's status.
        """
        return self._run(self._client.status())

    def triplets(
        self,
        rollout_id: str,
        options: BatchOptions | None = None,
        *,
        aggregation: Aggregation | str | int | None = None,
        reward_match: RewardMatch | str | int | None = None,
        reward_dimension: str | None = None,
        agent_match: str | None = None,
        failure_policy: FailurePolicy | str | int | None = None,
        fill_reward: float | None = None,
        min_policy_version: int | None = None,
        pad_token_id: int | None = None,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_overflow: PromptOverflow | str | int | None = None,
        layout: Layout | str | int | None = None,
        max_chunk_bytes: int | None = None,
        exclude_log_probs: bool | None = None,
        include_calls_under_reward: bool | None = None,
    ) -> RolloutTripletReport:
        """The triplets of a rollout's latest attempt, its rows, and the reasons for anything not trained.

        The options are those of :meth:`get_batch` (a :class:`BatchOptions`, or its fields as keywords,
        used only when ``options`` is None). Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            options: All the batch options at once.
            aggregation: transition (a row per call) or trajectory (a row per rollout).
            reward_match: Which reward span a call takes: final, first_occurrence or first_sibling.
            reward_dimension: The reward dimension to train on ("": the main one).
            agent_match: A regular expression of the agents whose calls are trained.
            failure_policy: What a failed rollout does: drop_rollout, drop_group or fill.
            fill_reward: The reward of failed rollouts under the fill policy.
            min_policy_version: Drop calls made by an older policy.
            pad_token_id: The token id of the padding.
            max_prompt_length: Cut or drop longer prompts (0: no limit).
            max_response_length: Cut longer responses (0: no limit).
            prompt_overflow: What a long prompt does: drop or truncate_left.
            layout: How a batch travels: ragged or padded.
            max_chunk_bytes: The largest message of a batch stream.
            exclude_log_probs: Leave the recorded log probabilities out.
            include_calls_under_reward: Also train calls made under a reward span.

        Returns:
            The report: triplets, rows and drops with their reasons.

        Raises:
            NotFoundError: No such rollout.
            InvalidArgumentError: A refused option.
        """
        return self._run(
            self._client.triplets(
                rollout_id,
                options,
                aggregation=aggregation,
                reward_match=reward_match,
                reward_dimension=reward_dimension,
                agent_match=agent_match,
                failure_policy=failure_policy,
                fill_reward=fill_reward,
                min_policy_version=min_policy_version,
                pad_token_id=pad_token_id,
                max_prompt_length=max_prompt_length,
                max_response_length=max_response_length,
                prompt_overflow=prompt_overflow,
                layout=layout,
                max_chunk_bytes=max_chunk_bytes,
                exclude_log_probs=exclude_log_probs,
                include_calls_under_reward=include_calls_under_reward,
            )
        )
