"""Store semantics (DESIGN section 3) over real gRPC, on every backend (memory, SQLite, PostgreSQL).

Each test of a known weakness of the reference store says which one it shows fixed.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from lightning_grpc.client import StoreClient
from lightning_grpc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from lightning_grpc.types import AttemptStatus, PromptTemplate, RolloutConfig, RolloutStatus, WorkerStatus
from tests.conftest import STORE_BACKENDS
from tests.helpers import make_span, make_spans

RETRY_ALL = (AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE)


async def claim(client: StoreClient, worker: str = "w1", **spec: object) -> tuple[str, str]:
    r = await client.enqueue_rollout({"task": 1}, **spec)
    d = await client.dequeue_rollout(worker_id=worker)
    assert d is not None and d.rollout_id == r.rollout_id and d.latest_attempt is not None
    return d.rollout_id, d.latest_attempt.attempt_id


@pytest.fixture(params=STORE_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """This file runs on PostgreSQL too (the conftest's ``backend`` covers memory and SQLite)."""
    return str(request.param)


# ------------------------------------------------------------------ terminal is final, fencing


async def test_cancel_is_sticky_a_stale_success_report_is_refused(client: StoreClient) -> None:
    # Reference 3.5: cancel, then the runner reports success -> the rollout became SUCCEEDED.
    rid, aid = await claim(client)
    await client.cancel_rollout(rid, "operator stop")
    with pytest.raises(FailedPreconditionError) as err:
        await client.complete_attempt(rid, aid, "succeeded")
    assert err.value.reason == "ATTEMPT_ALREADY_ENDED"
    r = await client.get_rollout(rid)
    assert r.status == RolloutStatus.CANCELLED
    assert r.latest_attempt is not None and r.latest_attempt.status == AttemptStatus.CANCELLED
    assert r.end_time is not None and r.latest_attempt.end_time is not None
    assert r.status_message == "operator stop"


async def test_a_timed_out_rollout_stays_failed_when_the_stale_runner_reports(client: StoreClient) -> None:
    # Reference 3.5: a rollout failed by timeout flipped to SUCCEEDED on a late report.
    rid, aid = await claim(client, config=RolloutConfig(timeout=0.2))
    done = await client.wait_for_rollouts([rid], timeout=3)
    assert [r.status for r in done] == [RolloutStatus.FAILED]
    with pytest.raises(FailedPreconditionError):
        await client.complete_attempt(rid, aid, "succeeded")
    r = await client.get_rollout(rid)
    assert r.status == RolloutStatus.FAILED
    assert r.latest_attempt is not None and r.latest_attempt.status == AttemptStatus.TIMEOUT


async def test_start_attempt_cannot_revive_a_finished_rollout(client: StoreClient) -> None:
    # Reference 12.1: start_attempt forced a SUCCEEDED rollout back to PREPARING.
    rid, aid = await claim(client)
    await client.complete_attempt(rid, aid, "succeeded")
    with pytest.raises(FailedPreconditionError) as err:
        await client.start_attempt(rid)
    assert err.value.reason == "ROLLOUT_FINISHED"
    assert (await client.get_rollout(rid)).status == RolloutStatus.SUCCEEDED


async def test_start_attempt_refuses_while_an_attempt_is_active_and_claims_a_queued_rollout(
    client: StoreClient,
) -> None:
    rid, _ = await claim(client)
    with pytest.raises(FailedPreconditionError) as err:
        await client.start_attempt(rid)
    assert err.value.reason == "ATTEMPT_STILL_ACTIVE"
    queued = await client.enqueue_rollout({"x": 2}, config=RolloutConfig(max_attempts=1))
    started = await client.start_attempt(queued.rollout_id, worker_id="w9")
    assert started.status == RolloutStatus.PREPARING and started.attempt_count == 1
    # it left the queue: nobody else can dequeue it (the reference left a dead queue entry)
    assert await client.dequeue_rollout() is None


async def test_a_superseded_attempt_cannot_move_the_rollout_but_its_spans_are_kept(
    client: StoreClient,
) -> None:
    # Reference 3.4/3.5: spans revived an old attempt; an old attempt's report was silently lost.
    cfg = RolloutConfig(unresponsive_timeout=0.3, max_attempts=2, retry_on=RETRY_ALL)
    rid, first = await claim(client, config=cfg)
    await asyncio.sleep(1.0)
    retry = await client.dequeue_rollout(worker_id="w2")
    assert retry is not None and retry.rollout_id == rid and retry.latest_attempt is not None
    second = retry.latest_attempt.attempt_id
    assert second != first
    late = await client.add_spans(make_spans(2, "late"), rollout_id=rid, attempt_id=first)
    assert late.stored_count == 2
    with pytest.raises(FailedPreconditionError):
        await client.complete_attempt(rid, first, "succeeded")
    attempts = await client.query_attempts(rid)
    assert [a.status for a in attempts] == [AttemptStatus.UNRESPONSIVE, AttemptStatus.PREPARING]
    r = await client.get_rollout(rid)
    assert r.status == RolloutStatus.PREPARING and r.latest_attempt and r.latest_attempt.attempt_id == second
    assert len(await client.query_spans(rid, first)) == 2
    await client.complete_attempt(rid, second, "succeeded")
    assert (await client.get_rollout(rid)).status == RolloutStatus.SUCCEEDED


async def test_completing_twice_with_the_same_outcome_is_idempotent(client: StoreClient) -> None:
    rid, aid = await claim(client)
    a1, r1 = await client.complete_attempt(rid, aid, "failed", "boom")
    a2, r2 = await client.complete_attempt(rid, aid, "failed", "boom")
    assert a1.end_time == a2.end_time and r1.status == r2.status == RolloutStatus.FAILED
    assert r1.status_message == "boom"
    with pytest.raises(FailedPreconditionError):
        await client.complete_attempt(rid, aid, "succeeded")


async def test_only_succeeded_or_failed_can_be_reported(client: StoreClient) -> None:
    rid, aid = await claim(client)
    for bad in ("running", "timeout", "cancelled", 0, 99):
        with pytest.raises(InvalidArgumentError) as err:
            await client.complete_attempt(rid, aid, bad)
        assert err.value.field in ("status", "AttemptStatus")


async def test_status_is_not_writable_through_update_so_no_orphans(client: StoreClient) -> None:
    # Reference 3.5: update_rollout(status="running") on a queued rollout made an orphan.
    from lightning_grpc.v1 import store_service_pb2 as pb

    r = await client.enqueue_rollout({"x": 1})
    request = pb.UpdateRolloutRequest(rollout_id=r.rollout_id)
    request.update_mask.paths.append("status")
    with pytest.raises(InvalidArgumentError) as err:
        await client._call("UpdateRollout", request)
    assert err.value.field == "update_mask"
    assert (await client.get_rollout(r.rollout_id)).status == RolloutStatus.QUEUING
    assert (await client.dequeue_rollout()) is not None


# ------------------------------------------------------------------ every ended attempt has an end time


async def test_every_ended_attempt_has_an_end_time(client: StoreClient) -> None:
    ended = []
    rid, aid = await claim(client)
    ended.append((await client.complete_attempt(rid, aid, "succeeded"))[0])
    rid, aid = await claim(client)
    ended.append((await client.complete_attempt(rid, aid, "failed", "x"))[0])
    rid, aid = await claim(client)
    await client.cancel_rollout(rid)
    ended += await client.query_attempts(rid)
    rid, _ = await claim(client, config=RolloutConfig(timeout=0.2))
    rid2, _ = await claim(client, config=RolloutConfig(unresponsive_timeout=0.2))
    await client.wait_for_rollouts([rid, rid2], timeout=3)
    ended += await client.query_attempts(rid) + await client.query_attempts(rid2)
    assert {a.status for a in ended} == {
        AttemptStatus.SUCCEEDED,
        AttemptStatus.FAILED,
        AttemptStatus.CANCELLED,
        AttemptStatus.TIMEOUT,
        AttemptStatus.UNRESPONSIVE,
    }
    assert all(a.end_time is not None and a.end_time >= a.start_time for a in ended)


# ------------------------------------------------------------------ retries


async def test_failed_attempts_are_retried_up_to_max_attempts(client: StoreClient) -> None:
    cfg = RolloutConfig(max_attempts=3, retry_on=(AttemptStatus.FAILED,))
    r = await client.enqueue_rollout({"x": 1}, config=cfg)
    for n in (1, 2, 3):
        d = await client.dequeue_rollout(worker_id="w")
        assert d is not None and d.rollout_id == r.rollout_id and d.latest_attempt is not None
        assert d.latest_attempt.sequence_number == n
        _, after = await client.complete_attempt(
            d.rollout_id, d.latest_attempt.attempt_id, "failed", f"try {n}"
        )
        assert after.status == (RolloutStatus.REQUEUING if n < 3 else RolloutStatus.FAILED)
    final = await client.get_rollout(r.rollout_id)
    assert final.status_message == "try 3" and final.end_time is not None
    assert await client.dequeue_rollout() is None


async def test_a_status_not_in_retry_on_fails_the_rollout_at_once(client: StoreClient) -> None:
    cfg = RolloutConfig(max_attempts=5, retry_on=(AttemptStatus.TIMEOUT,))
    rid, aid = await claim(client, config=cfg)
    _, r = await client.complete_attempt(rid, aid, "failed", "bad input")
    assert r.status == RolloutStatus.FAILED


# ------------------------------------------------------------------ the watchdog runs on timers


async def test_timeout_fires_within_a_second_with_no_client_calls(client: StoreClient) -> None:
    cfg = RolloutConfig(timeout=0.4, max_attempts=2, retry_on=(AttemptStatus.TIMEOUT,))
    rid, _ = await claim(client, config=cfg)
    await asyncio.sleep(1.6)  # nobody calls the store meanwhile
    attempts = await client.query_attempts(rid)
    first = attempts[0]
    assert first.status == AttemptStatus.TIMEOUT and first.end_time is not None
    assert 0 <= first.end_time - (first.start_time + 0.4) < 1.0
    assert (await client.get_rollout(rid)).status == RolloutStatus.REQUEUING


async def test_heartbeats_and_spans_both_keep_an_attempt_alive(client: StoreClient) -> None:
    cfg = RolloutConfig(unresponsive_timeout=0.5)
    rid_hb, aid_hb = await claim(client, config=cfg)
    rid_sp, aid_sp = await claim(client, worker="w2", config=cfg)
    for _ in range(8):  # 1.6 s, three times the silence limit
        await asyncio.sleep(0.2)
        hb = await client.heartbeat_attempt(rid_hb, aid_hb)
        assert not hb.should_stop
        await client.add_spans([make_span()], rollout_id=rid_sp, attempt_id=aid_sp)
    assert (await client.get_rollout(rid_hb)).status == RolloutStatus.RUNNING
    assert (await client.get_rollout(rid_sp)).status == RolloutStatus.RUNNING
    await asyncio.sleep(1.3)
    for rid in (rid_hb, rid_sp):
        r = await client.get_rollout(rid)
        assert r.status == RolloutStatus.FAILED
        assert r.latest_attempt is not None and r.latest_attempt.status == AttemptStatus.UNRESPONSIVE
        silence = r.latest_attempt.end_time - r.latest_attempt.last_heartbeat_time  # type: ignore[operator]
        assert 0.5 <= silence < 1.5


async def test_worker_heartbeats_do_not_keep_an_attempt_alive(client: StoreClient) -> None:
    rid, _ = await claim(client, config=RolloutConfig(unresponsive_timeout=0.3))
    for _ in range(5):
        await client.update_worker("w1", {"cpu": 1})
        await asyncio.sleep(0.15)
    await asyncio.sleep(0.5)
    assert (await client.get_rollout(rid)).status == RolloutStatus.FAILED


# ------------------------------------------------------------------ cancellation reaches the runner


async def test_cancellation_reaches_the_runner_through_its_heartbeat(client: StoreClient) -> None:
    rid, aid = await claim(client)
    assert not (await client.heartbeat_attempt(rid, aid)).should_stop
    await client.cancel_rollout(rid, "stop")
    hb = await client.heartbeat_attempt(rid, aid)
    assert hb.cancelled and hb.should_stop
    assert hb.attempt.status == AttemptStatus.CANCELLED and hb.rollout_status == RolloutStatus.CANCELLED
    again = await client.cancel_rollout(rid)  # idempotent
    assert again.status == RolloutStatus.CANCELLED


async def test_cancelling_a_queued_rollout_takes_it_off_the_queue(client: StoreClient) -> None:
    a = await client.enqueue_rollout({"n": 1})
    b = await client.enqueue_rollout({"n": 2})
    await client.cancel_rollout(a.rollout_id)
    d = await client.dequeue_rollout()
    assert d is not None and d.rollout_id == b.rollout_id
    assert await client.dequeue_rollout() is None


async def test_a_finished_rollout_cannot_be_cancelled(client: StoreClient) -> None:
    rid, aid = await claim(client)
    await client.complete_attempt(rid, aid, "succeeded")
    with pytest.raises(FailedPreconditionError) as err:
        await client.cancel_rollout(rid)
    assert err.value.reason == "ROLLOUT_FINISHED"


async def test_heartbeat_of_a_timed_out_attempt_tells_the_runner_to_stop(client: StoreClient) -> None:
    rid, aid = await claim(client, config=RolloutConfig(timeout=0.2))
    await asyncio.sleep(0.8)
    hb = await client.heartbeat_attempt(rid, aid)
    assert hb.should_stop and not hb.cancelled and hb.attempt.status == AttemptStatus.TIMEOUT


# ------------------------------------------------------------------ dequeue


async def test_dequeue_is_fifo_and_claims_with_an_attempt_in_one_step(client: StoreClient) -> None:
    ids = [r.rollout_id for r in await client.enqueue_rollouts([{"input": i} for i in range(5)])]
    got = await client.dequeue_rollouts(3, worker_id="w")
    assert [r.rollout_id for r in got] == ids[:3]
    for r in got:
        assert r.status == RolloutStatus.PREPARING and r.latest_attempt is not None
        assert r.latest_attempt.status == AttemptStatus.PREPARING and r.latest_attempt.worker_id == "w"
    rest = await client.dequeue_rollouts(10)
    assert [r.rollout_id for r in rest] == ids[3:]


async def test_dequeue_long_polls_until_a_rollout_arrives(client: StoreClient) -> None:
    async def enqueue_later() -> str:
        await asyncio.sleep(0.3)
        return (await client.enqueue_rollout({"late": True})).rollout_id

    t0 = time.monotonic()
    task = asyncio.create_task(enqueue_later())
    got = await client.dequeue_rollout(worker_id="w", wait=5)
    waited = time.monotonic() - t0
    assert got is not None and got.rollout_id == await task
    assert 0.25 <= waited < 2.0
    t0 = time.monotonic()
    assert await client.dequeue_rollout(wait=0.4) is None
    assert 0.35 <= time.monotonic() - t0 < 2.0


async def test_concurrent_dequeues_never_claim_a_rollout_twice(client: StoreClient) -> None:
    enqueued = await client.enqueue_rollouts([{"input": i} for i in range(20)])
    results = await asyncio.gather(*(client.dequeue_rollout(worker_id=f"w{i}") for i in range(30)))
    claimed = [r.rollout_id for r in results if r is not None]
    assert sorted(claimed) == sorted(r.rollout_id for r in enqueued)
    assert results.count(None) == 10


async def test_a_retried_dequeue_request_returns_what_the_first_call_claimed(client: StoreClient) -> None:
    from lightning_grpc.v1 import store_service_pb2 as pb

    await client.enqueue_rollouts([{"input": i} for i in range(3)])
    request = pb.DequeueRolloutsRequest(worker_id="w", max_rollouts=2, request_id="req-1")
    first = await client._call("DequeueRollouts", request)
    retry = await client._call("DequeueRollouts", request)
    assert [r.rollout_id for r in retry.rollouts] == [r.rollout_id for r in first.rollouts]
    assert [r.latest_attempt.attempt_id for r in retry.rollouts] == [
        r.latest_attempt.attempt_id for r in first.rollouts
    ]
    assert len(await client.dequeue_rollouts(10)) == 1


# ------------------------------------------------------------------ spans


async def test_sequence_ids_are_assigned_increasing_and_unique_per_attempt(client: StoreClient) -> None:
    rid, aid = await claim(client, config=RolloutConfig(max_attempts=2, retry_on=RETRY_ALL))
    first = await client.add_spans(make_spans(5), rollout_id=rid, attempt_id=aid)
    second = await client.add_spans(make_spans(3), rollout_id=rid, attempt_id=aid)
    assert first.sequence_ids + second.sequence_ids == list(range(1, 9))
    await client.complete_attempt(rid, aid, "failed", "retry me")
    retry = await client.dequeue_rollout()
    assert retry is not None and retry.latest_attempt is not None
    other = await client.add_spans(make_spans(2), rollout_id=rid, attempt_id=retry.latest_attempt.attempt_id)
    assert other.sequence_ids == [1, 2]


async def test_resending_a_batch_stores_nothing_twice(client: StoreClient) -> None:
    rid, aid = await claim(client)
    batch = make_spans(10)
    a = await client.add_spans(batch, rollout_id=rid, attempt_id=aid)
    b = await client.add_spans(batch + make_spans(2), rollout_id=rid, attempt_id=aid)
    assert (a.stored_count, a.duplicate_count) == (10, 0)
    assert (b.stored_count, b.duplicate_count) == (2, 10)
    assert b.sequence_ids[:10] == a.sequence_ids
    assert len(await client.query_spans(rid)) == 12
    assert (await client.statistics()).total_spans == 12


async def test_client_numbered_spans_must_not_reuse_a_sequence_id(client: StoreClient) -> None:
    rid, aid = await claim(client)
    first = await client.get_next_span_sequence_id(rid, aid, count=10)
    assert first == 1
    span = make_span()
    span.sequence_id = 7
    assert (await client.add_spans([span], rollout_id=rid, attempt_id=aid)).sequence_ids == [7]
    clash = make_span()
    clash.sequence_id = 7
    with pytest.raises(InvalidArgumentError) as err:
        await client.add_spans([clash], rollout_id=rid, attempt_id=aid)
    assert err.value.field == "spans[0].sequence_id"
    assert (await client.add_spans([make_span()], rollout_id=rid, attempt_id=aid)).sequence_ids == [11]


async def test_the_first_span_moves_attempt_and_rollout_to_running(client: StoreClient) -> None:
    rid, aid = await claim(client)
    await client.add_spans([make_span()], rollout_id=rid, attempt_id=aid)
    r = await client.get_rollout(rid)
    assert r.status == RolloutStatus.RUNNING
    assert r.latest_attempt is not None and r.latest_attempt.status == AttemptStatus.RUNNING
    assert r.latest_attempt.last_heartbeat_time is not None


async def test_spans_to_unknown_ids_and_malformed_spans_are_refused_with_the_field_named(
    client: StoreClient,
) -> None:
    rid, aid = await claim(client)
    with pytest.raises(NotFoundError) as nf:
        await client.add_spans([make_span()], rollout_id=rid, attempt_id="at-nope")
    assert nf.value.reason == "ATTEMPT_NOT_FOUND"
    other, _ = await claim(client, worker="w2")
    with pytest.raises(NotFoundError):
        await client.add_spans([make_span()], rollout_id=other, attempt_id=aid)
    bad = make_span(span_id="XYZ")
    with pytest.raises(InvalidArgumentError) as err:
        await client.add_spans([make_span(), bad], rollout_id=rid, attempt_id=aid)
    assert err.value.field == "spans[1].span_id"
    assert await client.query_spans(rid) == []  # nothing of a refused batch was stored


async def test_span_attributes_round_trip_with_their_types(client: StoreClient) -> None:
    rid, aid = await claim(client)
    attrs = {
        "reward": 0.1 + 0.2,  # float64 exactly
        "tokens": [151644, 872, 198],
        "logprobs": [-0.25, -1.5],
        "text": "héllo",
        "ok": True,
        "n": 2**62,
        "nested": {"a": [1, "x"], "b": None},
        "raw": b"\x00\x01",
    }
    await client.add_spans([make_span("llm", **attrs)], rollout_id=rid, attempt_id=aid)
    (span,) = await client.query_spans(rid)
    got = span.attributes
    assert (
        got["reward"] == 0.1 + 0.2
        and got["tokens"] == [151644, 872, 198]
        and got["logprobs"] == [-0.25, -1.5]
    )
    assert got["text"] == "héllo" and got["ok"] is True and got["n"] == 2**62 and got["raw"] == b"\x00\x01"
    assert got["nested"] == {"a": [1, "x"], "b": None}
    assert span.rollout_id == rid and span.attempt_id == aid and span.sequence_id == 1


async def test_span_queries_select_attempts_filter_and_page(client: StoreClient) -> None:
    rid, aid = await claim(client, config=RolloutConfig(max_attempts=2, retry_on=RETRY_ALL))
    trace = "ab" * 16
    root = make_span("agent", trace_id=trace)
    child = make_span("openai.chat.completion", trace_id=trace)
    child.parent_span_id = root.span_id
    await client.add_spans([root, child, *make_spans(3, "tool")], rollout_id=rid, attempt_id=aid)
    await client.complete_attempt(rid, aid, "failed", "again")
    d = await client.dequeue_rollout()
    assert d is not None and d.latest_attempt is not None
    aid2 = d.latest_attempt.attempt_id
    await client.add_spans(make_spans(2, "tool"), rollout_id=rid, attempt_id=aid2)
    assert len(await client.query_spans(rid)) == 7
    assert len(await client.query_spans(rid, "latest")) == 2
    assert len(await client.query_spans(rid, aid)) == 5
    assert [s.name for s in await client.query_spans(rid, name_contains="chat")] == ["openai.chat.completion"]
    assert [s.span_id for s in await client.query_spans(rid, parent_span_id=root.span_id)] == [child.span_id]
    assert len(await client.query_spans(rid, trace_id=trace)) == 2
    assert len(await client.query_spans(rid, name="tool")) == 5
    all_spans = await client.query_spans(rid)
    assert [(s.attempt_id, s.sequence_id) for s in all_spans] == [(aid, i) for i in range(1, 6)] + [
        (aid2, 1),
        (aid2, 2),
    ]
    from lightning_grpc.v1 import store_service_pb2 as pb

    seen, token = [], ""
    while True:
        page = await client._call(
            "ListSpans",
            pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id=rid), page_size=3, page_token=token),
        )
        seen += [s.span_id for s in page.spans]
        token = page.next_page_token
        if not token:
            break
    assert seen == [s.span_id for s in all_spans]
    with pytest.raises(NotFoundError):
        await client.query_spans("ro-unknown")


