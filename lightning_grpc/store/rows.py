"""Domain objects <-> flat rows (JSON text for the free-form parts). Used by the SQLite and PostgreSQL backends."""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import queue
from collections.abc import Callable, Iterable
from typing import Any

from lightning_grpc.types import (
    LLM,
    Attempt,
    AttemptStatus,
    JsonResource,
    PromptTemplate,
    ProxyLLM,
    Resource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Worker,
    WorkerStatus,
)

from .backend import SpanQuery
from .state import AttemptState, ResourcesState, RolloutState, Txn, WorkerState

#: The largest signed 64-bit integer: span times are kept in such columns (the body keeps the exact fixed64).
INT64_MAX = 2**63 - 1


#: The compact JSON of stored rows, made once: ``json.dumps`` with options builds an encoder on every call.
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def dumps(value: Any) -> str:
    """``value`` as the compact JSON the rows keep (an empty dict, the usual metadata, without the encoder)."""
    if not value and isinstance(value, dict):
        return "{}"
    return _ENCODE(value)


def config_to_dict(config: RolloutConfig) -> dict[str, Any]:
    return {
        "timeout": config.timeout,
        "unresponsive_timeout": config.unresponsive_timeout,
        "max_attempts": config.max_attempts,
        "retry_on": [int(s) for s in config.retry_on],
    }


def config_from_dict(data: dict[str, Any]) -> RolloutConfig:
    return RolloutConfig(
        timeout=data.get("timeout"),
        unresponsive_timeout=data.get("unresponsive_timeout"),
        max_attempts=int(data.get("max_attempts", 1)),
        retry_on=tuple(AttemptStatus(s) for s in data.get("retry_on", ())),
    )


def attempt_row(state: AttemptState) -> dict[str, Any]:
    a = state.attempt
    return {
        "attempt_id": a.attempt_id,
        "rollout_id": a.rollout_id,
        "sequence_number": a.sequence_number,
        "status": int(a.status),
        "worker_id": a.worker_id,
        "start_time": a.start_time,
        "end_time": a.end_time,
        "last_heartbeat_time": a.last_heartbeat_time,
        "status_message": a.status_message,
        "metadata": dumps(a.metadata),
        "next_sequence_id": state.next_sequence_id,
        "span_count": state.span_count,
        "request_id": state.request_id,
    }


def attempt_from_row(row: dict[str, Any]) -> AttemptState:
    attempt = Attempt(
        rollout_id=row["rollout_id"],
        attempt_id=row["attempt_id"],
        sequence_number=row["sequence_number"],
        status=AttemptStatus(row["status"]),
        worker_id=row["worker_id"],
        start_time=row["start_time"],
        end_time=row["end_time"],
        last_heartbeat_time=row["last_heartbeat_time"],
        status_message=row["status_message"],
        metadata=json.loads(row["metadata"]),
    )
    return AttemptState(
        attempt=attempt,
        next_sequence_id=row["next_sequence_id"],
        span_count=row["span_count"],
        request_id=row["request_id"],
    )


def rollout_dict(r: Rollout) -> dict[str, Any]:
    """The JSON form of a rollout snapshot (with its latest attempt), for the change log."""
    return {
        "rollout_id": r.rollout_id,
        "input": r.input,
        "mode": int(r.mode),
        "resources_id": r.resources_id,
        "group_id": r.group_id,
        "status": int(r.status),
        "config": config_to_dict(r.config),
        "metadata": r.metadata,
        "create_time": r.create_time,
        "start_time": r.start_time,
        "end_time": r.end_time,
        "attempt_count": r.attempt_count,
        "status_message": r.status_message,
        "latest_attempt": attempt_row(AttemptState(r.latest_attempt)) if r.latest_attempt else None,
    }


def rollout_from_dict(d: dict[str, Any]) -> Rollout:
    latest = d.get("latest_attempt")
    if isinstance(latest, dict) and isinstance(latest.get("metadata"), str):
        latest_attempt: Attempt | None = attempt_from_row(latest).attempt
    else:
        latest_attempt = None
    return Rollout(
        rollout_id=d["rollout_id"],
        input=d["input"],
        mode=RolloutMode(d["mode"]),
        resources_id=d["resources_id"],
        group_id=d["group_id"],
        status=RolloutStatus(d["status"]),
        config=config_from_dict(d["config"]),
        metadata=d["metadata"],
        create_time=d["create_time"],
        start_time=d["start_time"],
        end_time=d["end_time"],
        attempt_count=d["attempt_count"],
        status_message=d["status_message"],
        latest_attempt=latest_attempt,
    )


