"""Protobuf <-> domain conversion: the one place that knows both shapes.

The servicers use it to call the core; the client uses it to return plain Python objects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2
from google.protobuf.message import DecodeError

from lightning_grpc import types as t
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.store.state import SpanRecord
from lightning_grpc.trainer.core import TrainingEvent
from lightning_grpc.trainer.options import BatchOptions
from lightning_grpc.v1 import (
    common_pb2,
    resource_pb2,
    rollout_pb2,
    span_pb2,
    store_service_pb2,
    trainer_service_pb2,
    worker_pb2,
)

_INT53 = 2**53

# ------------------------------------------------------------------ JSON values


def value_to_python(v: struct_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return v.string_value
    if kind == "number_value":
        n = v.number_value
        return int(n) if n.is_integer() and abs(n) < _INT53 else n
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return struct_to_dict(v.struct_value)
    if kind == "list_value":
        return [value_to_python(x) for x in v.list_value.values]
    return None


def struct_to_dict(s: struct_pb2.Struct) -> dict[str, Any]:
    return {k: value_to_python(v) for k, v in s.fields.items()}


def python_to_value(obj: Any, out: struct_pb2.Value | None = None, field: str = "value") -> struct_pb2.Value:
    v = out if out is not None else struct_pb2.Value()
    if obj is None:
        v.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        v.bool_value = obj
    elif isinstance(obj, int | float):
        if not math.isfinite(obj):
            raise InvalidArgumentError(field, "JSON numbers must be finite")
        v.number_value = float(obj)
    elif isinstance(obj, str):
        v.string_value = obj
    elif isinstance(obj, Mapping):
        dict_to_struct(obj, v.struct_value, field)
    elif isinstance(obj, list | tuple):
        lst = v.list_value
        lst.SetInParent()
        for i, item in enumerate(obj):
            python_to_value(item, lst.values.add(), f"{field}[{i}]")
    else:
        raise InvalidArgumentError(field, f"{type(obj).__name__} is not JSON")
    return v


def dict_to_struct(
    d: Mapping[str, Any], out: struct_pb2.Struct | None = None, field: str = "value"
) -> struct_pb2.Struct:
    s = out if out is not None else struct_pb2.Struct()
    if out is not None:
        s.SetInParent()  # an empty mapping still sets the field
    for k, item in d.items():
        python_to_value(item, s.fields[str(k)], f"{field}.{k}")
    return s


# ------------------------------------------------------------------ times


def ts_to_float(ts: timestamp_pb2.Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


def set_ts(ts: timestamp_pb2.Timestamp, value: float | None) -> None:
    if value is not None:
        seconds = math.floor(value)
        ts.seconds = seconds
        ts.nanos = round((value - seconds) * 1e9) % 1_000_000_000


def duration_to_float(d: duration_pb2.Duration, present: bool = True) -> float | None:
    if not present:
        return None
    return d.seconds + d.nanos / 1e9


def float_to_duration(value: float, out: duration_pb2.Duration) -> None:
    seconds = math.floor(value)
    out.seconds = seconds
    out.nanos = round((value - seconds) * 1e9) % 1_000_000_000


# ------------------------------------------------------------------ rollouts


def config_from_pb(c: rollout_pb2.RolloutConfig) -> t.RolloutConfig:
    return t.RolloutConfig(
        timeout=duration_to_float(c.timeout) if c.HasField("timeout") else None,
        unresponsive_timeout=duration_to_float(c.unresponsive_timeout)
        if c.HasField("unresponsive_timeout")
        else None,
        max_attempts=c.max_attempts,
        retry_on=tuple(_attempt_status(s) for s in c.retry_on),
    )


def _attempt_status(value: int) -> t.AttemptStatus:
    try:
        return t.AttemptStatus(value)
    except ValueError:  # an unknown number stays itself: the store refuses it, naming the number
        return value  # type: ignore[return-value]


def config_to_pb(c: t.RolloutConfig, out: rollout_pb2.RolloutConfig) -> None:
    if c.timeout is not None:
        float_to_duration(c.timeout, out.timeout)
    if c.unresponsive_timeout is not None:
        float_to_duration(c.unresponsive_timeout, out.unresponsive_timeout)
    out.max_attempts = c.max_attempts
    out.retry_on.extend(int(s) for s in c.retry_on)  # type: ignore[misc]


def attempt_to_pb(a: t.Attempt, out: rollout_pb2.Attempt | None = None) -> rollout_pb2.Attempt:
    m = out if out is not None else rollout_pb2.Attempt()
    m.rollout_id = a.rollout_id
    m.attempt_id = a.attempt_id
    m.sequence_number = a.sequence_number
    m.status = int(a.status)  # type: ignore[assignment]
    m.worker_id = a.worker_id
    set_ts(m.start_time, a.start_time)
    set_ts(m.end_time, a.end_time)
    set_ts(m.last_heartbeat_time, a.last_heartbeat_time)
    m.status_message = a.status_message
    if a.metadata:
        dict_to_struct(a.metadata, m.metadata)
    return m


def attempt_from_pb(m: rollout_pb2.Attempt) -> t.Attempt:
    return t.Attempt(
        rollout_id=m.rollout_id,
        attempt_id=m.attempt_id,
        sequence_number=m.sequence_number,
        status=t.AttemptStatus(m.status),
        worker_id=m.worker_id,
        start_time=ts_to_float(m.start_time),
        end_time=ts_to_float(m.end_time) if m.HasField("end_time") else None,
        last_heartbeat_time=ts_to_float(m.last_heartbeat_time) if m.HasField("last_heartbeat_time") else None,
        status_message=m.status_message,
        metadata=struct_to_dict(m.metadata),
    )


def rollout_to_pb(r: t.Rollout, out: rollout_pb2.Rollout | None = None) -> rollout_pb2.Rollout:
    m = out if out is not None else rollout_pb2.Rollout()
    m.rollout_id = r.rollout_id
    python_to_value(r.input, m.input)
    m.mode = int(r.mode)  # type: ignore[assignment]
    m.resources_id = r.resources_id
    m.group_id = r.group_id
    m.status = int(r.status)  # type: ignore[assignment]
    config_to_pb(r.config, m.config)
    if r.metadata:
        dict_to_struct(r.metadata, m.metadata)
    set_ts(m.create_time, r.create_time)
    set_ts(m.start_time, r.start_time)
    set_ts(m.end_time, r.end_time)
    if r.latest_attempt is not None:
        attempt_to_pb(r.latest_attempt, m.latest_attempt)
    m.attempt_count = r.attempt_count
    m.status_message = r.status_message
    return m


def rollout_from_pb(m: rollout_pb2.Rollout) -> t.Rollout:
    return t.Rollout(
        rollout_id=m.rollout_id,
        input=value_to_python(m.input) if m.HasField("input") else None,
        mode=t.RolloutMode(m.mode),
        resources_id=m.resources_id,
        group_id=m.group_id,
        status=t.RolloutStatus(m.status),
        config=config_from_pb(m.config),
        metadata=struct_to_dict(m.metadata),
        create_time=ts_to_float(m.create_time),
        start_time=ts_to_float(m.start_time) if m.HasField("start_time") else None,
        end_time=ts_to_float(m.end_time) if m.HasField("end_time") else None,
        latest_attempt=attempt_from_pb(m.latest_attempt) if m.HasField("latest_attempt") else None,
        attempt_count=m.attempt_count,
        status_message=m.status_message,
    )


def spec_from_pb(m: store_service_pb2.RolloutSpec) -> t.RolloutSpec:
    return t.RolloutSpec(
        input=value_to_python(m.input) if m.HasField("input") else None,
        rollout_id=m.rollout_id,
        mode=m.mode,  # type: ignore[arg-type]
        resources_id=m.resources_id,
        group_id=m.group_id,
        config=config_from_pb(m.config),
        metadata=struct_to_dict(m.metadata),
    )


def spec_to_pb(s: t.RolloutSpec, out: store_service_pb2.RolloutSpec) -> None:
    out.rollout_id = s.rollout_id
    python_to_value(s.input, out.input, "input")
    out.mode = int(s.mode)  # type: ignore[assignment]
    out.resources_id = s.resources_id
    out.group_id = s.group_id
    config_to_pb(s.config, out.config)
    if s.metadata:
        dict_to_struct(s.metadata, out.metadata, "metadata")


# ------------------------------------------------------------------ workers


def worker_to_pb(w: t.Worker, out: worker_pb2.Worker | None = None) -> worker_pb2.Worker:
    m = out if out is not None else worker_pb2.Worker()
    m.worker_id = w.worker_id
    m.status = int(w.status)  # type: ignore[assignment]
    if w.heartbeat_stats:
        dict_to_struct(w.heartbeat_stats, m.heartbeat_stats)
    set_ts(m.last_heartbeat_time, w.last_heartbeat_time)
    set_ts(m.last_dequeue_time, w.last_dequeue_time)
    m.current_rollout_id = w.current_rollout_id
    m.current_attempt_id = w.current_attempt_id
    return m


def worker_from_pb(m: worker_pb2.Worker) -> t.Worker:
    return t.Worker(
        worker_id=m.worker_id,
        status=t.WorkerStatus(m.status),
        heartbeat_stats=struct_to_dict(m.heartbeat_stats),
        last_heartbeat_time=ts_to_float(m.last_heartbeat_time) if m.HasField("last_heartbeat_time") else None,
        last_dequeue_time=ts_to_float(m.last_dequeue_time) if m.HasField("last_dequeue_time") else None,
        current_rollout_id=m.current_rollout_id,
        current_attempt_id=m.current_attempt_id,
    )


# ------------------------------------------------------------------ resources


def resource_to_pb(r: t.Resource, out: resource_pb2.Resource) -> None:
    if isinstance(r, t.LLM | t.ProxyLLM):
        target = out.llm if isinstance(r, t.LLM) else out.proxy_llm
        target.endpoint = r.endpoint
        target.model = r.model
        target.api_key = r.api_key
        target.SetInParent()
        if r.sampling_parameters:
            dict_to_struct(r.sampling_parameters, target.sampling_parameters)
    elif isinstance(r, t.PromptTemplate):
        out.prompt_template.template = r.template
        out.prompt_template.engine = r.engine
        out.prompt_template.SetInParent()
    elif isinstance(r, t.JsonResource):
        python_to_value(r.value, out.json)
    else:
        raise InvalidArgumentError("resources", f"{type(r).__name__} is not a resource type")


def resource_from_pb(m: resource_pb2.Resource, field: str = "resources") -> t.Resource:
    kind = m.WhichOneof("kind")
    if kind == "llm" or kind == "proxy_llm":
        src = m.llm if kind == "llm" else m.proxy_llm
        if not src.endpoint:
            raise InvalidArgumentError(f"{field}.{kind}.endpoint", "is required")
        cls = t.LLM if kind == "llm" else t.ProxyLLM
        return cls(
            endpoint=src.endpoint,
            model=src.model,
            api_key=src.api_key,
            sampling_parameters=struct_to_dict(src.sampling_parameters),
        )
    if kind == "prompt_template":
        engine = m.prompt_template.engine or "f-string"
        if engine not in ("f-string", "jinja"):
            raise InvalidArgumentError(
                f"{field}.prompt_template.engine", f"must be f-string or jinja (got {engine!r})"
            )
        return t.PromptTemplate(template=m.prompt_template.template, engine=engine)
    if kind == "json":
        return t.JsonResource(value=value_to_python(m.json))
    raise InvalidArgumentError(field, "must set one of llm, proxy_llm, prompt_template, json")


def resources_from_pb(
    entries: Mapping[str, resource_pb2.Resource], field: str = "resources"
) -> dict[str, t.Resource]:
    return {name: resource_from_pb(r, f"{field}[{name!r}]") for name, r in entries.items()}


def resources_update_to_pb(
    u: t.ResourcesUpdate, out: resource_pb2.ResourcesUpdate | None = None
) -> resource_pb2.ResourcesUpdate:
    m = out if out is not None else resource_pb2.ResourcesUpdate()
    m.resources_id = u.resources_id
    m.version = u.version
    for name, r in u.resources.items():
        resource_to_pb(r, m.resources[name])
    set_ts(m.create_time, u.create_time)
    set_ts(m.update_time, u.update_time)
    return m


def resources_update_from_pb(m: resource_pb2.ResourcesUpdate) -> t.ResourcesUpdate:
    return t.ResourcesUpdate(
        resources_id=m.resources_id,
        version=m.version,
        resources=resources_from_pb(m.resources),
        create_time=ts_to_float(m.create_time),
        update_time=ts_to_float(m.update_time),
    )


# ------------------------------------------------------------------ span attributes


def any_to_python(v: common_pb2.AnyValue, numpy_arrays: bool = False) -> Any:
    """An attribute value as Python; int and double arrays as lists, or as numpy arrays when asked."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_to_python(x, numpy_arrays) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_to_python(kv.value, numpy_arrays) for kv in v.kvlist_value.values}
    if kind == "int_array_value":
        values = v.int_array_value.values
        return np.array(values, dtype=np.int64) if numpy_arrays else list(values)
    if kind == "double_array_value":
        doubles = v.double_array_value.values
        return np.array(doubles, dtype=np.float64) if numpy_arrays else list(doubles)
    return getattr(v, kind)


