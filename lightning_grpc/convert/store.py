"""The Store's objects: rollouts, attempts, rollout specs, workers and resources."""

from __future__ import annotations

from collections.abc import Mapping

from lightning_grpc import types as t
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.v1 import resource_pb2, rollout_pb2, store_service_pb2, worker_pb2

from .values import (
    dict_to_struct,
    duration_to_float,
    float_to_duration,
    python_to_value,
    set_ts,
    struct_to_dict,
    ts_to_float,
    value_to_python,
)

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
        credential=m.credential,
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


# ------------------------------------------------------------------ statistics

#: The prefix of the rollout status names that key ``GetStatisticsResponse.rollouts_by_status``.
_STATUS_PREFIX = "ROLLOUT_STATUS_"


def statistics_to_pb(
    s: t.Statistics, out: store_service_pb2.GetStatisticsResponse | None = None
) -> store_service_pb2.GetStatisticsResponse:
    """The store's statistics as the wire message (status counts keyed ``ROLLOUT_STATUS_<NAME>``)."""
    m = out if out is not None else store_service_pb2.GetStatisticsResponse()
    for name, count in s.rollouts_by_status.items():
        m.rollouts_by_status[_STATUS_PREFIX + name.removeprefix(_STATUS_PREFIX).upper()] = count
    m.total_rollouts = s.total_rollouts
    m.total_attempts = s.total_attempts
    m.total_spans = s.total_spans
    m.total_resources = s.total_resources
    m.total_workers = s.total_workers
    float_to_duration(s.uptime, m.uptime)
    m.backend = s.backend
    m.memory_bytes = s.memory_bytes
    m.storage_bytes = s.storage_bytes
    m.queue_length = s.queue_length
    return m


def statistics_from_pb(m: store_service_pb2.GetStatisticsResponse) -> t.Statistics:
    """The statistics clients return: status counts keyed by lower-case status name ("queuing")."""
    return t.Statistics(
        rollouts_by_status={
            k.removeprefix(_STATUS_PREFIX).lower(): v for k, v in sorted(m.rollouts_by_status.items())
        },
        total_rollouts=m.total_rollouts,
        total_attempts=m.total_attempts,
        total_spans=m.total_spans,
        total_resources=m.total_resources,
        total_workers=m.total_workers,
        uptime=duration_to_float(m.uptime) or 0.0,
        backend=m.backend,
        memory_bytes=m.memory_bytes,
        storage_bytes=m.storage_bytes,
        queue_length=m.queue_length,
    )


def statistics_view(s: t.Statistics) -> t.Statistics:
    """Statistics read from a Store in this process, in the form a remote client returns them.

    Passes them through the wire conversion, so a local and a remote store answer the same keys
    (and the uptime at the wire's precision).
    """
    return statistics_from_pb(statistics_to_pb(s))