def rollout_row(state: RolloutState) -> dict[str, Any]:
    r = state.rollout
    return {
        "rollout_id": r.rollout_id,
        "status": int(r.status),
        "mode": int(r.mode),
        "group_id": r.group_id,
        "resources_id": r.resources_id,
        "create_time": r.create_time,
        "start_time": r.start_time,
        "end_time": r.end_time,
        "attempt_count": r.attempt_count,
        "status_message": r.status_message,
        "queue_seq": state.queue_seq,
        "fingerprint": state.fingerprint,
        "input": dumps(r.input),
        "config": dumps(config_to_dict(r.config)),
        "metadata": dumps(r.metadata),
    }


def rollout_from_row(row: dict[str, Any]) -> RolloutState:
    rollout = Rollout(
        rollout_id=row["rollout_id"],
        input=json.loads(row["input"]),
        mode=RolloutMode(row["mode"]),
        resources_id=row["resources_id"],
        group_id=row["group_id"],
        status=RolloutStatus(row["status"]),
        config=config_from_dict(json.loads(row["config"])),
        metadata=json.loads(row["metadata"]),
        create_time=row["create_time"],
        start_time=row["start_time"],
        end_time=row["end_time"],
        attempt_count=row["attempt_count"],
        status_message=row["status_message"],
    )
    return RolloutState(rollout=rollout, queue_seq=row["queue_seq"], fingerprint=row["fingerprint"])


def worker_row(state: WorkerState) -> dict[str, Any]:
    w = state.worker
    return {
        "worker_id": w.worker_id,
        "status": int(w.status),
        "heartbeat_stats": dumps(w.heartbeat_stats),
        "last_heartbeat_time": w.last_heartbeat_time,
        "last_dequeue_time": w.last_dequeue_time,
        "current_rollout_id": w.current_rollout_id,
        "current_attempt_id": w.current_attempt_id,
    }


def worker_from_row(row: dict[str, Any]) -> WorkerState:
    return WorkerState(
        Worker(
            worker_id=row["worker_id"],
            status=WorkerStatus(row["status"]),
            heartbeat_stats=json.loads(row["heartbeat_stats"]),
            last_heartbeat_time=row["last_heartbeat_time"],
            last_dequeue_time=row["last_dequeue_time"],
            current_rollout_id=row["current_rollout_id"],
            current_attempt_id=row["current_attempt_id"],
        )
    )


def resource_to_dict(resource: Resource) -> dict[str, Any]:
    if isinstance(resource, LLM):
        return {"type": "llm", **_endpoint_fields(resource)}
    if isinstance(resource, ProxyLLM):
        return {"type": "proxy_llm", **_endpoint_fields(resource)}
    if isinstance(resource, PromptTemplate):
        return {"type": "prompt_template", "template": resource.template, "engine": resource.engine}
    return {"type": "json", "value": resource.value}


def _endpoint_fields(r: LLM | ProxyLLM) -> dict[str, Any]:
    return {
        "endpoint": r.endpoint,
        "model": r.model,
        "api_key": r.api_key,
        "sampling_parameters": r.sampling_parameters,
    }


def resource_from_dict(d: dict[str, Any]) -> Resource:
    kind = d["type"]
    if kind in ("llm", "proxy_llm"):
        cls = LLM if kind == "llm" else ProxyLLM
        return cls(
            endpoint=d["endpoint"],
            model=d["model"],
            api_key=d.get("api_key", ""),
            sampling_parameters=d.get("sampling_parameters", {}),
        )
    if kind == "prompt_template":
        return PromptTemplate(template=d["template"], engine=d["engine"])
    return JsonResource(value=d["value"])


def resources_body(resources: dict[str, Resource]) -> str:
    return json.dumps({k: resource_to_dict(v) for k, v in resources.items()}, sort_keys=True)


def resources_row(state: ResourcesState) -> dict[str, Any]:
    r = state.resources
    return {
        "resources_id": r.resources_id,
        "version": r.version,
        "create_time": r.create_time,
        "update_time": r.update_time,
        "body": resources_body(r.resources),
        "fingerprint": state.fingerprint,
    }


def resources_from_row(row: dict[str, Any]) -> ResourcesState:
    body = json.loads(row["body"])
    return ResourcesState(
        ResourcesUpdate(
            resources_id=row["resources_id"],
            version=row["version"],
            resources={k: resource_from_dict(v) for k, v in body.items()},
            create_time=row["create_time"],
            update_time=row["update_time"],
        ),
        fingerprint=row["fingerprint"],
    )


#: One kind of row a commit writes, and its rows: ``delete`` (rollout ids), ``rollouts``, ``attempts``,
#: ``workers``, ``resources`` (row dicts), ``spans`` (tuples in :data:`SPAN_COLUMNS` order), ``changes``
#: ((revision, rollout id, JSON body)), ``meta`` ((key, value)).
Op = tuple[str, Any]