def python_to_any(obj: Any, out: common_pb2.AnyValue) -> None:
    if isinstance(obj, bool):
        out.bool_value = obj
    elif isinstance(obj, int):
        out.int_value = obj
    elif isinstance(obj, float):
        out.double_value = obj
    elif isinstance(obj, str):
        out.string_value = obj
    elif isinstance(obj, bytes | bytearray):
        out.bytes_value = bytes(obj)
    elif isinstance(obj, Mapping):
        kv = out.kvlist_value
        kv.SetInParent()
        for k, item in obj.items():
            entry = kv.values.add()
            entry.key = str(k)
            python_to_any(item, entry.value)
    elif isinstance(obj, list | tuple):
        if obj and all(type(x) is int for x in obj):
            out.int_array_value.values.extend(obj)
        elif obj and all(type(x) is float for x in obj):
            out.double_array_value.values.extend(obj)
        else:
            arr = out.array_value
            arr.SetInParent()
            for item in obj:
                python_to_any(item, arr.values.add())
    elif obj is None:
        return
    else:
        out.string_value = str(obj)


def attributes_to_pb(attrs: Mapping[str, Any], out: Any) -> None:
    for k, v in attrs.items():
        python_to_any(v, out[k])


def attributes_from_pb(m: Any, numpy_arrays: bool = False) -> dict[str, Any]:
    return {k: any_to_python(v, numpy_arrays) for k, v in m.items()}