async def test_tail_spans_follows_new_spans(client: StoreClient) -> None:
    rid, aid = await claim(client)
    await client.add_spans(make_spans(2), rollout_id=rid, attempt_id=aid)
    got: list[str] = []

    async def follow() -> None:
        async for batch in client.tail_spans(rid, follow=True):
            got.extend(s.span_id for s in batch)
            if len(got) >= 5:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    late = make_spans(3)
    await client.add_spans(late, rollout_id=rid, attempt_id=aid)
    await asyncio.wait_for(task, 5)
    assert got[2:] == [s.span_id for s in late]


async def test_tail_spans_follow_ends_when_the_rollout_has_ended(client: StoreClient) -> None:
    rid, aid = await claim(client)
    early = make_spans(2)
    await client.add_spans(early, rollout_id=rid, attempt_id=aid)
    got: list[str] = []

    async def follow() -> None:
        async for batch in client.tail_spans(rid, follow=True):
            got.extend(s.span_id for s in batch)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    assert not task.done()  # running: the follow waits for more
    late = make_spans(1)
    await client.add_spans(late, rollout_id=rid, attempt_id=aid)
    await client.complete_attempt(rid, aid, "succeeded")
    await asyncio.wait_for(task, 5)  # ended with the rollout, every span sent
    assert got == [s.span_id for s in early + late]
    # a follow of a rollout that already ended sends its spans and ends at once
    again = [s.span_id async for batch in client.tail_spans(rid, follow=True) for s in batch]
    assert again == got


