"""Rollout creation, updates, listing, resources, workers, statistics and housekeeping."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc.client import StoreClient
from lightning_grpc.errors import (
    AbortedError,
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from lightning_grpc.server.app import ServerConfig, start_server
from lightning_grpc.store import open_store
from lightning_grpc.types import (
    LLM,
    AttemptStatus,
    JsonResource,
    PromptTemplate,
    ProxyLLM,
    RolloutConfig,
    RolloutMode,
    RolloutSpec,
    RolloutStatus,
)
from lightning_grpc.v1 import store_service_pb2 as pb
from tests.conftest import every_store_backend  # noqa: F401  (runs on PostgreSQL too)
from tests.helpers import fill_memory_until_refused, make_spans


async def test_enqueue_keeps_every_field_and_resolves_the_latest_resources(client: StoreClient) -> None:
    res = await client.add_resources({"prompt": PromptTemplate("Solve {q}")})
    cfg = RolloutConfig(timeout=30, unresponsive_timeout=5, max_attempts=3, retry_on=(AttemptStatus.TIMEOUT,))
    r = await client.enqueue_rollout(
        {"q": "2+2", "nums": [1, 2.5]}, mode="train", group_id="g1", config=cfg, metadata={"data_id": 7}
    )
    assert r.rollout_id.startswith("ro-") and r.status == RolloutStatus.QUEUING
    assert r.input == {"q": "2+2", "nums": [1, 2.5]} and r.mode == RolloutMode.TRAIN and r.group_id == "g1"
    assert r.config == cfg and r.metadata == {"data_id": 7} and r.resources_id == res.resources_id
    assert abs(r.create_time - time.time()) < 5 and r.latest_attempt is None and r.attempt_count == 0


async def test_enqueue_with_a_caller_id_returns_the_original_on_retry_and_refuses_other_contents(
    client: StoreClient,
) -> None:
    first = await client.enqueue_rollout({"a": 1}, rollout_id="job-1")
    again = await client.enqueue_rollout({"a": 1}, rollout_id="job-1")
    assert again.rollout_id == first.rollout_id and again.create_time == first.create_time
    with pytest.raises(AlreadyExistsError) as err:
        await client.enqueue_rollout({"a": 2}, rollout_id="job-1")
    assert err.value.reason == "ROLLOUT_ALREADY_EXISTS" and err.value.metadata["rolloutId"] == "job-1"
    assert (await client.statistics()).total_rollouts == 1
    assert len(await client.dequeue_rollouts(5)) == 1


async def test_enqueue_many_keeps_order_and_validates_before_storing_anything(client: StoreClient) -> None:
    rollouts = await client.enqueue_rollouts([RolloutSpec(input=i) for i in range(4)])
    assert [r.input for r in rollouts] == [0, 1, 2, 3]
    bad = [RolloutSpec(input=10), RolloutSpec(input=11, config=RolloutConfig(max_attempts=-1))]
    with pytest.raises(InvalidArgumentError) as err:
        await client.enqueue_rollouts(bad)
    assert err.value.field == "rollouts[1].config.max_attempts"
    with pytest.raises(NotFoundError) as nf:
        await client.enqueue_rollout(1, resources_id="rs-missing")
    assert nf.value.reason == "RESOURCES_NOT_FOUND"
    with pytest.raises(InvalidArgumentError) as bad_retry:
        await client.enqueue_rollout(1, config=RolloutConfig(retry_on=(AttemptStatus.SUCCEEDED,)))
    assert bad_retry.value.field == "rollouts[0].config.retry_on[0]"
    assert "got SUCCEEDED" in bad_retry.value.message
    unknown = RolloutConfig(retry_on=(99,))  # type: ignore[arg-type]  # a number no status has, as a raw client may send
    with pytest.raises(InvalidArgumentError, match="got 99") as bad_number:
        await client.enqueue_rollout(1, config=unknown)
    assert bad_number.value.field == "rollouts[0].config.retry_on[0]"
    with pytest.raises(InvalidArgumentError):
        await client.enqueue_rollout(1, rollout_id="has space")
    assert (await client.statistics()).total_rollouts == 4


async def test_start_rollout_creates_it_claimed_with_a_first_attempt(client: StoreClient) -> None:
    r = await client.start_rollout({"x": 1}, worker_id="w1", rollout_id="direct-1")
    assert r.status == RolloutStatus.PREPARING and r.latest_attempt is not None
    assert r.latest_attempt.sequence_number == 1 and r.latest_attempt.worker_id == "w1"
    assert (await client.start_rollout({"x": 1}, rollout_id="direct-1")).latest_attempt == r.latest_attempt
    assert await client.dequeue_rollout() is None


async def test_update_rollout_changes_only_the_given_fields(client: StoreClient) -> None:
    res = await client.add_resources({"j": JsonResource({"k": 1})})
    r = await client.enqueue_rollout({"x": 1}, metadata={"a": 1}, group_id="g")
    u = await client.update_rollout(
        r.rollout_id, metadata={"b": 2}, mode="val", resources_id=res.resources_id
    )
    assert u.metadata == {"b": 2} and u.mode == RolloutMode.VAL and u.resources_id == res.resources_id
    assert u.input == {"x": 1} and u.group_id == "g" and u.status == RolloutStatus.QUEUING
    u2 = await client.update_rollout(r.rollout_id, input=None, config=RolloutConfig(max_attempts=4))
    assert u2.input is None and u2.config.max_attempts == 4 and u2.metadata == {"b": 2}
    with pytest.raises(NotFoundError):
        await client.update_rollout(r.rollout_id, resources_id="rs-none")
    with pytest.raises(NotFoundError):
        await client.update_rollout("ro-none", metadata={})


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_a_status_page_in_creation_order_holds_when_the_clock_steps_back(
    tmp_path: Path, where: str
) -> None:
    """A page in creation order (of every rollout, or of a status) is read off the rollouts in the order they were
    taken while that order is their (create_time, creation) order; a clock that stepped back ends that, and the
    pages still come in create_time order, before and after a restart."""
    now = [100.0]
    expected = [3, 0, 5, 1, 2, 4]  # by create_time; the two at 200 in the order they came
    db = tmp_path / "s.db" if where == "sqlite" else None

    async def listed(store: Any, descending: bool, statuses: list[RolloutStatus]) -> list[int]:
        names, token = [], ""
        while True:
            page = await store.list_rollouts(
                statuses=statuses, page_size=2, page_token=token, descending=descending
            )
            assert page.total_size == 6
            names += [r.input["n"] for r in page.items]
            token = page.next_page_token
            if not token:
                return names

    async def check(store: Any) -> None:
        for statuses in ([], [RolloutStatus.QUEUING]):
            assert await listed(store, False, statuses) == expected
            assert await listed(store, True, statuses) == expected[::-1]

    store = await open_store(db, clock=lambda: now[0])
    try:
        for n, at in enumerate([100.0, 200.0, 200.0, 50.0, 300.0, 150.0]):
            now[0] = at
            await store.enqueue_rollouts([RolloutSpec(input={"n": n})])
        await check(store)
    finally:
        await store.close()
    if db is not None:
        reopened = await open_store(db, clock=lambda: now[0])
        try:
            await check(reopened)
        finally:
            await reopened.close()


async def test_list_rollouts_filters_orders_and_pages(client: StoreClient) -> None:
    specs = [
        RolloutSpec(input=i, group_id=f"g{i % 2}", mode=RolloutMode.TRAIN if i < 6 else RolloutMode.VAL)
        for i in range(10)
    ]
    created = await client.enqueue_rollouts(specs)
    for _ in range(3):
        d = await client.dequeue_rollout()
        assert d is not None and d.latest_attempt
        await client.complete_attempt(d.rollout_id, d.latest_attempt.attempt_id, "succeeded")
    assert len(await client.query_rollouts(status_in=["succeeded"])) == 3
    assert len(await client.query_rollouts(status_in=["queuing", "succeeded"])) == 10
    assert len(await client.query_rollouts(group_id="g1")) == 5
    assert len(await client.query_rollouts(mode="val")) == 4
    assert [
        r.input for r in await client.query_rollouts(status_in=["queuing"], group_id="g0", mode="train")
    ] == [4]
    ids = [created[1].rollout_id, created[4].rollout_id]
    assert sorted(r.rollout_id for r in await client.query_rollouts(rollout_ids=ids)) == sorted(ids)
    assert [
        r.rollout_id for r in await client.query_rollouts(rollout_id_contains=created[5].rollout_id[-6:])
    ] == [created[5].rollout_id]
    page1 = await client.list_rollouts(page_size=4)
    page2 = await client.list_rollouts(page_size=4, page_token=page1.next_page_token)
    page3 = await client.list_rollouts(page_size=4, page_token=page2.next_page_token)
    assert page1.total_size == 10 and page3.next_page_token == ""
    assert [r.rollout_id for r in page1.items + page2.items + page3.items] == [r.rollout_id for r in created]
    by_id_desc = await client.list_rollouts(order_by="rollout_id", descending=True, page_size=100)
    assert [r.rollout_id for r in by_id_desc] == sorted((r.rollout_id for r in created), reverse=True)
    with pytest.raises(InvalidArgumentError) as err:
        await client.list_rollouts(page_size=4, page_token=page1.next_page_token, group_id="g0")
    assert err.value.field == "page_token"
    for bad in ({"page_token": "!!!"}, {"page_size": -1}, {"order_by": "color"}, {"status_in": [42]}):
        with pytest.raises(InvalidArgumentError):
            await client.list_rollouts(**bad)  # type: ignore[arg-type]
    assert await client.query_rollouts(status_in=["failed"]) == []


async def test_resources_are_versioned_typed_and_the_latest_is_tracked(client: StoreClient) -> None:
    assert await client.get_latest_resources() is None
    llm = LLM("http://127.0.0.1:8000/v1", "tiny", sampling_parameters={"temperature": 0.7})
    a = await client.add_resources({"main_llm": llm, "prompt": PromptTemplate("Q: {q}")})
    assert a.version == 1 and a.resources_id.startswith("rs-")
    assert a.resources["main_llm"] == llm and a.resources["prompt"] == PromptTemplate("Q: {q}")
    proxy = ProxyLLM("http://proxy:9000/v1", "tiny")
    b = await client.add_resources({"main_llm": proxy})
    assert (await client.get_latest_resources()) == b
    u = await client.update_resources(a.resources_id, {"main_llm": llm, "extra": JsonResource([1, 2])})
    assert u.version == 2 and u.create_time == a.create_time and u.update_time >= a.update_time
    assert (await client.get_latest_resources()) == u
    got = await client.get_resources(b.resources_id)
    assert isinstance(got.resources["main_llm"], ProxyLLM)
    assert (
        got.resources["main_llm"].for_attempt("ro-1", "at-2").endpoint
        == "http://proxy:9000/rollout/ro-1/attempt/at-2/v1"
    )
    with pytest.raises(AbortedError) as ab:
        await client.update_resources(a.resources_id, {}, expected_version=1)
    assert ab.value.reason == "RESOURCES_VERSION_MISMATCH"
    assert (await client.update_resources(a.resources_id, {}, expected_version=2)).version == 3
    with pytest.raises(NotFoundError):  # the reference silently created it
        await client.update_resources("rs-missing", {"x": JsonResource(1)})
    same = await client.add_resources({"p": PromptTemplate("x")}, resources_id="fixed")
    assert (await client.add_resources({"p": PromptTemplate("x")}, resources_id="fixed")) == same
    with pytest.raises(AlreadyExistsError):
        await client.add_resources({"p": PromptTemplate("y")}, resources_id="fixed")
    assert [r.resources_id for r in await client.query_resources()] == [
        b.resources_id,
        a.resources_id,
        "fixed",
    ]
    assert await client.get_resources_by_id("rs-missing") is None


async def test_statistics_count_everything(client: StoreClient) -> None:
    await client.add_resources({"p": PromptTemplate("x")})
    await client.enqueue_rollouts([RolloutSpec(input=i) for i in range(3)])
    d = await client.dequeue_rollout(worker_id="w")
    assert d is not None and d.latest_attempt
    await client.add_spans(make_spans(4), rollout_id=d.rollout_id, attempt_id=d.latest_attempt.attempt_id)
    s = await client.statistics()
    assert s.rollouts_by_status == {"queuing": 2, "running": 1}
    assert (s.total_rollouts, s.total_attempts, s.total_spans, s.total_resources, s.total_workers) == (
        3,
        1,
        4,
        1,
        1,
    )
    assert s.queue_length == 2 and s.uptime > 0 and s.backend in ("memory", "sqlite", "postgres")


async def test_delete_removes_finished_rollouts_with_their_attempts_and_spans(client: StoreClient) -> None:
    done = []
    for _ in range(3):
        d = await client.start_rollout({"x": 1}, worker_id="w")
        assert d.latest_attempt
        await client.add_spans(make_spans(5), rollout_id=d.rollout_id, attempt_id=d.latest_attempt.attempt_id)
        await client.complete_attempt(d.rollout_id, d.latest_attempt.attempt_id, "succeeded")
        done.append(d.rollout_id)
    running = await client.start_rollout({"x": 2})
    with pytest.raises(FailedPreconditionError) as err:
        await client.delete_rollouts([done[0], running.rollout_id])
    assert err.value.reason == "ROLLOUT_NOT_FINISHED"
    result = await client.delete_rollouts([done[0]])
    assert (result.deleted_rollouts, result.deleted_attempts, result.deleted_spans) == (1, 1, 5)
    assert await client.get_rollout_by_id(done[0]) is None
    by_age = await client.delete_rollouts(finished_before=time.time() + 1)
    assert by_age.deleted_rollouts == 2
    s = await client.statistics()
    assert s.total_rollouts == 1 and s.total_spans == 0
    with pytest.raises(NotFoundError):
        await client.delete_rollouts(["ro-gone"])


async def test_memory_bound_evicts_the_oldest_finished_rollouts_and_never_running_ones() -> None:
    running = await start_server(ServerConfig(port=0, max_memory_bytes=200_000))
    try:
        async with StoreClient(f"127.0.0.1:{running.port}") as client:
            active = await client.start_rollout({"keep": True})
            assert active.latest_attempt
            finished = []
            for i in range(12):
                r = await client.start_rollout({"i": i})
                assert r.latest_attempt
                spans = make_spans(20)
                for s in spans:
                    s.attributes["blob"] = "x" * 900
                await client.add_spans(spans, rollout_id=r.rollout_id, attempt_id=r.latest_attempt.attempt_id)
                await client.complete_attempt(r.rollout_id, r.latest_attempt.attempt_id, "succeeded")
                finished.append(r.rollout_id)
            stats = await client.statistics()
            assert stats.memory_bytes <= 200_000
            assert await client.get_rollout_by_id(finished[0]) is None  # oldest went first
            assert await client.get_rollout_by_id(finished[-1]) is not None
            assert await client.get_rollout_by_id(active.rollout_id) is not None
            # a store full of unfinished work refuses new spans instead of dropping running rollouts
            refused = await fill_memory_until_refused(
                client, active.rollout_id, active.latest_attempt.attempt_id, blob="y", batches=50
            )
            assert refused.reason == "STORE_MEMORY_FULL"
            assert (await client.get_rollout(active.rollout_id)).status == RolloutStatus.RUNNING
    finally:
        await running.stop()


async def test_a_page_token_never_skips_rows_when_earlier_rows_leave_the_filter(client: StoreClient) -> None:
    ids = [
        r.rollout_id
        for r in await client.enqueue_rollouts([RolloutSpec(input=i, group_id="g3") for i in range(4)])
    ]
    first = await client.list_rollouts(group_id="g3", status_in=["queuing"], page_size=2)
    assert [r.rollout_id for r in first] == ids[:2]
    await client.cancel_rollout(ids[0])  # leaves the filtered set before the next page is read
    second = await client.list_rollouts(
        group_id="g3", status_in=["queuing"], page_size=2, page_token=first.next_page_token
    )
    assert [r.rollout_id for r in second] == ids[2:] and second.next_page_token == ""
    workers = [f"w-{i}" for i in range(5)]
    for w in workers:
        await client.update_worker(w)
    seen, token = [], ""
    while True:
        resp = await client._call("ListWorkers", pb.ListWorkersRequest(page_size=2, page_token=token))
        seen += [w.worker_id for w in resp.workers]
        token = resp.next_page_token
        if not token:
            break
    assert seen == workers
