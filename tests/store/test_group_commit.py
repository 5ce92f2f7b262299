"""Writes committed together: what is submitted before an earlier write is durable, and a commit of many
submissions, leave exactly what applying each in turn would (SQLite and PostgreSQL, read back by a new
server)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import grpc
import pytest

from lightning_grpc import convert
from lightning_grpc.client import StoreClient
from lightning_grpc.errors import NotFoundError
from lightning_grpc.server.app import ServerConfig, start_server
from lightning_grpc.store import SpanRecord, open_store, rows
from lightning_grpc.types import AttemptStatus, RolloutSpec, RolloutStatus, Span
from lightning_grpc.v1 import store_service_pb2 as pb
from tests.helpers import make_spans


@pytest.fixture(params=["sqlite", "postgres"], name="backend")
def durable_backend(request: pytest.FixtureRequest) -> str:
    """The backends with a writer that commits many submissions together."""
    return str(request.param)


def records(spans: list[Span]) -> list[SpanRecord]:
    return convert.span_records([convert.span_to_pb(s).SerializeToString() for s in spans])


async def test_a_batch_submitted_before_the_last_is_durable_sees_its_spans(tmp_path: Path) -> None:
    store = await open_store(tmp_path / "s.db")
    rollout = await store.start_rollout(RolloutSpec(input={"task": 1}), "w")
    assert rollout.latest_attempt is not None
    rid, aid = rollout.rollout_id, rollout.latest_attempt.attempt_id
    spans = make_spans(10)
    first = store.submit_spans(records(spans), rid, aid)
    assert first.durable is not None  # SQLite: handed to the writer, not committed yet
    again = store.submit_spans(records(spans), rid, aid)  # the same span ids, resent
    assert again.result.duplicate_count == 10 and again.result.stored_count == 0
    assert again.result.sequence_ids == first.result.sequence_ids == list(range(1, 11))
    more = store.submit_spans(records(make_spans(5)), rid, aid)
    assert more.result.sequence_ids == list(range(11, 16))
    for submitted in (first, again, more):
        if submitted.durable is not None:
            await submitted.durable
    await store.close()

    reopened = await open_store(tmp_path / "s.db")
    try:
        stats = await reopened.statistics()
        assert stats.total_spans == 15
    finally:
        await reopened.close()


async def test_a_memory_store_has_nothing_to_wait_for() -> None:
    store = await open_store()
    rollout = await store.start_rollout(RolloutSpec(input={"task": 1}), "w")
    assert rollout.latest_attempt is not None
    submitted = store.submit_spans(
        records(make_spans(3)), rollout.rollout_id, rollout.latest_attempt.attempt_id
    )
    assert submitted.durable is None and submitted.result.stored_count == 3
    await store.close()


async def test_a_span_stream_read_ahead_is_answered_in_order_and_stored_once(
    server_config: ServerConfig,
) -> None:
    """Batches sent without waiting for their answers (a runner's stream keeps many in flight): each is
    answered in order, with its own counts, a refused one in its place, a resent one as duplicates, and
    everything answered is on disk for a new server on the same file."""
    running = await start_server(server_config)
    try:
        async with StoreClient(running.address, retry=None) as client:
            rollout = await client.start_rollout({"task": 1})
            assert rollout.latest_attempt is not None
            rid, aid = rollout.rollout_id, rollout.latest_attempt.attempt_id
            batches = []
            for i in range(40):
                req = pb.AddSpansStreamRequest(batch_id=i + 1, rollout_id=rid, attempt_id=aid)
                for span in make_spans(8):
                    convert.span_to_pb(span, req.spans.add())
                batches.append(req)
            refused = pb.AddSpansStreamRequest(batch_id=100, rollout_id=rid, attempt_id="at-unknown")
            refused.spans.append(convert.span_to_pb(make_spans(1)[0]))
            resent = pb.AddSpansStreamRequest(batch_id=101, rollout_id=rid, attempt_id=aid)
            resent.spans.extend(batches[0].spans)
            sent = [*batches[:20], refused, *batches[20:], resent]
            call = client.stub.AddSpansStream()
            for req in sent:
                await call.write(req)  # all of them before reading any answer
            await call.done_writing()
            acks = [ack async for ack in call]
            assert await call.code() == grpc.StatusCode.OK
        assert [a.batch_id for a in acks] == [r.batch_id for r in sent]
        assert [a.stored_count for a in acks] == [8] * 20 + [0] + [8] * 20 + [0]
        assert acks[20].error.reason == "ATTEMPT_NOT_FOUND" and acks[-1].duplicate_count == 8
    finally:
        await running.stop()

    again = await start_server(server_config)
    try:
        async with StoreClient(again.address, retry=None) as client:
            spans = await client.query_spans(rid)
            assert [s.sequence_id for s in spans] == list(range(1, 321))
    finally:
        await again.stop()


async def test_a_burst_of_every_kind_of_write_reloads_as_it_was(server_config: ServerConfig) -> None:
    """Many submissions reach the writer together (rows replacing rows, spans, changes, a delete between
    them) and are committed together: a new store on the file finds exactly what the live one held,
    whatever order the burst's calls were taken in."""
    running = await start_server(server_config)
    try:
        async with StoreClient(running.address, retry=None) as client:
            await client.enqueue_rollouts([{"input": {"task": i}} for i in range(12)])
            claimed = await client.dequeue_rollouts(12, worker_id="w")
            ids = [(r.rollout_id, r.latest_attempt.attempt_id) for r in claimed if r.latest_attempt]
            assert len(ids) == 12
            await asyncio.gather(
                *(client.add_spans(make_spans(3), rollout_id=rid, attempt_id=aid) for rid, aid in ids)
            )
            await asyncio.gather(
                *(
                    client.complete_attempt(rid, aid, "succeeded" if i % 3 else "failed")
                    for i, (rid, aid) in enumerate(ids)
                )
            )
            doomed = [rid for rid, _ in ids[:4]]
            burst = [client.update_rollout(rid, metadata={"round": n}) for n in (1, 2, 3) for rid, _ in ids]
            burst.insert(len(burst) // 2, client.delete_rollouts(doomed))
            burst.append(client.enqueue_rollouts([{"input": {"task": "late"}}]))
            outcomes = await asyncio.gather(*burst, return_exceptions=True)
            assert not any(
                isinstance(o, BaseException) and not isinstance(o, NotFoundError) for o in outcomes
            )
            live = await snapshot(client)
    finally:
        await running.stop()

    again = await start_server(server_config)
    try:
        async with StoreClient(again.address, retry=None) as client:
            assert await snapshot(client) == live
        assert len(live["rollouts"]) == 9 and live["spans"] == 8 * 3
    finally:
        await again.stop()


async def snapshot(client: StoreClient) -> dict[str, object]:
    rollouts = await client.query_rollouts()
    spans = 0
    rows = []
    for r in sorted(rollouts, key=lambda r: r.rollout_id):
        found = await client.query_spans(r.rollout_id)
        spans += len(found)
        attempt = r.latest_attempt
        rows.append(
            (
                r.rollout_id,
                r.status,
                dict(r.metadata),
                attempt and (attempt.attempt_id, attempt.status),
                [(s.sequence_id, s.span_id) for s in found],
            )
        )
    return {"rollouts": rows, "spans": spans}


def test_merged_ops_keep_the_last_row_of_each_key_and_nothing_crosses_a_delete() -> None:
    def attempt(count: int) -> dict[str, object]:
        return {"attempt_id": "at-1", "rollout_id": "ro-1", "span_count": count}

    def span(rollout: str, n: int) -> tuple[object, ...]:
        return (rollout, "at-1", 1, n, f"{n:016x}", "0" * 32, "", "step", n, n, b"")

    submissions = [
        [("attempts", [attempt(1)]), ("spans", [span("ro-1", 1)]), ("meta", [("revision", "1")])],
        [("attempts", [attempt(2)]), ("spans", [span("ro-1", 2)]), ("meta", [("revision", "2")])],
        [("delete", ["ro-1"])],
        [("rollouts", [{"rollout_id": "ro-2", "status": 1}]), ("changes", [(3, "ro-2", "{}")])],
        [("rollouts", [{"rollout_id": "ro-2", "status": 2}]), ("changes", [(4, "ro-2", "{}")])],
        [("spans", [span("ro-2", 1)]), ("meta", [("revision", "3")]), ("meta", [("revision", "4")])],
    ]
    assert rows.merged_ops(submissions) == [
        ("attempts", [attempt(2)]),
        ("spans", [span("ro-1", 1), span("ro-1", 2)]),
        ("meta", [("revision", "2")]),
        ("delete", ["ro-1"]),
        ("rollouts", [{"rollout_id": "ro-2", "status": 2}]),
        ("spans", [span("ro-2", 1)]),
        ("changes", [(3, "ro-2", "{}"), (4, "ro-2", "{}")]),
        ("meta", [("revision", "4")]),
    ]


async def test_one_hand_over_answers_every_submitter_of_a_commit_and_leaves_the_cancelled_alone() -> None:
    loop = asyncio.get_running_loop()
    stored: list[rows.Submission] = [([], loop.create_future()) for _ in range(3)]
    gone: asyncio.Future[None] = loop.create_future()
    gone.cancel()
    loop.call_soon_threadsafe(rows.resolve_all, [*stored, ([], gone)], None)
    await asyncio.wait_for(asyncio.gather(*(fut for _, fut in stored)), 5)
    assert gone.cancelled()
    failed: list[rows.Submission] = [([], loop.create_future()) for _ in range(2)]
    error = OSError("disk I/O error")
    loop.call_soon_threadsafe(rows.resolve_all, failed, error)
    for _, fut in failed:
        with pytest.raises(OSError, match="disk I/O error"):
            await asyncio.wait_for(fut, 5)


async def test_a_changed_rollout_and_attempt_are_rewritten_where_they_lie(tmp_path: Path) -> None:
    """A row that changes keeps its place in its table (SQLite's rowid) and its index entries, so a commit of
    one changed attempt writes the pages that hold it, not a moved copy and every index anew."""
    store = await open_store(tmp_path / "s.db")
    try:
        enqueued = await store.enqueue_rollouts([RolloutSpec(input={"task": i}) for i in range(3)])
        [started] = await store.dequeue_rollouts("w", max_rollouts=1)
        assert started.latest_attempt is not None
        rid, aid = started.rollout_id, started.latest_attempt.attempt_id
        for _ in range(3):
            await store.heartbeat_attempt(rid, aid)
        await store.complete_attempt(rid, aid, int(AttemptStatus.SUCCEEDED))
        assert (await store.get_rollout(rid)).status == RolloutStatus.SUCCEEDED
    finally:
        await store.close()
    db = sqlite3.connect(tmp_path / "s.db")
    try:
        in_place = db.execute("SELECT rowid, rollout_id FROM rollouts ORDER BY rowid").fetchall()
        assert in_place == [(n + 1, r.rollout_id) for n, r in enumerate(enqueued)]
        assert db.execute("SELECT rowid, attempt_id, status FROM attempts").fetchall() == [
            (1, aid, int(AttemptStatus.SUCCEEDED))
        ]
        # the revision is written at each commit, in the row it was first written to
        top, count = db.execute("SELECT max(rowid), count(*) FROM meta").fetchone()
        assert count >= 2 and top == count, "a meta row was moved when it was written again"
    finally:
        db.close()


async def test_writes_whose_callers_gave_up_waiting_are_still_committed_with_the_others(
    tmp_path: Path,
) -> None:
    """A caller cancelled while its write waits for the commit it shares with others cancels neither that
    commit nor the others' waits: every write handed to the writer is stored."""
    store = await open_store(tmp_path / "s.db")
    try:
        tasks = [
            asyncio.create_task(store.enqueue_rollouts([RolloutSpec(input={"task": i})])) for i in range(40)
        ]
        await asyncio.sleep(0)  # each has handed its write over and waits for the commit
        for task in tasks[::2]:
            task.cancel()
        kept = await asyncio.gather(*tasks[1::2])
        assert len(kept) == 20 and all(len(r) == 1 for r in kept)
        assert all(t.cancelled() for t in tasks[::2])
    finally:
        await store.close()
    reopened = await open_store(tmp_path / "s.db")
    try:
        assert len(await reopened.list_rollouts()) == 40
    finally:
        await reopened.close()


async def test_a_calls_heartbeat_that_moves_only_its_time_is_written_with_the_attempts_next_write(
    tmp_path: Path,
) -> None:
    """The proxy's heartbeat for a call (``for_call``) commits what moves the attempt's status before it
    answers; one that moves only the heartbeat time is kept in memory and written with the attempt's next
    write (the call's span), while a runner's heartbeat is committed at once."""
    now = [1000.0]
    store = await open_store(tmp_path / "s.db", clock=lambda: now[0])

    def on_disk() -> tuple[int, float]:
        with sqlite3.connect(tmp_path / "s.db") as db:
            status, beat = db.execute("SELECT status, last_heartbeat_time FROM attempts").fetchone()
        return int(status), float(beat)

    try:
        rollout = await store.start_rollout(RolloutSpec(input={"task": 1}), "w")
        assert rollout.latest_attempt is not None
        rid, aid = rollout.rollout_id, rollout.latest_attempt.attempt_id
        now[0] = 1001.0
        first = await store.heartbeat_attempt(rid, aid, for_call=True)  # PREPARING -> RUNNING
        assert first.attempt.status == AttemptStatus.RUNNING
        assert on_disk() == (int(AttemptStatus.RUNNING), 1001.0)
        now[0] = 1002.0
        second = await store.heartbeat_attempt(rid, aid, for_call=True)
        assert second.attempt.last_heartbeat_time == 1002.0 and not second.should_stop
        assert on_disk() == (int(AttemptStatus.RUNNING), 1001.0)  # not committed on its own
        now[0] = 1003.0
        stored = store.submit_spans(records(make_spans(1)), rid, aid)  # the call's span
        if stored.durable is not None:
            await stored.durable
        assert on_disk() == (int(AttemptStatus.RUNNING), 1003.0)
        now[0] = 1004.0
        await store.heartbeat_attempt(rid, aid)  # a runner's heartbeat: committed before it answers
        assert on_disk() == (int(AttemptStatus.RUNNING), 1004.0)
    finally:
        await store.close()


@pytest.mark.parametrize(
    "value",
    [{}, {"k": {}}, {"é": [1.5, None, True, "line\u2028break", -0.0]}, [], None, 0, "", {"n": float("inf")}],
)
def test_rows_keep_the_compact_json_of_their_values(value: object) -> None:
    import json

    assert rows.dumps(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert json.loads(rows.dumps(value)) == value
