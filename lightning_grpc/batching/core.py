"""The trainer core: groups in, whole-group batches out, training steps recorded. No gRPC here.

It sits on the Store core and reads it directly: groups are rollouts (their metadata says which
group, sample and step they belong to, and which batch took them), so the Store's durability is the
trainer's. Reported steps are kept in the Store's key/value metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_grpc import logs
from lightning_grpc.errors import InvalidArgumentError, NotFoundError, Reason, UnavailableError
from lightning_grpc.store import Store
from lightning_grpc.triplets import Aggregated, RolloutTriplets, rows_from_triplets
from lightning_grpc.types import Rollout, RolloutConfig, RolloutMode, RolloutSpec, RolloutStatus

from .batches import BuiltBatch, PreparedRollouts, SpanReader, build_batch
from .groups import (
    BATCH_KEY,
    GROUP_SIZE_KEY,
    SAMPLE_INDEX_KEY,
    STEP_KEY,
    Group,
    GroupBook,
    has_ended,
    is_group_id,
    new_group_id,
    rollout_ids_of,
)
from .options import MAX_GROUPS, BatchOptions

log = logs.get_logger(__name__)

MAX_SAMPLES = 10_000
MAX_GROUP_SIZE = 1024
MAX_METRICS = 1000
MAX_INTERRUPTIONS = 100
MAX_PROCESS_LENGTH = 128
MAX_INTERRUPTION_TEXT = 4096
EVENT_KEY = "trainer.event."
POLICY_VERSION_KEY = "trainer.policy_version"
DEFAULT_RUN = "default"


@dataclass
class GroupSample:
    """One task input of a submission; ``group_id`` makes the submission idempotent."""

    input: Any = None
    group_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunInterruption:
    """One interruption of a training run and its recovery: a process of the run died and came back."""

    #: When the interruption was noticed (Unix seconds).
    time: float
    #: Which process died: "server", "engine", "runners", "trainer", ...
    process: str
    #: Why, in words: e.g. "exited with signal 9 (SIGKILL)".
    cause: str
    #: How the run recovered and what was redone: e.g. "restarted on the same port after 1.0 s back-off".
    recovery: str
    #: How long the recovery took (seconds).
    recovery_seconds: float
    #: The training step during which it happened.
    step: int


@dataclass
class TrainingEvent:
    sequence: int
    run_id: str
    step: int
    policy_version: int
    metrics: dict[str, float]
    time: float
    #: The run's interruptions recovered since its previous report, oldest first.
    interruptions: list[RunInterruption] = field(default_factory=list)

    @classmethod
    def from_json(cls, text: str) -> TrainingEvent:
        """An event as kept in the Store's metadata (events stored before interruptions existed load too)."""
        data = json.loads(text)
        data["interruptions"] = [RunInterruption(**i) for i in data.get("interruptions", [])]
        return cls(**data)


@dataclass
class BatchResult:
    batch: BuiltBatch
    carried_over_groups: int
    closed_by_deadline: bool


@dataclass
class GroupCounts:
    mode: RolloutMode
    pending: int = 0
    ready: int = 0
    carried_over: int = 0
    consumed: int = 0


@dataclass
class TrainerStatus:
    groups: list[GroupCounts]
    drops: dict[str, int]
    batches: int
    rows: int
    policy_version: int
    last_event: TrainingEvent | None
    #: Rollouts whose trajectory rows fell back to one row per call, by reason.
    fallbacks: dict[str, int] = field(default_factory=dict)


@dataclass
class RolloutInspection:
    rollout: Rollout
    triplets: RolloutTriplets
    rows: Aggregated