# ------------------------------------------------------------------ waiting and watching


async def test_wait_for_rollouts_returns_as_soon_as_they_finish(client: StoreClient) -> None:
    rid, aid = await claim(client)
    other = await client.enqueue_rollout({"never": "runs"})

    async def finish() -> float:
        await asyncio.sleep(0.3)
        await client.complete_attempt(rid, aid, "succeeded")
        return time.monotonic()

    task = asyncio.create_task(finish())
    done = await client.wait_for_rollouts([rid], timeout=10)
    finished_at = await task
    assert [r.rollout_id for r in done] == [rid]
    assert time.monotonic() - finished_at < 0.5
    t0 = time.monotonic()
    partial = await client.wait_for_rollouts([rid, other.rollout_id], timeout=0.3)
    assert [r.rollout_id for r in partial] == [rid] and time.monotonic() - t0 >= 0.25
    with pytest.raises(NotFoundError):
        await client.wait_for_rollouts(["ro-missing"], timeout=0.1)


async def test_watch_streams_changes_and_resumes_from_a_token(client: StoreClient) -> None:
    events: list[tuple[str, RolloutStatus]] = []
    tokens: list[str] = []
    first_token = asyncio.get_running_loop().create_future()

    async def watch() -> None:
        async for ev in client.watch_rollouts(include_progress=True, progress_interval=0.2):
            if not first_token.done():
                first_token.set_result(ev.resume_token)
            if ev.rollout is not None:
                events.append((ev.rollout.rollout_id, ev.rollout.status))
                tokens.append(ev.resume_token)
            if len(events) >= 3:
                return

    task = asyncio.create_task(watch())
    start_token = await asyncio.wait_for(first_token, 5)
    rid, aid = await claim(client)
    await client.complete_attempt(rid, aid, "succeeded")
    await asyncio.wait_for(task, 5)
    assert events == [
        (rid, RolloutStatus.QUEUING),
        (rid, RolloutStatus.PREPARING),
        (rid, RolloutStatus.SUCCEEDED),
    ]
    replay = []
    async for ev in client.watch_rollouts(start_token):
        assert ev.rollout is not None
        replay.append((ev.rollout.rollout_id, ev.rollout.status))
        if len(replay) == 3:
            break
    assert replay == events
    after = []
    async for ev in client.watch_rollouts(tokens[0], rollout_ids=[rid]):
        assert ev.rollout is not None
        after.append(ev.rollout.status)
        if len(after) == 2:
            break
    assert after == [RolloutStatus.PREPARING, RolloutStatus.SUCCEEDED]


