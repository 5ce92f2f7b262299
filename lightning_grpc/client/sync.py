"""Blocking clients, for scripts and notebooks: every method of the async client, typed.

:class:`SyncStoreClient` and :class:`SyncTrainerClient` run an async client on an event loop of their
own, on a thread of their own, and block until each call returns. Their methods have the async
clients' signatures, documentation, errors and retries. A streaming method returns a list: the
items seen until the stream ends (use ``follow=False``), so prefer the async client for those.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from lightning_grpc import types as t
from lightning_grpc.batching import BatchOptions, Layout, RunInterruption, TrainingEvent
from lightning_grpc.batching.core import TrainerStatus
from lightning_grpc.batching.options import Aggregation, FailurePolicy, PromptOverflow, RewardMatch
from lightning_grpc.types import AddSpansResult, AttemptHeartbeat, WatchEvent
from lightning_grpc.v1 import span_pb2

from .channel import close_loop
from .config import ClientConfig, RetryConfig, TlsConfig
from .store import _DEFAULTS, _UNSET, StoreClient, client_config
from .trainer import RolloutTripletReport, SubmittedGroup, TrainerClient, TrainingBatch

T = TypeVar("T")
C = TypeVar("C", bound=type)

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


def _documented_as(source: type) -> Callable[[C], C]:
    """Each public method written here without a docstring gets its async twin's: the text is kept in one
    place, the async client (where it differs, a streaming method returning a list, it is written here)."""

    def document(cls: C) -> C:
        for name, member in vars(cls).items():
            if callable(member) and not name.startswith("_") and member.__doc__ is None:
                member.__doc__ = getattr(source, name).__doc__
        return cls

    return document


@_documented_as(StoreClient)
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
        return self._run(self._client.enqueue_rollouts(specs))

    def dequeue_rollouts(
        self, limit: int = 1, *, worker_id: str = "", wait: float | None = None
    ) -> list[t.Rollout]:
        return self._run(self._client.dequeue_rollouts(limit, worker_id=worker_id, wait=wait))

    def dequeue_rollout(self, *, worker_id: str = "", wait: float | None = None) -> t.Rollout | None:
        return self._run(self._client.dequeue_rollout(worker_id=worker_id, wait=wait))

    def start_attempt(self, rollout_id: str, *, worker_id: str = "") -> t.Rollout:
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
        return self._run(self._client.cancel_rollout(rollout_id, reason))

    def retry_rollout(self, rollout_id: str, reason: str = "") -> t.Rollout:
        return self._run(self._client.retry_rollout(rollout_id, reason))

    def get_rollout(self, rollout_id: str) -> t.Rollout:
        return self._run(self._client.get_rollout(rollout_id))

    def get_rollout_by_id(self, rollout_id: str) -> t.Rollout | None:
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
        return self._run(self._client.get_latest_attempt(rollout_id))

    def query_attempts(
        self, rollout_id: str, *, descending: bool = False, limit: int | None = None
    ) -> list[t.Attempt]:
        return self._run(self._client.query_attempts(rollout_id, descending=descending, limit=limit))

    def list_attempts(
        self, rollout_id: str, *, descending: bool = False, page_size: int = 0, page_token: str = ""
    ) -> t.Page:
        return self._run(
            self._client.list_attempts(
                rollout_id, descending=descending, page_size=page_size, page_token=page_token
            )
        )

    def heartbeat_attempt(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        return self._run(self._client.heartbeat_attempt(rollout_id, attempt_id))

    def complete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: t.AttemptStatus | str | int,
        message: str = "",
        metadata: Mapping[str, Any] | None = None,
        *,
        spans: Iterable[t.Span | span_pb2.Span | bytes] = (),
    ) -> tuple[t.Attempt, t.Rollout]:
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
        spans: Iterable[t.Span | span_pb2.Span | bytes] = (),
        worker_id: str = "",
        limit: int = 1,
        wait: float | None = None,
    ) -> tuple[t.Attempt, t.Rollout, list[t.Rollout]]:
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
        return self._run(self._client.add_spans(spans, rollout_id=rollout_id, attempt_id=attempt_id))

    def add_span(self, span: t.Span | span_pb2.Span) -> int:
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
        return self._run(self._client.get_next_span_sequence_id(rollout_id, attempt_id, count))

    def add_resources(self, resources: Mapping[str, t.Resource], resources_id: str = "") -> t.ResourcesUpdate:
        return self._run(self._client.add_resources(resources, resources_id))

    def update_resources(
        self, resources_id: str, resources: Mapping[str, t.Resource], *, expected_version: int = 0
    ) -> t.ResourcesUpdate:
        return self._run(
            self._client.update_resources(resources_id, resources, expected_version=expected_version)
        )

    def get_resources(self, resources_id: str) -> t.ResourcesUpdate:
        return self._run(self._client.get_resources(resources_id))

    def get_resources_by_id(self, resources_id: str) -> t.ResourcesUpdate | None:
        return self._run(self._client.get_resources_by_id(resources_id))

    def get_latest_resources(self) -> t.ResourcesUpdate | None:
        return self._run(self._client.get_latest_resources())

    def query_resources(
        self, *, resources_id_contains: str = "", descending: bool = False, limit: int | None = None
    ) -> list[t.ResourcesUpdate]:
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
        return self._run(
            self._client.list_resources(
                resources_id_contains=resources_id_contains,
                descending=descending,
                page_size=page_size,
                page_token=page_token,
            )
        )

    def update_worker(self, worker_id: str, heartbeat_stats: Mapping[str, Any] | None = None) -> t.Worker:
        return self._run(self._client.update_worker(worker_id, heartbeat_stats))

    def get_worker_by_id(self, worker_id: str) -> t.Worker | None:
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
        return self._run(self._client.statistics())

    def delete_rollouts(
        self, rollout_ids: Sequence[str] = (), *, finished_before: float | None = None
    ) -> t.DeleteResult:
        return self._run(self._client.delete_rollouts(rollout_ids, finished_before=finished_before))


@_documented_as(TrainerClient)
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
        self,
        step: int,
        policy_version: int,
        metrics: Mapping[str, float] | None = None,
        *,
        run_id: str = "",
        interruptions: Sequence[RunInterruption] = (),
    ) -> TrainingEvent:
        return self._run(
            self._client.report_step(
                step, policy_version, metrics, run_id=run_id, interruptions=interruptions
            )
        )

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
