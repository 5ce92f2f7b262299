"""Plain Python objects of the domain: what the core works on and what the client returns.

Enum numbers equal the ``lightning.v1`` enum numbers, so conversion is a cast. Times are float
seconds since the epoch (span times stay integer nanoseconds, as in OpenTelemetry).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar


class RolloutStatus(enum.IntEnum):
    UNSPECIFIED = 0
    QUEUING = 1
    PREPARING = 2
    RUNNING = 3
    REQUEUING = 4
    SUCCEEDED = 5
    FAILED = 6
    CANCELLED = 7

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_ROLLOUT_STATUSES

    @property
    def is_queued(self) -> bool:
        return self in (RolloutStatus.QUEUING, RolloutStatus.REQUEUING)

    def __str__(self) -> str:
        return self.name.lower()


class AttemptStatus(enum.IntEnum):
    UNSPECIFIED = 0
    PREPARING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    TIMEOUT = 5
    UNRESPONSIVE = 6
    CANCELLED = 7

    @property
    def is_active(self) -> bool:
        return self in (AttemptStatus.PREPARING, AttemptStatus.RUNNING)

    def __str__(self) -> str:
        return self.name.lower()


class RolloutMode(enum.IntEnum):
    UNSPECIFIED = 0
    TRAIN = 1
    VAL = 2
    TEST = 3

    def __str__(self) -> str:
        return self.name.lower() if self else ""


class WorkerStatus(enum.IntEnum):
    UNSPECIFIED = 0
    IDLE = 1
    BUSY = 2
    UNKNOWN = 3

    def __str__(self) -> str:
        return self.name.lower()


TERMINAL_ROLLOUT_STATUSES = frozenset(
    {RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED}
)
RETRYABLE_ATTEMPT_STATUSES = frozenset(
    {AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE}
)


@dataclass
class RolloutConfig:
    """Deadlines (seconds; None: no limit) and the retry policy of a rollout's attempts."""

    timeout: float | None = None
    unresponsive_timeout: float | None = None
    #: Attempts in all, the first included; 0 means 1 (as on the wire, where 0 is "not set").
    max_attempts: int = 1
    retry_on: tuple[AttemptStatus, ...] = ()


@dataclass
class Attempt:
    rollout_id: str
    attempt_id: str
    sequence_number: int
    status: AttemptStatus = AttemptStatus.PREPARING
    worker_id: str = ""
    start_time: float = 0.0
    end_time: float | None = None
    last_heartbeat_time: float | None = None
    status_message: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    #: The attempt credential, when it came with a dequeue or start answer from a server with auth on.
    #: Never stored.
    credential: str = field(default="", repr=False, compare=False)


@dataclass
class Rollout:
    rollout_id: str
    input: Any = None
    mode: RolloutMode = RolloutMode.UNSPECIFIED
    resources_id: str = ""
    group_id: str = ""
    status: RolloutStatus = RolloutStatus.QUEUING
    config: RolloutConfig = field(default_factory=RolloutConfig)
    metadata: dict[str, Any] = field(default_factory=dict)
    create_time: float = 0.0
    start_time: float | None = None
    end_time: float | None = None
    latest_attempt: Attempt | None = None
    attempt_count: int = 0
    status_message: str = ""

    @property
    def attempt(self) -> Attempt | None:
        """The latest attempt (the reference store's name for it)."""
        return self.latest_attempt


@dataclass
class RolloutSpec:
    """What a new rollout carries (the input of enqueue and start)."""

    input: Any = None
    rollout_id: str = ""
    mode: RolloutMode = RolloutMode.UNSPECIFIED
    resources_id: str = ""
    group_id: str = ""
    config: RolloutConfig = field(default_factory=RolloutConfig)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Worker:
    worker_id: str
    status: WorkerStatus = WorkerStatus.UNKNOWN
    heartbeat_stats: dict[str, Any] = field(default_factory=dict)
    last_heartbeat_time: float | None = None
    last_dequeue_time: float | None = None
    current_rollout_id: str = ""
    current_attempt_id: str = ""


@dataclass
class LLM:
    """An OpenAI-compatible endpoint."""

    endpoint: str
    model: str
    api_key: str = field(default="", repr=False)
    sampling_parameters: dict[str, Any] = field(default_factory=dict)

    def base_url(self) -> str:
        return self.endpoint


@dataclass
class ProxyLLM:
    """An endpoint behind the proxy; each attempt gets its own routed URL."""

    endpoint: str
    model: str
    api_key: str = field(default="", repr=False)
    sampling_parameters: dict[str, Any] = field(default_factory=dict)

    def base_url(self, rollout_id: str, attempt_id: str) -> str:
        """``{endpoint}/rollout/{rollout_id}/attempt/{attempt_id}``, keeping a trailing ``/v1`` last."""
        if not rollout_id or not attempt_id:
            raise ValueError("a proxy endpoint needs both a rollout id and an attempt id")
        base = self.endpoint.rstrip("/")
        suffix = ""
        if base.endswith("/v1"):
            base, suffix = base[:-3], "/v1"
        return f"{base}/rollout/{rollout_id}/attempt/{attempt_id}{suffix}"

    def for_attempt(self, rollout_id: str, attempt_id: str) -> LLM:
        return LLM(
            endpoint=self.base_url(rollout_id, attempt_id),
            model=self.model,
            api_key=self.api_key,
            sampling_parameters=dict(self.sampling_parameters),
        )