async def test_watch_sends_progress_messages_and_refuses_bad_tokens(client: StoreClient) -> None:
    from lightning_grpc.errors import OutOfRangeError

    progress = 0
    async for ev in client.watch_rollouts(include_progress=True, progress_interval=0.1):
        assert ev.rollout is None and ev.resume_token
        progress += 1
        if progress == 3:
            break
    store_id = ev.resume_token.rsplit(".", 1)[0]
    with pytest.raises(OutOfRangeError) as err:
        async for _ in client.watch_rollouts(f"{store_id}.999999"):
            pass
    assert err.value.reason == "RESUME_TOKEN_EXPIRED"
    with pytest.raises(OutOfRangeError):
        async for _ in client.watch_rollouts("other-store.1"):
            pass
    with pytest.raises(InvalidArgumentError):
        async for _ in client.watch_rollouts("garbage"):
            pass


# ------------------------------------------------------------------ listing by status


async def test_a_status_filter_lists_exactly_the_rollouts_in_that_status_through_every_change(
    client: StoreClient,
) -> None:
    """ListRollouts by status walks the rollouts filed under each status: after enqueues, claims, runs,
    successes, failures with and without a retry, cancels and deletes, every status (and a pair of them) lists
    exactly what a listing of everything shows in it, in order, page by page, both ways."""
    ids = [r.rollout_id for r in await client.enqueue_rollouts([{"input": {"i": i}} for i in range(24)])]
    retrying = RolloutConfig(max_attempts=2, retry_on=list(RETRY_ALL))
    ids += [r.rollout_id for r in await client.enqueue_rollouts([{"input": {"i": 99}, "config": retrying}])]
    claimed = []
    for n in range(14):
        d = await client.dequeue_rollout(worker_id=f"w{n % 3}")
        assert d is not None and d.latest_attempt is not None
        claimed.append((d.rollout_id, d.latest_attempt.attempt_id))
    for rid, aid in claimed[:3]:
        await client.add_spans([make_span("step")], rollout_id=rid, attempt_id=aid)  # running
    for rid, aid in claimed[3:7]:
        await client.complete_attempt(rid, aid, "succeeded")
    for rid, aid in claimed[7:9]:
        await client.complete_attempt(rid, aid, "failed")
    await client.cancel_rollout(claimed[9][0], "stop")
    await client.cancel_rollout(ids[-2], "never started")
    await client.delete_rollouts(rollout_ids=[claimed[3][0], claimed[7][0]])

    everything = [r for r in await client.query_rollouts()]
    for statuses in [[s] for s in RolloutStatus] + [[RolloutStatus.QUEUING, RolloutStatus.SUCCEEDED]]:
        for descending in (False, True):
            expected = [r.rollout_id for r in everything if r.status in statuses]
            if descending:
                expected.reverse()
            listed, token = [], ""
            while True:
                page = await client.list_rollouts(
                    status_in=statuses, page_size=4, page_token=token, descending=descending
                )
                assert page.total_size == len(expected), (statuses, page.total_size, expected)
                listed += [r.rollout_id for r in page.items]
                token = page.next_page_token
                if not token:
                    break
            assert listed == expected, (statuses, descending)
    counts = {s: sum(r.status == s for r in everything) for s in RolloutStatus}
    assert counts[RolloutStatus.SUCCEEDED] == 3 and counts[RolloutStatus.CANCELLED] == 2
    assert counts[RolloutStatus.RUNNING] == 3 and counts[RolloutStatus.PREPARING] == 4


