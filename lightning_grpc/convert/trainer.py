"""The TrainerService's objects: tensors, batch options, training events and aggregation fallbacks."""

from __future__ import annotations

import math

import numpy as np

from lightning_grpc.batching.core import RunInterruption, TrainingEvent
from lightning_grpc.batching.options import BatchOptions
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.triplets import Fallback, FallbackReason
from lightning_grpc.v1 import trainer_service_pb2

from .values import set_ts, ts_to_float

_DTYPE_OF_PB = {
    1: np.dtype("?"),
    2: np.dtype("u1"),
    3: np.dtype("<u2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f4"),
    7: np.dtype("<f8"),
}
_PB_OF_KIND = {(d.kind, d.itemsize): number for number, d in _DTYPE_OF_PB.items()}


def tensor_to_pb(array: np.ndarray, out: trainer_service_pb2.Tensor) -> None:
    """A numpy array as a Tensor: shape, dtype and row-major little-endian bytes."""
    number = _PB_OF_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if number is None:
        raise TypeError(f"no Tensor dtype for numpy {array.dtype}")
    out.dtype = number  # type: ignore[assignment]
    out.shape.extend(array.shape)
    out.data = np.ascontiguousarray(array, dtype=_DTYPE_OF_PB[number]).tobytes()


def tensor_from_pb(m: trainer_service_pb2.Tensor, field: str = "tensor") -> np.ndarray:
    """A Tensor as a read-only numpy array over the message's bytes (no copy)."""
    dtype = _DTYPE_OF_PB.get(m.dtype)
    if dtype is None:
        raise InvalidArgumentError(f"{field}.dtype", f"is not a known dtype (got {m.dtype})")
    shape = tuple(m.shape)
    if any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != len(m.data):
        raise InvalidArgumentError(
            f"{field}.data",
            f"holds {len(m.data)} bytes, not the {math.prod(shape)} {dtype} values of shape {shape}",
        )
    return np.frombuffer(m.data, dtype=dtype).reshape(shape)


def batch_options_from_pb(m: trainer_service_pb2.BatchOptions, field: str = "options") -> BatchOptions:
    return BatchOptions.checked(
        field,
        aggregation=m.aggregation,
        reward_match=m.reward_match,
        reward_dimension=m.reward_dimension,
        agent_match=m.agent_match,
        failure_policy=m.failure_policy,
        fill_reward=m.fill_reward,
        min_policy_version=m.min_policy_version if m.HasField("min_policy_version") else None,
        pad_token_id=m.pad_token_id,
        max_prompt_length=m.max_prompt_length,
        max_response_length=m.max_response_length,
        prompt_overflow=m.prompt_overflow,
        layout=m.layout,
        max_chunk_bytes=m.max_chunk_bytes,
        exclude_log_probs=m.exclude_log_probs,
        include_calls_under_reward=m.include_calls_under_reward,
    )


def batch_options_to_pb(o: BatchOptions, out: trainer_service_pb2.BatchOptions) -> None:
    out.aggregation = int(o.aggregation)  # type: ignore[assignment]
    out.reward_match = int(o.reward_match)  # type: ignore[assignment]
    out.reward_dimension = o.reward_dimension
    out.agent_match = o.agent_match
    out.failure_policy = int(o.failure_policy)  # type: ignore[assignment]
    out.fill_reward = o.fill_reward
    if o.min_policy_version is not None:
        out.min_policy_version = o.min_policy_version
    out.pad_token_id = o.pad_token_id
    out.max_prompt_length = o.max_prompt_length
    out.max_response_length = o.max_response_length
    out.prompt_overflow = int(o.prompt_overflow)  # type: ignore[assignment]
    out.layout = int(o.layout)  # type: ignore[assignment]
    out.max_chunk_bytes = o.max_chunk_bytes
    out.exclude_log_probs = o.exclude_log_probs
    out.include_calls_under_reward = o.include_calls_under_reward


def training_event_to_pb(e: TrainingEvent, out: trainer_service_pb2.TrainingEvent) -> None:
    out.sequence = e.sequence
    out.run_id = e.run_id
    out.step = e.step
    out.policy_version = e.policy_version
    out.metrics.update(e.metrics)
    set_ts(out.time, e.time)
    for interruption in e.interruptions:
        run_interruption_to_pb(interruption, out.interruptions.add())


def training_event_from_pb(m: trainer_service_pb2.TrainingEvent) -> TrainingEvent:
    return TrainingEvent(
        sequence=m.sequence,
        run_id=m.run_id,
        step=m.step,
        policy_version=m.policy_version,
        metrics=dict(m.metrics),
        time=ts_to_float(m.time),
        interruptions=[run_interruption_from_pb(i) for i in m.interruptions],
    )


def run_interruption_to_pb(i: RunInterruption, out: trainer_service_pb2.RunInterruption) -> None:
    set_ts(out.time, i.time)
    out.process = i.process
    out.cause = i.cause
    out.recovery = i.recovery
    out.recovery_seconds = i.recovery_seconds
    out.step = i.step


def run_interruption_from_pb(m: trainer_service_pb2.RunInterruption) -> RunInterruption:
    return RunInterruption(
        time=ts_to_float(m.time),
        process=m.process,
        cause=m.cause,
        recovery=m.recovery,
        recovery_seconds=m.recovery_seconds,
        step=m.step,
    )


def aggregation_fallback_to_pb(f: Fallback, out: trainer_service_pb2.AggregationFallback) -> None:
    out.reason = str(getattr(f.reason, "value", f.reason))
    out.call_index = f.call_index
    out.span_id = f.span_id
    out.position = f.position
    out.expected_token_id = f.expected_token
    out.actual_token_id = f.actual_token
    out.detail = f.detail


def aggregation_fallback_from_pb(m: trainer_service_pb2.AggregationFallback) -> Fallback | None:
    """The fallback a message describes; None when it names no reason (the rows did not fall back)."""
    if not m.reason:
        return None
    known = {reason.value: reason for reason in FallbackReason}
    return Fallback(
        reason=known.get(m.reason, m.reason),
        call_index=m.call_index,
        span_id=m.span_id,
        position=m.position,
        expected_token=m.expected_token_id,
        actual_token=m.actual_token_id,
        detail=m.detail,
    )