@dataclass
class PromptTemplate:
    template: str
    engine: str = "f-string"

    def format(self, **values: Any) -> str:
        if self.engine == "f-string":
            return self.template.format(**values)
        if self.engine == "jinja":
            import jinja2

            template: jinja2.Template = jinja2.Template(self.template)
            return template.render(**values)
        raise ValueError(f"unknown template engine {self.engine!r}")


@dataclass
class JsonResource:
    """A free JSON resource."""

    value: Any


Resource = LLM | ProxyLLM | PromptTemplate | JsonResource


@dataclass
class ResourcesUpdate:
    resources_id: str
    version: int
    resources: dict[str, Resource]
    create_time: float = 0.0
    update_time: float = 0.0


@dataclass
class SpanEvent:
    name: str
    time_unix_nano: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpanLink:
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Span:
    """An OpenTelemetry-shaped span. Attribute values are str, bool, int, float, bytes, lists or dicts."""

    trace_id: str
    span_id: str
    name: str
    rollout_id: str = ""
    attempt_id: str = ""
    sequence_id: int = 0
    parent_span_id: str = ""
    kind: int = 0
    start_time_unix_nano: int = 0
    end_time_unix_nano: int = 0
    status_code: int = 0
    status_message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    links: list[SpanLink] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)


@dataclass
class Statistics:
    rollouts_by_status: dict[str, int]
    total_rollouts: int
    total_attempts: int
    total_spans: int
    total_resources: int
    total_workers: int
    uptime: float
    backend: str
    memory_bytes: int = 0
    queue_length: int = 0
    #: The SQLite database on disk, its write-ahead log included (0 in memory).
    storage_bytes: int = 0


@dataclass
class DeleteResult:
    deleted_rollouts: int = 0
    deleted_attempts: int = 0
    deleted_spans: int = 0


@dataclass
class AddSpansResult:
    """What a batch of spans became: each span's sequence id, in request order, and the counts."""

    sequence_ids: list[int]
    stored_count: int
    duplicate_count: int


@dataclass
class AttemptHeartbeat:
    """The answer to an attempt's heartbeat: the attempt now, and whether its runner should stop."""

    attempt: Attempt
    rollout_status: RolloutStatus
    cancelled: bool
    should_stop: bool


@dataclass
class WatchEvent:
    """A rollout change (``rollout`` set) or a progress message (``rollout`` None)."""

    rollout: Rollout | None
    resume_token: str
    revision: int


@dataclass
class Page:
    """One page of a list call."""

    items: list[Any]
    next_page_token: str = ""
    total_size: int = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


def copy_rollout(rollout: Rollout) -> Rollout:
    """A snapshot of a rollout whose later changes in the store do not show through.

    The rollout and its latest attempt are copied field by field (shallow, as :func:`dataclasses.replace`
    copies, at a fraction of its cost: the store takes several snapshots a call, and ``replace`` runs each
    dataclass's ``__init__``).
    """
    copied = _fields_copy(rollout)
    if rollout.latest_attempt is not None:
        copied.latest_attempt = _fields_copy(rollout.latest_attempt)
    return copied


_Plain = TypeVar("_Plain", Rollout, Attempt)


def _fields_copy(obj: _Plain) -> _Plain:
    copied = object.__new__(type(obj))
    copied.__dict__.update(obj.__dict__)
    return copied


# ------------------------------------------------------------------ the LLM proxy
class BackendDialect(enum.IntEnum):
    """How the proxy talks to a backend (numbers equal ``lightning.v1.BackendDialect``)."""

    UNSPECIFIED = 0
    #: vLLM's OpenAI server or the embedded engine: passed through directly, token ids requested.
    VLLM = 1
    #: Any other OpenAI-compatible server or hosted provider: through LiteLLM, no token ids.
    OPENAI = 2

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> BackendDialect:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"{text!r} is not a backend dialect (vllm or openai)") from None


@dataclass(frozen=True)
class Backend:
    """One model server. ``api_base`` is the URL under which ``/chat/completions`` lives (``/v1`` is
    added to a bare ``http://host:port``)."""

    model_name: str
    api_base: str
    dialect: BackendDialect = BackendDialect.VLLM
    backend_model: str = ""
    api_key: str = field(default="", repr=False)
    policy_version: int = 0

    @property
    def target_model(self) -> str:
        """The model name sent to the backend."""
        return self.backend_model or self.model_name

    @property
    def public_name(self) -> str:
        """How errors told to agents name the backend: by the model it serves, never by its address."""
        return f"the backend of model {self.model_name!r}"


@dataclass
class BackendStats:
    calls: int = 0
    errors: int = 0
    in_flight: int = 0


@dataclass
class ProxyStatus:
    paused: bool
    pause_reason: str
    in_flight: int
    total_calls: int
    total_errors: int
    refused_calls: int
    backends: dict[str, BackendStats]
    http_address: str
    spans_stored: int
    spans_dropped: int