# ------------------------------------------------------------------ workers


async def test_worker_status_follows_its_attempts(client: StoreClient) -> None:
    w = await client.update_worker("w-stats", {"cpu_pct": 12.5, "gpus": [{"util": 3}]})
    assert w.status == WorkerStatus.UNKNOWN and w.heartbeat_stats["gpus"] == [{"util": 3}]
    rid, aid = await claim(client, worker="w-stats")
    busy = await client.get_worker_by_id("w-stats")
    assert busy is not None and busy.status == WorkerStatus.BUSY and busy.current_attempt_id == aid
    assert busy.heartbeat_stats["cpu_pct"] == 12.5
    await client.complete_attempt(rid, aid, "succeeded")
    idle = await client.get_worker_by_id("w-stats")
    assert idle is not None and idle.status == WorkerStatus.IDLE and idle.current_attempt_id == ""
    await claim(client, worker="w-stats", config=RolloutConfig(timeout=0.2))
    await asyncio.sleep(0.8)
    lost = await client.get_worker_by_id("w-stats")
    assert lost is not None and lost.status == WorkerStatus.UNKNOWN
    assert await client.get_worker_by_id("nobody") is None
    assert [w.worker_id for w in await client.query_workers(status_in=["unknown"])] == ["w-stats"]


async def test_latest_attempt_follows_retries(client: StoreClient) -> None:
    r = await client.enqueue_rollout({"x": 1}, config=RolloutConfig(max_attempts=2, retry_on=RETRY_ALL))
    assert await client.get_latest_attempt(r.rollout_id) is None
    d = await client.dequeue_rollout(worker_id="w")
    assert d is not None and d.latest_attempt is not None
    latest = await client.get_latest_attempt(r.rollout_id)
    assert latest == d.latest_attempt
    await client.complete_attempt(r.rollout_id, latest.attempt_id, "failed", "again")
    d2 = await client.dequeue_rollout(worker_id="w")
    assert d2 is not None and d2.latest_attempt is not None
    second = await client.get_latest_attempt(r.rollout_id)
    assert (
        second is not None
        and second.sequence_number == 2
        and second.attempt_id == d2.latest_attempt.attempt_id
    )
    assert [a.sequence_number for a in await client.query_attempts(r.rollout_id, descending=True)] == [2, 1]
    with pytest.raises(NotFoundError):
        await client.get_latest_attempt("ro-missing")