SPAN_COLUMNS = (
    "rollout_id",
    "attempt_id",
    "attempt_no",
    "sequence_id",
    "span_id",
    "trace_id",
    "parent_span_id",
    "name",
    "start_ns",
    "end_ns",
    "body",
)


def span_filters(q: SpanQuery, *, mark: str, contains: str) -> tuple[list[str], list[Any]]:
    """The WHERE conditions of a span query and their parameters, in a database's own placeholder (``mark``:
    ``?`` or ``%s``) and substring test (``contains``: a template of the name column and a placeholder)."""
    where = [f"rollout_id = {mark}"]
    params: list[Any] = [q.rollout_id]
    if q.attempt_no:
        where.append(f"attempt_no = {mark}")
        params.append(q.attempt_no)
    for column, value in (
        ("trace_id", q.trace_id),
        ("span_id", q.span_id),
        ("parent_span_id", q.parent_span_id),
        ("name", q.name),
    ):
        if value:
            where.append(f"{column} = {mark}")
            params.append(value)
    if q.name_contains:
        where.append(contains)
        params.append(q.name_contains)
    return where, params


def txn_ops(tx: Txn) -> list[Op]:
    """Snapshot what ``tx`` changed as rows, in the order a commit writes them (deletes first).

    Runs on the event loop when the change is submitted, so that later changes to the same objects do not
    leak into this commit. Sets ``tx.meta["revision"]`` to the last change's revision."""
    ops: list[Op] = []
    if tx.deleted_rollouts:
        ops.append(("delete", list(tx.deleted_rollouts)))
    if tx.rollouts:
        ops.append(("rollouts", [rollout_row(rs) for rs in tx.rollouts.values()]))
    if tx.attempts:
        ops.append(("attempts", [attempt_row(a) for a in tx.attempts.values()]))
    if tx.workers:
        ops.append(("workers", [worker_row(w) for w in tx.workers.values()]))
    if tx.resources:
        ops.append(("resources", [resources_row(r) for r in tx.resources.values()]))
    if tx.spans:
        ops.append(
            (
                "spans",
                [
                    (
                        s.rollout_id,
                        s.attempt_id,
                        s.attempt_no,
                        s.sequence_id,
                        s.span_id,
                        s.trace_id,
                        s.parent_span_id,
                        s.name,
                        min(s.start_time_unix_nano, INT64_MAX),  # the body keeps the exact fixed64
                        min(s.end_time_unix_nano, INT64_MAX),
                        s.body,
                    )
                    for s in tx.spans
                ],
            )
        )
    if tx.changes:
        ops.append(
            (
                "changes",
                [(c.revision, c.rollout.rollout_id, dumps(rollout_dict(c.rollout))) for c in tx.changes],
            )
        )
        tx.meta["revision"] = str(tx.changes[-1].revision)
    if tx.meta:
        ops.append(("meta", list(tx.meta.items())))
    return ops


#: The key of each table whose rows are replaced whole (a later row of the same key replaces the earlier).
ROW_KEYS = {
    "rollouts": "rollout_id",
    "attempts": "attempt_id",
    "workers": "worker_id",
    "resources": "resources_id",
}


def upsert(table: str, payload: list[dict[str, Any]], mark: str) -> tuple[str, list[tuple[Any, ...]]]:
    """The statement and parameters that write ``payload``'s rows of ``table`` whole (see :func:`upsert_sql`)."""
    columns, values = row_values(payload)
    return upsert_sql(table, columns, mark), values


def row_values(payload: list[dict[str, Any]]) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """The columns of rows given as dicts with the same keys, and each row's values in their order."""
    columns = tuple(payload[0])
    return columns, [tuple(r[c] for c in columns) for r in payload]


@functools.lru_cache(maxsize=64)
def upsert_parts(table: str, columns: tuple[str, ...]) -> tuple[str, str]:
    """The statement that writes rows of ``table`` (one of :data:`ROW_KEYS`) whole, before and after its
    VALUES: the INSERT with its columns, and the ON CONFLICT clause.

    A row already there is updated where it lies: a delete and a new insert (SQLite's ``INSERT OR
    REPLACE``) would move it to a new place in the table and rewrite each of its index entries, so a
    commit of one changed attempt dirtied several pages, not one."""
    key = ROW_KEYS[table]
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c != key)
    return f"INSERT INTO {table} ({', '.join(columns)})", f" ON CONFLICT ({key}) DO UPDATE SET {updates}"