def span_to_pb(s: t.Span, out: span_pb2.Span | None = None) -> span_pb2.Span:
    m = out if out is not None else span_pb2.Span()
    m.rollout_id = s.rollout_id
    m.attempt_id = s.attempt_id
    m.sequence_id = s.sequence_id
    m.trace_id = s.trace_id
    m.span_id = s.span_id
    m.parent_span_id = s.parent_span_id
    m.name = s.name
    m.kind = s.kind  # type: ignore[assignment]
    m.start_time_unix_nano = s.start_time_unix_nano
    m.end_time_unix_nano = s.end_time_unix_nano
    if s.status_code or s.status_message:
        m.status.code = s.status_code  # type: ignore[assignment]
        m.status.message = s.status_message
    attributes_to_pb(s.attributes, m.attributes)
    for e in s.events:
        ev = m.events.add(name=e.name, time_unix_nano=e.time_unix_nano)
        attributes_to_pb(e.attributes, ev.attributes)
    for link in s.links:
        lk = m.links.add(trace_id=link.trace_id, span_id=link.span_id)
        attributes_to_pb(link.attributes, lk.attributes)
    attributes_to_pb(s.resource, m.resource)
    return m


def span_from_pb(m: span_pb2.Span, numpy_arrays: bool = False) -> t.Span:
    """A domain span; ``numpy_arrays`` keeps int and double array attributes (token ids) as numpy arrays."""
    return t.Span(
        trace_id=m.trace_id,
        span_id=m.span_id,
        name=m.name,
        rollout_id=m.rollout_id,
        attempt_id=m.attempt_id,
        sequence_id=m.sequence_id,
        parent_span_id=m.parent_span_id,
        kind=m.kind,
        start_time_unix_nano=m.start_time_unix_nano,
        end_time_unix_nano=m.end_time_unix_nano,
        status_code=m.status.code,
        status_message=m.status.message,
        attributes=attributes_from_pb(m.attributes, numpy_arrays),
        events=[t.SpanEvent(e.name, e.time_unix_nano, attributes_from_pb(e.attributes)) for e in m.events],
        links=[t.SpanLink(k.trace_id, k.span_id, attributes_from_pb(k.attributes)) for k in m.links],
        resource=attributes_from_pb(m.resource),
    )


