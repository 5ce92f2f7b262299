"""What the store keeps per rollout, attempt and worker, beyond the domain objects it hands out."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_grpc.types import Attempt, ResourcesUpdate, Rollout, Worker

from .span_ids import SpanIdIndex


@dataclass(slots=True)
class SpanRecord:
    """One stored span: ids broken out for queries, the rest kept as its serialized bytes.

    ``body`` is the span exactly as received; readers append the authoritative rollout id,
    attempt id and sequence id to it (in Protobuf the last value of a field wins).
    """

    rollout_id: str
    attempt_id: str
    span_id: str
    trace_id: str
    parent_span_id: str
    name: str
    start_time_unix_nano: int
    end_time_unix_nano: int
    body: bytes
    sequence_id: int = 0
    attempt_no: int = 0


@dataclass(slots=True)
class AttemptState:
    attempt: Attempt
    #: The next sequence id the store hands out for this attempt.
    next_sequence_id: int = 1
    #: span_id -> sequence_id of the stored spans; None until loaded (see Store._span_index).
    span_ids: SpanIdIndex | None = None
    #: Sequence ids in use, built only once a client numbers spans itself.
    used_sequence_ids: set[int] | None = None
    span_count: int = 0
    #: The DequeueRollouts request that created the attempt, for idempotent retries.
    request_id: str = ""
    index_used_at: float = 0.0
    #: Seconds added to the attempt's deadlines because the store could not write meanwhile (a full disk):
    #: to its timeout for good, to its silence until its next sign of life.
    timeout_grace: float = 0.0
    silence_grace: float = 0.0


@dataclass(slots=True)
class RolloutState:
    rollout: Rollout
    attempts: list[AttemptState] = field(default_factory=list)
    #: Position in the queue (grows with every enqueue); meaningful while queued.
    queue_seq: int = 0
    #: Hash of the creation request, to tell an idempotent retry from a conflicting reuse of an id.
    fingerprint: str = ""
    #: Estimated bytes held (in-memory backend accounting).
    bytes: int = 0
    #: Creation order (ties of create_time are broken by it; page cursors use it).
    create_seq: int = 0

    @property
    def latest(self) -> AttemptState | None:
        return self.attempts[-1] if self.attempts else None


@dataclass(slots=True)
class WorkerState:
    worker: Worker
    active_attempts: set[str] = field(default_factory=set)


@dataclass(slots=True)
class ResourcesState:
    resources: ResourcesUpdate
    fingerprint: str = ""


@dataclass(slots=True)
class Change:
    """One entry of the rollout change log (WatchRollouts)."""

    revision: int
    rollout: Rollout


@dataclass
class Txn:
    """Everything one store operation changed; the backend persists it in one commit."""

    rollouts: dict[str, RolloutState] = field(default_factory=dict)
    attempts: dict[str, AttemptState] = field(default_factory=dict)
    workers: dict[str, WorkerState] = field(default_factory=dict)
    resources: dict[str, ResourcesState] = field(default_factory=dict)
    spans: list[SpanRecord] = field(default_factory=list)
    deleted_rollouts: list[str] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    span_rollouts: set[str] = field(default_factory=set)
    meta: dict[str, str] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.rollouts
            or self.attempts
            or self.workers
            or self.resources
            or self.spans
            or self.deleted_rollouts
            or self.changes
            or self.meta
        )


@dataclass
class LoadedState:
    """What a backend holds at start-up."""

    store_id: str
    rollouts: list[RolloutState] = field(default_factory=list)
    workers: list[WorkerState] = field(default_factory=list)
    resources: list[ResourcesState] = field(default_factory=list)
    latest_resources_id: str = ""
    changes: list[Change] = field(default_factory=list)
    revision: int = 0
    total_spans: int = 0
    #: The store's key/value metadata (store id, revision, and what other cores keep there).
    meta: dict[str, str] = field(default_factory=dict)