@functools.lru_cache(maxsize=64)
def upsert_sql(table: str, columns: tuple[str, ...], mark: str) -> str:
    """The statement that writes one row of ``table`` whole (see :func:`upsert_parts`), ``mark`` being the
    driver's parameter mark (``?`` or ``%s``)."""
    head, tail = upsert_parts(table, columns)
    return f"{head} VALUES ({', '.join(mark for _ in columns)}){tail}"


def merged_ops(submissions: Iterable[list[Op]]) -> list[Op]:
    """The ops of submissions committed in one transaction, as few as leave the same rows.

    A commit of many small submissions (a span batch each: its spans, its attempt's row, the revision) paid
    for each statement: a round trip to PostgreSQL, and with SQLite a hand-over of the GIL around every row
    run. Here the rows of one kind are put together, and of the rows that replace one another (a table's
    key, a meta key) only the last is kept: the rows written are the same as when each submission is
    applied in turn. Submissions that delete rollouts stay apart, in their place, so that nothing moves
    across a delete.
    """
    merged: list[Op] = []
    spans: list[Any] = []
    keyed: dict[str, dict[Any, Any]] = {}

    def flush() -> None:
        for kind in ROW_KEYS:  # the replaced rows first, in the order a submission writes them
            if keyed.get(kind):
                merged.append((kind, list(keyed[kind].values())))
        if spans:
            merged.append(("spans", spans.copy()))
        for kind in ("changes", "meta"):
            if keyed.get(kind):
                merged.append((kind, list(keyed[kind].values())))
        spans.clear()
        keyed.clear()

    for ops in submissions:
        if any(kind == "delete" for kind, _ in ops):
            flush()
            merged.extend(ops)
            continue
        for kind, payload in ops:
            if kind == "spans":
                spans.extend(payload)
                continue
            kept = keyed.setdefault(kind, {})
            key = ROW_KEYS.get(kind)
            for row in payload:
                kept[row[key] if key else row[0]] = row  # changes: (revision, ...); meta: (key, value)
    flush()
    return merged


def drop_rows_of(ops: list[Op], rollout_ids: set[str]) -> None:
    """Remove from submitted ``ops`` the rows of rollouts deleted after them (changes and meta stay)."""
    for i, (kind, payload) in enumerate(ops):
        if kind == "spans":
            ops[i] = (kind, [row for row in payload if row[0] not in rollout_ids])
        elif kind in ("rollouts", "attempts"):
            ops[i] = (kind, [row for row in payload if row["rollout_id"] not in rollout_ids])
    ops[:] = [(kind, payload) for kind, payload in ops if payload]


class DeleteOutcome(enum.Enum):
    """How one delete went when tried ahead of a batch waiting for space (see :func:`commit_deletes_first`)."""

    #: Committed: room may have been made.
    COMMITTED = "committed"
    #: Not even room to delete: it waits with the batch.
    WAITS = "waits"
    #: The database is out of reach: it waits with the batch, and no further delete is tried now.
    OUT_OF_REACH = "out_of_reach"
    #: Refused for good: its submitter was told.
    REFUSED = "refused"


#: One submission to a backend's writer thread: its ops, and the future its submitter awaits.
Submission = tuple[list[Op], "asyncio.Future[None]"]


def commit_deletes_first(
    submitted: queue.Queue[Submission | None],
    batch: list[Submission],
    try_delete: Callable[[Submission, set[str]], DeleteOutcome],
) -> bool:
    """While ``batch`` waits for space: take what was submitted since, trying each delete ahead of the batch
    (``try_delete`` commits it in a transaction of its own and answers its submitter), after dropping from
    the batch the rows of the rollouts it deletes; every other submission joins the batch. Returns whether a
    delete was committed (room may have been made). A ``None`` (the writer closing) is left for its loop."""
    freed = False
    while True:
        try:
            item = submitted.get_nowait()
        except queue.Empty:
            return freed
        if item is None:
            submitted.put(None)
            return freed
        deleted = {rid for kind, payload in item[0] if kind == "delete" for rid in payload}
        if not deleted:
            batch.append(item)
            continue
        for earlier, _ in batch:
            drop_rows_of(earlier, deleted)
        outcome = try_delete(item, deleted)
        if outcome is DeleteOutcome.COMMITTED:
            freed = True
        elif outcome is not DeleteOutcome.REFUSED:
            batch.append(item)
            if outcome is DeleteOutcome.OUT_OF_REACH:
                return freed


def resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    """Answer a submitter (called on its event loop): stored, or the error it hears."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def resolve_all(batch: list[Submission], error: BaseException | None) -> None:
    """Answer every submitter of a commit (called on their event loop, once for the whole commit: each
    hand-over from the writer's thread wakes the loop with a write to its self-pipe)."""
    for _, fut in batch:
        resolve(fut, error)