# ------------------------------------------------------------------ spans as the store keeps them


def span_records(spans: Any) -> list[SpanRecord]:
    """Serialized spans as store records, each parsed in full so that only readable spans are stored.

    The stored body is the span exactly as received; its ids come from the parsed message.
    """
    parse = span_pb2.Span.FromString
    records = []
    for i, body in enumerate(spans):
        try:
            s = parse(body)
        except DecodeError:
            raise InvalidArgumentError(f"spans[{i}]", "is not a valid lightning.v1.Span") from None
        records.append(
            SpanRecord(
                s.rollout_id,
                s.attempt_id,
                s.span_id,
                s.trace_id,
                s.parent_span_id,
                s.name,
                s.start_time_unix_nano,
                s.end_time_unix_nano,
                body,
                s.sequence_id,
            )
        )
    return records


# ------------------------------------------------------------------ wire format


def varint(n: int) -> bytes:
    """A non-negative integer in Protobuf's varint encoding."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def length_delimited(tag: int, data: bytes) -> bytes:
    """A length-delimited field (``tag`` is the field's key byte, e.g. 0x0A for field 1) carrying ``data``."""
    return bytes((tag,)) + varint(len(data)) + data


# ------------------------------------------------------------------ tensors (TrainerService)

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


def training_event_from_pb(m: trainer_service_pb2.TrainingEvent) -> TrainingEvent:
    return TrainingEvent(
        sequence=m.sequence,
        run_id=m.run_id,
        step=m.step,
        policy_version=m.policy_version,
        metrics=dict(m.metrics),
        time=ts_to_float(m.time),
    )