async def test_completion_can_store_the_last_spans_and_claim_the_next_rollout(client: StoreClient) -> None:
    first, second = await client.enqueue_rollouts([{"input": 1}, {"input": 2}])
    d = await client.dequeue_rollout(worker_id="w")
    assert d is not None and d.latest_attempt is not None and d.rollout_id == first.rollout_id
    attempt, rollout, nxt = await client.complete_and_dequeue(
        d.rollout_id, d.latest_attempt.attempt_id, "succeeded", spans=make_spans(5), worker_id="w"
    )
    assert attempt.status == AttemptStatus.SUCCEEDED and rollout.status == RolloutStatus.SUCCEEDED
    assert len(await client.query_spans(d.rollout_id)) == 5
    assert [r.rollout_id for r in nxt] == [second.rollout_id]
    assert nxt[0].latest_attempt is not None and nxt[0].latest_attempt.worker_id == "w"
    _, _, none_left = await client.complete_and_dequeue(
        second.rollout_id, nxt[0].latest_attempt.attempt_id, "failed", "no", worker_id="w", wait=0.2
    )
    assert none_left == []
    # a bad span refuses the whole completion: nothing stored, the attempt still active
    third = await client.start_rollout({"x": 3})
    assert third.latest_attempt is not None
    with pytest.raises(InvalidArgumentError):
        await client.complete_attempt(
            third.rollout_id, third.latest_attempt.attempt_id, "succeeded", spans=[make_span(span_id="bad")]
        )
    assert (await client.get_rollout(third.rollout_id)).status == RolloutStatus.PREPARING
    with pytest.raises(InvalidArgumentError):  # and a bad dequeue is refused before anything is stored
        from lightning_grpc.v1 import store_service_pb2 as pb

        req = pb.CompleteAttemptRequest(
            rollout_id=third.rollout_id, attempt_id=third.latest_attempt.attempt_id, status=3
        )
        req.dequeue_next.max_rollouts = -1
        await client._call("CompleteAttempt", req)
    assert (await client.get_rollout(third.rollout_id)).status == RolloutStatus.PREPARING


