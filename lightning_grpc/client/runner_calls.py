"""The calls a runner makes for each rollout (claim, heartbeat, report), written once for both ways of
making them: :class:`~lightning_grpc.client.StoreClient` (a unary call each) and
:class:`~lightning_grpc.client.session.RunnerSession` (a message each on one stream)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_grpc import convert
from lightning_grpc import types as t
from lightning_grpc.types import AttemptHeartbeat
from lightning_grpc.v1 import span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb

from .arguments import enum_member
from .config import ClientConfig


class RunnerCalls:
    """The calls a runner makes for each rollout: claim, heartbeat, report. :class:`StoreClient` makes each as
    its unary RPC; a :class:`~lightning_grpc.client.session.RunnerSession` sends them all over one stream."""

    config: ClientConfig

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError

    async def dequeue_rollouts(
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
        request = _claim(pb.DequeueRolloutsRequest(), worker_id, limit, wait)
        resp = await self._call("DequeueRollouts", request, timeout=self.config.timeout + (wait or 0))
        return [convert.rollout_from_pb(r) for r in resp.rollouts]

    async def dequeue_rollout(self, *, worker_id: str = "", wait: float | None = None) -> t.Rollout | None:
        """Claim one queued rollout (see :meth:`dequeue_rollouts`). Retried on UNAVAILABLE.

        Args:
            worker_id: The claiming worker.
            wait: How long to wait for a rollout when the queue is empty, in seconds (None: not at all).

        Returns:
            The claimed rollout, or None when none came in time.

        Raises:
            InvalidArgumentError: A refused ``wait``.
        """
        got = await self.dequeue_rollouts(1, worker_id=worker_id, wait=wait)
        return got[0] if got else None

    async def heartbeat_attempt(self, rollout_id: str, attempt_id: str) -> AttemptHeartbeat:
        """Tell the store an attempt is alive; learn whether it should stop. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.

        Returns:
            The attempt, its rollout's status, and whether it was cancelled or should stop.

        Raises:
            NotFoundError: No such rollout or attempt.
        """
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
        spans: Iterable[t.Span | span_pb2.Span | bytes] = (),
    ) -> tuple[t.Attempt, t.Rollout]:
        """Report an attempt's outcome; ``spans`` are stored in the same commit.

        Retried on UNAVAILABLE: the report is fenced by the attempt, so a repeat changes nothing.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.
            status: The outcome (SUCCEEDED, FAILED, ...: an :class:`AttemptStatus`, its name or number).
            message: A status message (why it failed).
            metadata: JSON metadata kept with the attempt.
            spans: Spans stored with the outcome (a serialized ``lightning.v1.Span`` may be given as its bytes).

        Returns:
            (attempt, rollout) as they are after the report.

        Raises:
            NotFoundError: No such rollout or attempt.
            InvalidArgumentError: A refused status, metadata or span.
            FailedPreconditionError: The attempt has already ended with another outcome.
        """
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
        spans: Iterable[t.Span | span_pb2.Span | bytes] = (),
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
            spans: Spans stored with the outcome (a serialized ``lightning.v1.Span`` may be given as its bytes).
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
        request = self._completion(rollout_id, attempt_id, status, message, None, spans)
        _claim(request.dequeue_next, worker_id, limit, wait)
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
        spans: Iterable[t.Span | span_pb2.Span | bytes],
    ) -> pb.CompleteAttemptRequest:
        request = pb.CompleteAttemptRequest(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            status=int(enum_member(t.AttemptStatus, status)),  # type: ignore[arg-type]
            message=message,
        )
        if metadata is not None:
            convert.dict_to_struct(metadata, request.metadata, "metadata")
        for s in spans:
            if isinstance(s, bytes):
                request.spans.add().MergeFromString(s)
            elif isinstance(s, span_pb2.Span):
                request.spans.append(s)
            else:
                convert.span_to_pb(s, request.spans.add())
        return request


def _claim(
    request: pb.DequeueRolloutsRequest, worker_id: str, limit: int, wait: float | None
) -> pb.DequeueRolloutsRequest:
    """``request`` filled in as a claim of up to ``limit`` rollouts, with a request id of its own."""
    request.worker_id = worker_id
    request.max_rollouts = limit
    request.request_id = f"dq-{uuid.uuid4().hex}"
    if wait:
        convert.float_to_duration(wait, request.wait_timeout)
    return request


__all__ = ["RunnerCalls"]