class TrainerCore:
    def __init__(self, store: Store, read_spans: SpanReader, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.read_spans = read_spans
        self.clock = clock
        self.book = GroupBook()
        self.prepared = PreparedRollouts(read_spans, store.attempt_span_count)
        #: The adapter options of the last batch: finished rollouts are prepared with them ahead of time.
        self.adapter_config = BatchOptions().adapter_config
        self.aggregation = "transition"
        self._preparing: asyncio.Task[None] | None = None
        self.drops: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.batches = 0
        self.rows = 0
        self.policy_version = 0
        self._events: list[TrainingEvent] = []
        self._event_added: asyncio.Event | None = None

    async def start(self) -> TrainerCore:
        """Rebuild the groups and the training history from the Store."""
        await self.store.durable()
        self.book.rebuild(self.store.rollouts_where(lambda r: GROUP_SIZE_KEY in r.metadata))
        stored = self.store.meta_items(EVENT_KEY)
        self._events = [TrainingEvent.from_json(stored[k]) for k in sorted(stored)]
        self.policy_version = int(self.store.meta_items(POLICY_VERSION_KEY).get(POLICY_VERSION_KEY, "0"))
        self._event_added = asyncio.Event()
        self._preparing = asyncio.create_task(
            self._prepare_finished_rollouts(), name="lightning-trainer-prepare"
        )
        log.info("event=trainer_started groups=%d training_events=%d", len(self.book), len(self._events))
        return self

    async def close(self) -> None:
        if self._preparing is not None:
            self._preparing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._preparing

    async def _prepare_finished_rollouts(self) -> None:
        """Turn each trainer rollout into triplets and rows as it ends, so that batches are quick to cut."""
        terminal = [int(s) for s in RolloutStatus if s.is_terminal]
        try:
            async for event in self.store.watch_rollouts(
                statuses=terminal, progress_interval=60, where=_unbatched_trainer_rollout
            ):
                r = event.rollout
                if r is None:
                    continue
                try:
                    triplets = await self.prepared.triplets(r, self.adapter_config)
                    self.prepared.rows(r, self.adapter_config, triplets, self.aggregation)
                except Exception as exc:  # preparing is an optimisation: the batch computes it again
                    log.warning("event=trainer_prepare_failed rollout_id=%s error=%r", r.rollout_id, exc)
        except UnavailableError as exc:
            if exc.reason != Reason.SHUTTING_DOWN:
                log.warning("event=trainer_prepare_stopped error=%r", exc)
        except Exception as exc:
            log.warning("event=trainer_prepare_stopped error=%r", exc)

    # ------------------------------------------------------------ groups
    async def submit_groups(
        self,
        samples: Sequence[GroupSample],
        group_size: int,
        *,
        mode: RolloutMode = RolloutMode.TRAIN,
        resources_id: str = "",
        config: RolloutConfig | None = None,
        step: int = 0,
    ) -> list[Group]:
        """Enqueue ``group_size`` rollouts per sample, one group per sample."""
        _check_submission(samples, group_size, step)
        mode = mode or RolloutMode.TRAIN
        groups, specs = [], []
        for sample in samples:
            group_id = sample.group_id or new_group_id()
            group = Group(group_id, rollout_ids_of(group_id, group_size), mode, step)
            groups.append(group)
            for index, rollout_id in enumerate(group.rollout_ids):
                metadata = {
                    **sample.metadata,
                    GROUP_SIZE_KEY: group_size,
                    SAMPLE_INDEX_KEY: index,
                    STEP_KEY: step,
                }
                specs.append(
                    RolloutSpec(
                        input=sample.input,
                        rollout_id=rollout_id,
                        mode=mode,
                        resources_id=resources_id,
                        group_id=group_id,
                        config=config or RolloutConfig(),
                        metadata=metadata,
                    )
                )
        for start in range(0, len(specs), 10_000):
            await self.store.enqueue_rollouts(specs[start : start + 10_000])
        return [self.book.add(g) for g in groups]

    # ------------------------------------------------------------ batches
    async def get_batch(
        self,
        *,
        request_id: str = "",
        mode: RolloutMode = RolloutMode.TRAIN,
        min_groups: int = 1,
        max_groups: int = 0,
        wait: float = 0.0,
        options: BatchOptions | None = None,
    ) -> BatchResult:
        """A batch of whole groups: waits up to ``wait`` seconds for ``min_groups``, takes at most ``max_groups``.

        0 means the default, as on the wire: TRAIN for ``mode``, 1 for ``min_groups``, ``min_groups`` for
        ``max_groups``.
        """
        options = options or BatchOptions()
        mode = mode or RolloutMode.TRAIN
        min_groups = min_groups or 1
        max_groups = max_groups or min_groups
        _check_batch_request(request_id, min_groups, max_groups)
        batch_id = request_id or f"b-{uuid.uuid4().hex[:16]}"
        taken = self.book.taken_by(batch_id)
        if taken:  # a retry: the same groups again
            return await self._built(batch_id, taken, options, carried=self._carried_over(mode), short=False)
        deadline = self.clock() + wait
        while True:
            await self.store.durable()
            ready = self._ended_groups(mode)
            if len(ready) >= min_groups or self.clock() >= deadline:
                break
            self.store.check_not_draining()
            await self.store.wait_for_commit(max(0.0, deadline - self.clock()))
        chosen = ready[:max_groups]
        self.book.take(chosen, batch_id)  # at once, so a concurrent request cannot take them too
        carried = self._mark_carried_over(mode)
        try:
            if chosen:
                ids = [
                    rid for g in chosen for rid in g.rollout_ids if self.store.rollout_status(rid) is not None
                ]
                await self.store.merge_rollout_metadata(ids, {BATCH_KEY: batch_id})
        except BaseException:
            self.book.release(chosen)
            raise
        result = await self._built(batch_id, chosen, options, carried=carried, short=len(chosen) < min_groups)
        self.batches += 1
        self.rows += result.batch.row_count
        self.drops.update(result.batch.drops)
        self.fallbacks.update(result.batch.fallbacks)
        log.info(
            "event=batch_built batch_id=%s groups=%d rows=%d carried_over=%d closed_by_deadline=%s",
            batch_id,
            len(chosen),
            result.batch.row_count,
            carried,
            result.closed_by_deadline,
        )
        return result

    async def _built(
        self, batch_id: str, groups: Sequence[Group], options: BatchOptions, *, carried: int, short: bool
    ) -> BatchResult:
        self.adapter_config, self.aggregation = options.adapter_config, options.aggregation.name.lower()
        # the groups have ended: their rollouts are final, read without copies
        rollouts = self.store.rollout_snapshots((rid for g in groups for rid in g.rollout_ids), copy=False)
        batch = await build_batch(batch_id, groups, rollouts, self.prepared, options)
        return BatchResult(batch, carried, short)

    def _statuses(self, groups: Sequence[Group]) -> dict[str, RolloutStatus | None]:
        return {rid: self.store.rollout_status(rid) for g in groups for rid in g.rollout_ids}

    def _ended_groups(self, mode: RolloutMode) -> list[Group]:
        open_groups = self.book.open_of_mode(mode)
        status = self._statuses(open_groups)
        return [g for g in open_groups if has_ended(g, status)]

    def _running_groups(self, mode: RolloutMode) -> list[Group]:
        """Groups of ``mode`` not taken by a batch with a sibling still running."""
        open_groups = self.book.open_of_mode(mode)
        status = self._statuses(open_groups)
        return [g for g in open_groups if not has_ended(g, status)]

    def _mark_carried_over(self, mode: RolloutMode) -> int:
        running = self._running_groups(mode)
        for group in running:
            group.carried_over = True
        return len(running)

    def _carried_over(self, mode: RolloutMode) -> int:
        return len(self._running_groups(mode))

    # ------------------------------------------------------------ steps
    async def report_step(
        self,
        run_id: str,
        step: int,
        policy_version: int,
        metrics: Mapping[str, float],
        interruptions: Sequence[RunInterruption] = (),
    ) -> TrainingEvent:
        """Record a finished step; its policy version becomes the trainer's current one.

        ``interruptions`` are the run's interruptions recovered since its previous report. The same step
        reported again with the same content (interruptions included) returns the stored event (a retry);
        with other content it is recorded anew (a run resumed from an earlier checkpoint).
        """
        _check_step(run_id, step, policy_version, metrics)
        _check_interruptions(interruptions)
        run_id = run_id or DEFAULT_RUN
        values = {k: float(v) for k, v in metrics.items()}
        recovered = [_normalized(i) for i in interruptions]
        for earlier in reversed(self._events):  # a resent report: the stored event
            if (earlier.run_id, earlier.step) == (run_id, step):
                content = (earlier.policy_version, earlier.metrics, earlier.interruptions)
                if content == (policy_version, values, recovered):
                    return earlier
                break
        event = TrainingEvent(
            sequence=(self._events[-1].sequence + 1) if self._events else 1,
            run_id=run_id,
            step=step,
            policy_version=policy_version,
            metrics=values,
            time=self.clock(),
            interruptions=recovered,
        )
        self._events.append(event)
        self.policy_version = policy_version
        try:
            await self.store.put_meta(
                {
                    f"{EVENT_KEY}{event.sequence:012d}": json.dumps(asdict(event)),
                    POLICY_VERSION_KEY: str(policy_version),
                }
            )
        except BaseException:
            self._events.remove(event)
            raise
        if self._event_added is not None:
            self._event_added.set()
            self._event_added = asyncio.Event()
        return event

    async def watch_training(
        self, run_id: str = "", after_sequence: int = 0, follow: bool = False
    ) -> AsyncIterator[TrainingEvent]:
        """Events after ``after_sequence`` (of one run, or all); with ``follow``, new ones as they come."""
        if after_sequence < 0:
            raise InvalidArgumentError("after_sequence", f"must be at least 0 (got {after_sequence})")
        cursor = after_sequence
        while True:
            for event in [e for e in self._events if e.sequence > cursor]:
                cursor = event.sequence
                if not run_id or event.run_id == run_id:
                    yield event
            if not follow:
                return
            self.store.check_not_draining()
            added = self._event_added
            if added is None:
                return
            try:
                await asyncio.wait_for(added.wait(), 1.0)
            except TimeoutError:
                pass

    # ------------------------------------------------------------ inspection
    def status(self) -> TrainerStatus:
        counts: dict[RolloutMode, GroupCounts] = {}
        groups = self.book.all()
        status = self._statuses([g for g in groups if not g.batch_id])
        for group in groups:
            c = counts.setdefault(group.mode, GroupCounts(group.mode))
            if group.batch_id:
                c.consumed += 1
            elif has_ended(group, status):
                c.ready += 1
            else:
                c.pending += 1
                c.carried_over += int(group.carried_over)
        return TrainerStatus(
            groups=[counts[m] for m in sorted(counts)],
            drops=dict(self.drops),
            batches=self.batches,
            rows=self.rows,
            policy_version=self.policy_version,
            last_event=self._events[-1] if self._events else None,
            fallbacks=dict(self.fallbacks),
        )

    async def inspect(self, rollout_id: str, options: BatchOptions | None = None) -> RolloutInspection:
        """The triplets and rows of a rollout's latest attempt, with the reasons for what is not trained."""
        options = options or BatchOptions()
        snapshot = self.store.rollout_snapshots([rollout_id]).get(rollout_id)
        if snapshot is None:
            if not rollout_id:
                raise InvalidArgumentError("rollout_id", "is required")
            raise NotFoundError(
                f"rollout {rollout_id} not found", reason=Reason.ROLLOUT_NOT_FOUND, rolloutId=rollout_id
            )
        await self.store.durable()
        triplets = await self.prepared.triplets(snapshot, options.adapter_config)
        return RolloutInspection(
            snapshot, triplets, rows_from_triplets(triplets.triplets, options.aggregation.name.lower())
        )


def _unbatched_trainer_rollout(r: Rollout) -> bool:
    """Whether ``r`` is a trainer rollout (of a submitted group) not yet cut into a batch."""
    return GROUP_SIZE_KEY in r.metadata and BATCH_KEY not in r.metadata


def _check_submission(samples: Sequence[GroupSample], group_size: int, step: int) -> None:
    if not samples:
        raise InvalidArgumentError("samples", "must hold at least one sample")
    if len(samples) > MAX_SAMPLES:
        raise InvalidArgumentError("samples", f"must hold at most {MAX_SAMPLES} samples (got {len(samples)})")
    if not 1 <= group_size <= MAX_GROUP_SIZE:
        raise InvalidArgumentError("group_size", f"must be between 1 and {MAX_GROUP_SIZE} (got {group_size})")
    if step < 0:
        raise InvalidArgumentError("step", f"must be at least 0 (got {step})")
    seen: set[str] = set()
    for i, sample in enumerate(samples):
        gid = sample.group_id
        if gid and not is_group_id(gid):
            raise InvalidArgumentError(
                f"samples[{i}].group_id",
                "must be 1-120 letters, digits or ._:- and start with a letter or digit",
            )
        if len(sample.metadata) > 100:
            raise InvalidArgumentError(f"samples[{i}].metadata", "must hold at most 100 keys")
        if gid and gid in seen:
            raise InvalidArgumentError(f"samples[{i}].group_id", f"repeats {gid!r} within the request")
        seen.add(gid)


def _check_batch_request(request_id: str, min_groups: int, max_groups: int) -> None:
    if request_id and not is_group_id(request_id):
        raise InvalidArgumentError(
            "request_id", "must be 1-120 letters, digits or ._:- and start with a letter or digit"
        )
    if not 1 <= min_groups <= MAX_GROUPS:
        raise InvalidArgumentError("min_groups", f"must be between 1 and {MAX_GROUPS} (got {min_groups})")
    if not min_groups <= max_groups <= MAX_GROUPS:
        raise InvalidArgumentError(
            "max_groups", f"must be between min_groups ({min_groups}) and {MAX_GROUPS} (got {max_groups})"
        )


def _check_step(run_id: str, step: int, policy_version: int, metrics: Mapping[str, float]) -> None:
    if len(run_id) > 128:
        raise InvalidArgumentError("run_id", "must be at most 128 characters")
    if step < 0:
        raise InvalidArgumentError("step", f"must be at least 0 (got {step})")
    if policy_version < 0:
        raise InvalidArgumentError("policy_version", f"must be at least 0 (got {policy_version})")
    if len(metrics) > MAX_METRICS:
        raise InvalidArgumentError("metrics", f"must hold at most {MAX_METRICS} entries")
    for name, value in metrics.items():
        if not name or len(name) > 256:
            raise InvalidArgumentError("metrics", "names must be 1-256 characters")
        if not math.isfinite(value):
            raise InvalidArgumentError(f"metrics[{name!r}]", f"must be finite (got {value})")


def _check_interruptions(interruptions: Sequence[RunInterruption]) -> None:
    if len(interruptions) > MAX_INTERRUPTIONS:
        raise InvalidArgumentError(
            "interruptions", f"must hold at most {MAX_INTERRUPTIONS} entries (got {len(interruptions)})"
        )
    for i, interruption in enumerate(interruptions):
        name = f"interruptions[{i}]"
        if not interruption.process:
            raise InvalidArgumentError(f"{name}.process", "is required (the process that died)")
        if len(interruption.process) > MAX_PROCESS_LENGTH:
            raise InvalidArgumentError(f"{name}.process", f"must be at most {MAX_PROCESS_LENGTH} characters")
        for text in ("cause", "recovery"):
            if len(getattr(interruption, text)) > MAX_INTERRUPTION_TEXT:
                raise InvalidArgumentError(
                    f"{name}.{text}", f"must be at most {MAX_INTERRUPTION_TEXT} characters"
                )
        seconds = interruption.recovery_seconds
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidArgumentError(
                f"{name}.recovery_seconds", f"must be finite and at least 0 (got {seconds})"
            )
        if interruption.step < 0:
            raise InvalidArgumentError(f"{name}.step", f"must be at least 0 (got {interruption.step})")
        if not math.isfinite(interruption.time) or interruption.time < 0:
            raise InvalidArgumentError(f"{name}.time", f"must be a time (got {interruption.time})")


def _normalized(interruption: RunInterruption) -> RunInterruption:
    """The interruption as stored and compared: plain types."""
    return RunInterruption(
        time=float(interruption.time),
        process=str(interruption.process),
        cause=str(interruption.cause),
        recovery=str(interruption.recovery),
        recovery_seconds=float(interruption.recovery_seconds),
        step=int(interruption.step),
    )