async def test_enqueueing_an_empty_list_is_a_no_op(client: StoreClient) -> None:
    assert await client.enqueue_rollouts([]) == []
    assert (await client.list_rollouts()).total_size == 0


async def test_rollout_filters_combine_with_or_when_asked(client: StoreClient) -> None:
    from lightning_grpc.v1 import rollout_pb2
    from lightning_grpc.v1 import store_service_pb2 as pb

    train_a = await client.enqueue_rollout({"i": 0}, mode="train", group_id="g1")
    val_b = await client.enqueue_rollout({"i": 1}, mode="val", group_id="g2")
    await client.enqueue_rollout({"i": 2}, mode="val", group_id="g1")
    filters = {"mode": rollout_pb2.ROLLOUT_MODE_TRAIN, "group_id": "g2", "order_by": "create_time"}
    both = await client.stub.ListRollouts(pb.ListRolloutsRequest(**filters, match=pb.FILTER_MATCH_ANY))
    assert [r.rollout_id for r in both.rollouts] == [train_a.rollout_id, val_b.rollout_id]
    assert both.total_size == 2
    neither = await client.stub.ListRollouts(pb.ListRolloutsRequest(**filters))  # ALL, the default
    assert neither.total_size == 0 and not neither.rollouts
    ids_or_mode = pb.ListRolloutsRequest(
        rollout_ids=[val_b.rollout_id], mode=rollout_pb2.ROLLOUT_MODE_TRAIN, match=2
    )
    assert (await client.stub.ListRollouts(ids_or_mode)).total_size == 2


async def test_workers_list_in_the_order_asked_and_page_in_it(client: StoreClient) -> None:
    from lightning_grpc.v1 import common_pb2
    from lightning_grpc.v1 import store_service_pb2 as pb

    for name in ("w-b", "w-a", "w-c"):  # heartbeats in this order: w-c is the latest
        await client.update_worker(name, {})
        await asyncio.sleep(0.01)
    by_id = await client.stub.ListWorkers(pb.ListWorkersRequest())
    assert [w.worker_id for w in by_id.workers] == ["w-a", "w-b", "w-c"]
    latest_first = pb.ListWorkersRequest(
        order_by="last_heartbeat_time", order=common_pb2.SORT_ORDER_DESCENDING, page_size=2
    )
    first = await client.stub.ListWorkers(latest_first)
    latest_first.page_token = first.next_page_token
    rest = await client.stub.ListWorkers(latest_first)
    assert [w.worker_id for w in [*first.workers, *rest.workers]] == ["w-c", "w-a", "w-b"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.stub.ListWorkers(pb.ListWorkersRequest(order_by="age"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "order_by" in (refused.value.details() or "")


async def test_retry_rollout_replaces_a_stuck_attempt_whatever_the_retry_config(client: StoreClient) -> None:
    rid, stuck = await claim(client, config=RolloutConfig(max_attempts=1))
    retried = await client.retry_rollout(rid, "worker hung")
    assert retried.status == RolloutStatus.REQUEUING
    (old,) = await client.query_attempts(rid)
    assert (
        old.attempt_id == stuck and old.status == AttemptStatus.FAILED and old.status_message == "worker hung"
    )
    assert old.end_time is not None
    assert (await client.retry_rollout(rid)).status == RolloutStatus.REQUEUING  # already queued: unchanged
    (again,) = await client.dequeue_rollouts(1, worker_id="w2")
    assert again.rollout_id == rid and again.latest_attempt.sequence_number == 2
    with pytest.raises(FailedPreconditionError):  # the stuck runner's late report moves nothing
        await client.complete_attempt(rid, stuck, "succeeded")
    await client.complete_attempt(rid, again.latest_attempt.attempt_id, "succeeded")
    with pytest.raises(FailedPreconditionError, match="cannot be retried"):
        await client.retry_rollout(rid)


async def test_the_client_pages_every_list_with_its_total_and_limits_the_queries(client: StoreClient) -> None:
    rid, first = await claim(client, config=RolloutConfig(max_attempts=3, retry_on=(AttemptStatus.FAILED,)))
    await client.complete_attempt(rid, first, "failed", "try again")
    (again,) = await client.dequeue_rollouts(1, worker_id="w2")
    await client.add_spans(make_spans(5), rollout_id=rid, attempt_id=again.latest_attempt.attempt_id)
    for i in range(3):
        await client.add_resources({"p": PromptTemplate(f"v{i} {{x}}")})
        await client.update_worker(f"worker-{i}", {})

    page = await client.list_attempts(rid, descending=True, page_size=1)
    assert page.total_size == 2 and [a.sequence_number for a in page.items] == [2]
    rest = await client.list_attempts(rid, descending=True, page_size=1, page_token=page.next_page_token)
    assert [a.sequence_number for a in rest.items] == [1] and not rest.next_page_token
    resources = await client.list_resources(page_size=2)
    assert resources.total_size == 3 and len(resources.items) == 2 and resources.next_page_token
    workers = await client.list_workers(
        worker_id_contains="worker-", order_by="last_heartbeat_time", descending=True, page_size=2
    )
    assert workers.total_size == 3 and workers.items[0].worker_id == "worker-2"

    assert [a.sequence_number for a in await client.query_attempts(rid, limit=1)] == [1]
    assert len(await client.query_spans(rid, limit=3)) == 3
    assert len(await client.query_spans(rid)) == 5
    assert len(await client.query_resources(limit=2)) == 2
    assert [w.worker_id for w in await client.query_workers(order_by="worker_id", limit=2)] == ["w1", "w2"]
    with pytest.raises(InvalidArgumentError, match="limit"):
        await client.query_workers(limit=-1)


async def test_spans_list_newest_first_and_with_their_total(client: StoreClient) -> None:
    rid, first = await claim(client, config=RolloutConfig(max_attempts=2, retry_on=(AttemptStatus.FAILED,)))
    await client.add_spans(make_spans(3, name="a"), rollout_id=rid, attempt_id=first)
    await client.complete_attempt(rid, first, "failed")
    (again,) = await client.dequeue_rollouts(1, worker_id="w2")
    second = again.latest_attempt.attempt_id
    await client.add_spans(make_spans(4, name="b"), rollout_id=rid, attempt_id=second)

    page = await client.list_spans(rid, descending=True, page_size=3)
    assert page.total_size == 7
    assert [(s.attempt_id, s.sequence_id) for s in page.items] == [(second, 4), (second, 3), (second, 2)]
    seen = list(page.items)
    while page.next_page_token:
        page = await client.list_spans(rid, descending=True, page_size=3, page_token=page.next_page_token)
        seen += page.items
    assert [(s.attempt_id, s.sequence_id) for s in seen] == [(second, n) for n in (4, 3, 2, 1)] + [
        (first, n) for n in (3, 2, 1)
    ]
    oldest = await client.list_spans(rid, page_size=2)
    assert oldest.total_size == 7 and [s.sequence_id for s in oldest.items] == [1, 2]
    assert (await client.list_spans(rid, first)).total_size == 3
    assert (
        await client.list_spans(rid, name="b", page_size=1)
    ).total_size == 4  # a filter: counted by the backend
    assert (await client.list_spans(rid, "latest", descending=True)).items[0].sequence_id == 4


async def test_a_long_attempt_answers_a_resent_batch_with_its_numbers(client: StoreClient) -> None:
    """Past the few thousand spans after which an attempt's span ids move into the store's compact index, a
    resent batch is still recognised span by span, also when one batch repeats its own spans."""
    from lightning_grpc.store.span_ids import MOVE_AT

    rid, aid = await claim(client)
    batches = [make_spans(500) for _ in range(2 * MOVE_AT // 500 + 1)]
    numbers = []
    for batch in batches:
        numbers.append((await client.add_spans(batch, rollout_id=rid, attempt_id=aid)).sequence_ids)
    again = await client.add_spans(batches[0] + batches[-1] + make_spans(3), rollout_id=rid, attempt_id=aid)
    assert (again.stored_count, again.duplicate_count) == (3, 1000)
    assert again.sequence_ids[:1000] == numbers[0] + numbers[-1]
    twice = make_spans(2)
    inner = await client.add_spans(twice + twice, rollout_id=rid, attempt_id=aid)
    assert (inner.stored_count, inner.duplicate_count) == (2, 2)
    assert inner.sequence_ids[:2] == inner.sequence_ids[2:]
    total = 500 * len(batches) + 3 + 2
    assert (await client.statistics()).total_spans == total
