"""TrainerService through a real gRPC server (both backends): groups in, whole-group batches out.

Rollouts are played by a small runner loop that uses the real Store client: it dequeues, writes the
spans the proxy and an agent would write (LLM calls with token ids, rewards) and reports the outcome.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import pytest_asyncio
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lightning_grpc import semconv
from lightning_grpc.batching import BatchOptions, GroupSample
from lightning_grpc.batching.tensors import PARALLEL_PAD_POSITIONS, PackRow, pack, pad
from lightning_grpc.client import StoreClient, SyncTrainerClient, TrainerClient
from lightning_grpc.client.trainer import batch_from_messages
from lightning_grpc.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from lightning_grpc.server.app import RunningServer
from lightning_grpc.types import Span
from lightning_grpc.v1 import trainer_service_pb2 as pb
from lightning_grpc.v1 import trainer_service_pb2_grpc as pb_grpc
from tests.conftest import (
    ServerProcess,
    every_store_backend,  # noqa: F401  (runs on PostgreSQL too)
)
from tests.helpers import llm_call, reward_span


@dataclass
class Play:
    """What the runner does with one rollout."""

    calls: list[tuple[list[int], list[int]]] = field(default_factory=lambda: [([1, 2, 3], [4, 5])])
    reward: float | None = 1.0
    status: str = "succeeded"
    version: int = 0
    logprobs: bool = True


def spans_of(play: Play) -> list[Span]:
    spans = [
        llm_call(p, r, logprobs=[-0.5] * len(r) if play.logprobs else None, version=play.version)
        for p, r in play.calls
    ]
    if play.reward is not None:
        spans.append(reward_span(play.reward))
    return spans


async def run_rollouts(store: StoreClient, plays: dict[str, Play], count: int, worker: str = "w") -> None:
    """Dequeue ``count`` rollouts and play each as ``plays`` says (the default Play when not named)."""
    done = 0
    while done < count:
        for r in await store.dequeue_rollouts(count - done, worker_id=worker, wait=5):
            play = plays.get(r.rollout_id, Play())
            assert r.latest_attempt is not None
            spans = spans_of(play)
            if spans:
                await store.add_spans(spans, rollout_id=r.rollout_id, attempt_id=r.latest_attempt.attempt_id)
            await store.complete_attempt(r.rollout_id, r.latest_attempt.attempt_id, play.status)
            done += 1


@pytest_asyncio.fixture
async def trainer(server: RunningServer) -> AsyncIterator[TrainerClient]:
    client = TrainerClient(f"127.0.0.1:{server.port}")
    try:
        yield client
    finally:
        await client.close()


_ids = itertools.count(1)


def gid(name: str) -> str:
    return f"{name}-{next(_ids)}"


# ================================================================= padding, element by element
def test_padding_masks_positions_and_reward_placement_element_by_element() -> None:

    rows = [
        PackRow(
            np.array([11, 12, 13]),
            np.array([21, 22]),
            np.array([1, 1]),
            np.array([-0.1, -0.2]),
            0.1,
            0.1,
            0,
        ),
        PackRow(
            np.array([31]), np.array([41, 42, 43, 44]), np.array([1, 0, 0, 1]), None, 0.123456789, 0.5, 1
        ),
        PackRow(np.array([51, 52]), np.array([61]), np.array([1]), np.array([-0.3]), -1.0, 0.5, 1),
    ]
    ragged = pack(rows)
    assert ragged.token_ids.dtype == np.uint16
    out = pad(ragged, pad_token_id=0)
    np.testing.assert_array_equal(out["prompts"], [[11, 12, 13], [0, 0, 31], [0, 51, 52]])
    np.testing.assert_array_equal(out["responses"], [[21, 22, 0, 0], [41, 42, 43, 44], [61, 0, 0, 0]])
    np.testing.assert_array_equal(
        out["input_ids"], [[11, 12, 13, 21, 22, 0, 0], [0, 0, 31, 41, 42, 43, 44], [0, 51, 52, 61, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        out["attention_mask"], [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        out["position_ids"], [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 2, 2, 2]]
    )
    np.testing.assert_array_equal(out["response_mask"], [[1, 1, 0, 0], [1, 0, 0, 1], [1, 0, 0, 0]])
    scores = out["token_level_scores"]
    assert scores.dtype == np.float32
    expected = np.zeros((3, 4), np.float32)
    expected[0, 1], expected[1, 3], expected[2, 0] = (
        np.float32(0.1),
        np.float32(0.123456789),
        np.float32(-1.0),
    )
    np.testing.assert_array_equal(scores, expected)
    lp = out["rollout_log_probs"]
    np.testing.assert_array_equal(
        lp, np.array([[-0.1, -0.2, 0, 0], [0, 0, 0, 0], [-0.3, 0, 0, 0]], np.float32)
    )
    np.testing.assert_array_equal(out["has_rollout_log_probs"], [True, False, True])
    np.testing.assert_array_equal(out["rollout_index"], [0, 1, 1])
    np.testing.assert_array_equal(out["rows_per_rollout"], [1, 2, 2])
    np.testing.assert_array_equal(out["rollout_rewards"], np.array([0.1, 0.5, 0.5], np.float32))
    wide = pad(ragged, pad_token_id=7, prompt_length=4, response_length=5)
    np.testing.assert_array_equal(wide["prompts"][1], [7, 7, 7, 31])
    np.testing.assert_array_equal(wide["responses"][2], [61, 7, 7, 7, 7])
    np.testing.assert_array_equal(wide["position_ids"][1], [0, 0, 0, 0, 1, 2, 3, 4, 4])


def test_a_large_batch_padded_by_two_threads_equals_each_row_padded_alone() -> None:
    rng = np.random.default_rng(7)
    rows = []
    for i in range(160):
        n = int(rng.integers(0, 700))
        rows.append(
            PackRow(
                rng.integers(0, 50_000, int(rng.integers(1, 900))),
                rng.integers(0, 50_000, n),
                (rng.random(n) < 0.8).astype(np.uint8),
                rng.random(n) if i % 3 else None,
                float(rng.random()),
                1.0,
                i // 4,
                turn_index=i % 4,
            )
        )
    ragged = pack(rows)
    whole = pad(ragged, pad_token_id=7)
    b, width = whole["input_ids"].shape
    assert b * width >= PARALLEL_PAD_POSITIONS  # the two-thread path
    width_r = whole["responses"].shape[1]
    for i in range(b):
        alone = pad(
            ragged.row_slice(i, i + 1), pad_token_id=7, prompt_length=width - width_r, response_length=width_r
        )
        for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "token_level_scores"):
            np.testing.assert_array_equal(whole[name][i], alone[name][0], err_msg=f"{name} of row {i}")
        np.testing.assert_array_equal(whole["rollout_log_probs"][i], alone["rollout_log_probs"][0])
    np.testing.assert_array_equal(whole["turn_index"], [i % 4 for i in range(160)])


def test_large_vocabularies_travel_as_int32() -> None:

    ragged = pack([PackRow(np.array([151_000]), np.array([70_000, 5]), np.array([1, 1]), None, 1.0, 1.0, 0)])
    assert ragged.token_ids.dtype == np.int32 and ragged.rollout_log_probs is None
    assert pad(ragged)["responses"].tolist() == [[70_000, 5]]


# ================================================================= whole groups
async def test_only_whole_groups_are_batched_and_stragglers_carry_over(
    trainer: TrainerClient, client: StoreClient
) -> None:
    a, b = gid("a"), gid("b")
    groups = await trainer.submit_groups([GroupSample({"q": 1}, a), GroupSample({"q": 2}, b)], 3, step=1)
    assert [g.group_id for g in groups] == [a, b]
    assert groups[0].rollout_ids == [f"{a}-r0", f"{a}-r1", f"{a}-r2"]
    await run_rollouts(client, {}, 5)  # a's three and two of b's (queue order)
    batch = await trainer.get_batch(min_groups=2, max_groups=2, wait=0.3)
    assert batch.group_ids == [a] and batch.closed_by_deadline and batch.carried_over_groups == 1
    assert len(batch) == 3 and list(batch.uid) == [a, a, a]
    assert list(batch.rollout_ids) == groups[0].rollout_ids
    status = await trainer.status()
    train = next(c for c in status.groups if str(c.mode) == "train")
    assert (train.pending, train.ready, train.carried_over, train.consumed) == (1, 0, 1, 1)

    waiting = asyncio.create_task(trainer.get_batch(min_groups=1, wait=10))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # long-poll: b still has a running sibling
    await run_rollouts(client, {}, 1)
    second = await asyncio.wait_for(waiting, 10)
    assert second.group_ids == [b] and not second.closed_by_deadline and second.carried_over_groups == 0
    empty = await trainer.get_batch(min_groups=1, wait=0)
    assert len(empty) == 0 and empty.group_ids == [] and empty.closed_by_deadline


async def test_batch_arrays_hold_the_recorded_tokens_logprobs_and_rewards(
    trainer: TrainerClient, client: StoreClient
) -> None:
    g = gid("t")
    [group] = await trainer.submit_groups([GroupSample("task", g)], 2)
    plays = {
        group.rollout_ids[0]: Play(calls=[([5, 6, 7], [8, 9, 10])], reward=0.25),
        group.rollout_ids[1]: Play(calls=[([5, 6, 7], [11])], reward=0.75, logprobs=False),
    }
    await run_rollouts(client, plays, 2)
    batch = await trainer.get_batch(pad_token_id=0)
    arrays = batch.arrays
    np.testing.assert_array_equal(arrays["prompts"], [[5, 6, 7], [5, 6, 7]])
    np.testing.assert_array_equal(arrays["responses"], [[8, 9, 10], [11, 0, 0]])
    np.testing.assert_array_equal(
        arrays["token_level_scores"], np.array([[0, 0, 0.25], [0.75, 0, 0]], np.float32)
    )
    np.testing.assert_array_equal(arrays["rollout_log_probs"][0], np.full(3, -0.5, np.float32))
    np.testing.assert_array_equal(arrays["has_rollout_log_probs"], [True, False])
    assert [r.reward for r in batch.rollouts] == [0.25, 0.75]  # exact float64
    assert [r.has_log_probs for r in batch.rows] == [True, False]
    tensors = batch.tensors()
    assert tensors["input_ids"].dtype.is_floating_point is False and tensors["input_ids"].shape == (2, 6)
    assert np.shares_memory(tensors["responses"].numpy(), arrays["responses"])


# ================================================================= failures are never a silent 0
@pytest.mark.parametrize(
    ("policy", "rollouts", "filled"),
    [("drop_group", 0, 0), ("drop_rollout", 2, 0), ("fill", 3, 1)],
)
async def test_a_failed_sibling_under_each_failure_policy(
    trainer: TrainerClient, client: StoreClient, policy: str, rollouts: int, filled: int
) -> None:
    g = gid("f")
    [group] = await trainer.submit_groups([GroupSample("x", g)], 3)
    await run_rollouts(client, {group.rollout_ids[1]: Play(reward=None, status="failed")}, 3)
    batch = await trainer.get_batch(failure_policy=policy, fill_reward=-1.0)
    assert len(batch.rollouts) == rollouts
    assert sum(r.filled for r in batch.rollouts) == filled
    assert batch.drops["rollout_failed"] == 1
    if policy == "drop_group":
        assert batch.group_ids == [] and batch.drops["group_dropped_for_failed_sibling"] == 1
    if policy == "fill":
        failed = next(r for r in batch.rollouts if r.filled)
        assert failed.rollout_id == group.rollout_ids[1] and failed.reward == -1.0
        row = next(i for i, info in enumerate(batch.rows) if info.filled)
        assert batch.arrays["token_level_scores"][row].tolist() == [0.0, -1.0]
    # whatever the policy, the failed rollout never enters with reward 0
    for r in batch.rollouts:
        assert r.rollout_id != group.rollout_ids[1] or r.filled


async def test_a_cancelled_group_is_never_trained_as_zero(
    trainer: TrainerClient, client: StoreClient
) -> None:
    g = gid("c")
    [group] = await trainer.submit_groups([GroupSample("x", g)], 2)
    for rid in group.rollout_ids:
        await client.cancel_rollout(rid)
    batch = await trainer.get_batch(wait=2)
    assert batch.group_ids == [g] and len(batch) == 0
    assert batch.drops["rollout_cancelled"] == 2 and batch.drops["rollout_dropped"] == 2


async def test_a_rollout_without_reward_follows_the_failure_policy(
    trainer: TrainerClient, client: StoreClient
) -> None:
    [group] = await trainer.submit_groups([GroupSample("x", gid("n"))], 2)
    await run_rollouts(client, {group.rollout_ids[0]: Play(reward=None)}, 2)
    batch = await trainer.get_batch()
    assert [r.rollout_id for r in batch.rollouts] == [group.rollout_ids[1]]
    assert batch.drops["no_reward"] == 1


# ================================================================= idempotency and retries
async def test_resubmission_is_idempotent_and_a_changed_group_is_refused(trainer: TrainerClient) -> None:
    g = gid("i")
    first = await trainer.submit_groups([GroupSample({"q": 1}, g)], 2, step=3)
    again = await trainer.submit_groups([GroupSample({"q": 1}, g)], 2, step=3)
    assert first == again
    with pytest.raises(AlreadyExistsError):
        await trainer.submit_groups([GroupSample({"q": 2}, g)], 2, step=3)
    status = await trainer.status()
    assert sum(c.pending for c in status.groups) == 1


async def test_a_retried_batch_request_returns_the_same_batch(
    trainer: TrainerClient, client: StoreClient
) -> None:
    await trainer.submit_groups(["a", "b"], 2)
    await run_rollouts(client, {}, 4)
    one = await trainer.get_batch(min_groups=1, max_groups=1, request_id="batch-7")
    again = await trainer.get_batch(min_groups=1, max_groups=1, request_id="batch-7")
    assert again.group_ids == one.group_ids and len(one.group_ids) == 1
    for name, array in one.arrays.items():
        np.testing.assert_array_equal(again.arrays[name], array)
    other = await trainer.get_batch(min_groups=1, max_groups=1)
    assert other.group_ids != one.group_ids and len(other.group_ids) == 1


# ================================================================= chunks, layouts, staleness
async def test_a_batch_larger_than_a_chunk_streams_in_chunks(
    trainer: TrainerClient, client: StoreClient
) -> None:
    groups = await trainer.submit_groups(["a", "b", "c"], 2)
    long = list(range(1, 20_001))
    plays = {rid: Play(calls=[(long, long[:5000])]) for g in groups for rid in g.rollout_ids}
    await run_rollouts(client, plays, 6)
    options = BatchOptions.checked(max_chunk_bytes=64 * 1024)
    request = pb.GetBatchRequest(request_id="chunked", min_groups=3, max_groups=3)
    from lightning_grpc import convert

    convert.batch_options_to_pb(options, request.options)
    messages = [m async for m in trainer.stub.GetBatch(request)]
    assert len(messages) == 6 and messages[0].header.chunk_count == 6
    assert all(m.ByteSize() < 4 * 1024 * 1024 for m in messages)
    batch = await trainer.get_batch(min_groups=3, request_id="chunked", options=options)
    whole = await trainer.get_batch(min_groups=3, request_id="chunked")  # default chunks: one message
    assert len(batch) == 6
    for name, array in whole.arrays.items():
        np.testing.assert_array_equal(batch.arrays[name], array)
    np.testing.assert_array_equal(batch.arrays["prompts"][5], long)
    # row descriptions travel column by column, each chunk with the calls of its own rows
    for m in messages:
        calls = int(convert.tensor_from_pb(m.tensors["calls_per_row"]).sum())
        assert (
            len(m.call_span_ids)
            == len(m.call_policy_versions)
            == calls
            == len(m.tensors["calls_per_row"].data) // 4
        )
    assert batch.rows == whole.rows and [r.rollout_index for r in batch.rows] == list(range(6))
    # chunks are padded as they arrive, at the widths the header gives; without them, once all are in
    header = messages[0].header
    assert (header.prompt_length, header.response_length) == (20_000, 5_000)
    bare = [pb.GetBatchResponse.FromString(m.SerializeToString()) for m in messages]
    bare[0].header.prompt_length = bare[0].header.response_length = 0
    for name, array in batch_from_messages(bare).arrays.items():
        np.testing.assert_array_equal(batch.arrays[name], array, err_msg=name)
    assert len({r.call_span_ids[0] for r in batch.rows}) == 6
    assert all(len(r.call_span_ids) == 1 and r.policy_versions == [0] for r in batch.rows)


async def test_padded_layout_equals_the_clients_padding(trainer: TrainerClient, client: StoreClient) -> None:
    groups = await trainer.submit_groups(["a"], 3)
    plays = {
        groups[0].rollout_ids[0]: Play(calls=[([1], [2, 3, 4])]),
        groups[0].rollout_ids[1]: Play(calls=[([1, 2, 3, 4], [5])], logprobs=False),
    }
    await run_rollouts(client, plays, 3)
    ragged = await trainer.get_batch(request_id="lay", pad_token_id=9)
    padded = await trainer.get_batch(request_id="lay", pad_token_id=9, layout="padded")
    assert padded.ragged is None and ragged.ragged is not None
    assert set(padded.arrays) == set(ragged.arrays)
    for name, array in ragged.arrays.items():
        np.testing.assert_array_equal(padded.arrays[name], array, err_msg=name)
        assert padded.arrays[name].dtype == array.dtype, name


async def test_calls_of_an_older_policy_are_dropped_and_counted(
    trainer: TrainerClient, client: StoreClient
) -> None:
    [group] = await trainer.submit_groups(["a"], 2)
    plays = {
        group.rollout_ids[0]: Play(calls=[([1], [2]), ([3], [4])], version=1),
        group.rollout_ids[1]: Play(calls=[([1], [2])], version=2),
    }
    await run_rollouts(client, plays, 2)
    batch = await trainer.get_batch(min_policy_version=2)
    assert batch.drops["stale_policy"] == 2
    assert [r.rollout_id for r in batch.rollouts] == [group.rollout_ids[1]]
    assert batch.rows[0].policy_versions == [2]


async def test_length_limits_truncate_or_drop_and_count(trainer: TrainerClient, client: StoreClient) -> None:
    [group] = await trainer.submit_groups(["a"], 2)
    plays = {
        group.rollout_ids[0]: Play(calls=[([1, 2, 3, 4, 5], [6, 7])]),
        group.rollout_ids[1]: Play(calls=[([1, 2], [3, 4, 5, 6])]),
    }
    await run_rollouts(client, plays, 2)
    batch = await trainer.get_batch(request_id="lim", max_prompt_length=3, max_response_length=2)
    assert batch.drops["prompt_too_long"] == 1 and batch.drops["truncated_response"] == 1
    assert batch.arrays["responses"].tolist() == [[3, 4]] and batch.rows[0].truncated
    cut = await trainer.get_batch(
        request_id="lim", max_prompt_length=3, max_response_length=2, prompt_overflow="truncate_left"
    )
    assert cut.arrays["prompts"].tolist() == [[3, 4, 5], [0, 1, 2]]
    assert cut.drops["truncated_prompt"] == 1


# ================================================================= trajectory aggregation
TASK, CALL_1, RESULT_1, CALL_2, RESULT_2, ANSWER = [1, 2], [3, 4], [50, 51], [5, 6], [52], [7, 8]


def tool_turns(third_prompt_shows_call_2_as: list[int]) -> list[tuple[list[int], list[int]]]:
    """Two tool calls answered by tool results, then the answer; the third prompt shows call 2 as given."""
    second = TASK + CALL_1 + RESULT_1
    return [(TASK, CALL_1), (second, CALL_2), (second + third_prompt_shows_call_2_as + RESULT_2, ANSWER)]


async def test_a_re_rendered_history_falls_back_to_calls_and_is_counted_in_the_batch_and_the_triplets(
    trainer: TrainerClient, client: StoreClient
) -> None:
    [group] = await trainer.submit_groups(["a"], 2)
    exact, re_rendered = group.rollout_ids
    plays = {exact: Play(calls=tool_turns(CALL_2)), re_rendered: Play(calls=tool_turns([5, 9]))}
    await run_rollouts(client, plays, 2)
    batch = await trainer.get_batch(aggregation="trajectory", pad_token_id=0)
    assert batch.fallbacks == {"prompt_not_extension": 1} and batch.trajectory_breaks == 2
    assert [(r.rollout_id, r.row_count) for r in batch.rollouts] == [(exact, 1), (re_rendered, 3)]
    assert batch.arrays["responses"][0].tolist() == CALL_1 + RESULT_1 + CALL_2 + RESULT_2 + ANSWER
    assert batch.arrays["response_mask"][0].tolist() == [1, 1, 0, 0, 1, 1, 0, 1, 1]  # tool results: 0
    assert [len(row.call_span_ids) for row in batch.rows] == [3, 1, 1, 1]
    per_call = batch.arrays["response_mask"][1:].sum(axis=1).tolist()
    assert per_call == [2, 2, 2]  # each call's own response only: nothing spliced
    status = await trainer.status()
    assert status.fallbacks == {"prompt_not_extension": 1}
    report = await trainer.triplets(re_rendered, aggregation="trajectory")
    fallback = report.aggregation_fallback
    assert fallback is not None and (fallback.reason, fallback.call_index) == ("prompt_not_extension", 2)
    assert (fallback.position, fallback.expected_token, fallback.actual_token) == (7, 6, 9)
    assert (
        fallback.detail.startswith("call 2 (span ")
        and "position 7: token 9 where 6 was expected" in fallback.detail
    )
    assert len(report.rows) == 3
    assert (await trainer.triplets(exact, aggregation="trajectory")).aggregation_fallback is None
    assert (await trainer.triplets(re_rendered, aggregation="transition")).aggregation_fallback is None


async def test_tokens_a_grammar_forced_are_not_trained_and_reach_the_triplets(
    trainer: TrainerClient, client: StoreClient
) -> None:
    """A forced tool call: the engine marked every response position but the one the policy chose."""
    [group] = await trainer.submit_groups(["a"], 1)
    [rollout_id] = group.rollout_ids
    [rollout] = await client.dequeue_rollouts(1, worker_id="w", wait=5)
    forced = llm_call([1, 2], [10, 11, 3, 12, 13], logprobs=[-0.5] * 5)
    forced.attributes[semconv.LLM_RESPONSE_FORCED_POSITIONS] = [0, 1, 3, 4]
    attempt = rollout.latest_attempt
    assert attempt is not None and rollout.rollout_id == rollout_id
    await client.add_spans([forced, reward_span(1.0)], rollout_id=rollout_id, attempt_id=attempt.attempt_id)
    await client.complete_attempt(rollout_id, attempt.attempt_id, "succeeded")
    batch = await trainer.get_batch(pad_token_id=0)
    assert batch.arrays["response_mask"][0].tolist() == [0, 0, 1, 0, 0]
    [triplet] = (await trainer.triplets(rollout_id)).triplets
    assert triplet.forced_positions.tolist() == [0, 1, 3, 4]


# ================================================================= steps and status
async def test_steps_are_reported_watched_and_resumed(trainer: TrainerClient) -> None:
    first = await trainer.report_step(1, 1, {"reward_mean": 0.5}, run_id="exp")
    assert (await trainer.report_step(1, 1, {"reward_mean": 0.5}, run_id="exp")) == first  # a retry
    second = await trainer.report_step(2, 2, {"reward_mean": 0.75}, run_id="exp")
    await trainer.report_step(1, 1, {}, run_id="other")
    seen = [e async for e in trainer.watch_training("exp")]
    assert [(e.step, e.metrics["reward_mean"]) for e in seen] == [(1, 0.5), (2, 0.75)]
    after = [e async for e in trainer.watch_training("exp", after_sequence=first.sequence)]
    assert after == [second]

    async def follow() -> list[int]:
        out = []
        async for event in trainer.watch_training("exp", after_sequence=second.sequence, follow=True):
            out.append(event.step)
            return out
        return out

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    await trainer.report_step(3, 3, {"loss": 0.1}, run_id="exp")
    assert await asyncio.wait_for(task, 5) == [3]
    status = await trainer.status()
    assert status.policy_version == 3 and status.last_event is not None and status.last_event.step == 3


async def test_errors_are_typed_and_name_the_field(trainer: TrainerClient) -> None:
    with pytest.raises(NotFoundError):
        await trainer.triplets("ro-missing")
    cases = [
        (lambda: trainer.submit_groups(["a"], 0), "group_size"),
        (lambda: trainer.submit_groups([], 2), "samples"),
        (lambda: trainer.submit_groups([GroupSample("a", "bad id!")], 2), "samples[0].group_id"),
        (lambda: trainer.get_batch(min_groups=3, max_groups=2), "max_groups"),
        (lambda: trainer.get_batch(min_groups=-1), "min_groups"),
        (lambda: trainer.get_batch(wait=-1), "wait"),
        (lambda: trainer.report_step(1, 1, {"x": float("nan")}), "metrics['x']"),
    ]
    for call, field_name in cases:
        with pytest.raises(InvalidArgumentError) as info:
            await call()
        assert info.value.metadata["field"] == field_name, info.value
    for bad in ({"agent_match": "("}, {"max_chunk_bytes": 10}, {"pad_token_id": -1}):
        request = pb.GetBatchRequest(options=pb.BatchOptions(**bad))  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in trainer.stub.GetBatch(request):
                pass
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "options." + next(iter(bad)) in (raw.value.details() or "")


async def test_reflection_lists_the_trainer_service(server: RunningServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def one() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for answer in stub.ServerReflectionInfo(one()):
            names = [s.name for s in answer.list_services_response.service]
            assert "lightning.v1.TrainerService" in names
            break


def test_the_sync_client_pulls_a_batch(server_process: type[ServerProcess]) -> None:
    process = server_process("--port", "0", "--memory").start()
    with SyncTrainerClient(process.address) as trainer:
        [group] = trainer.submit_groups(["a"], 1)

        async def play() -> None:
            async with StoreClient(process.address) as store:
                await run_rollouts(store, {}, 1)

        asyncio.run(play())
        batch = trainer.get_batch(wait=5)
        assert batch.group_ids == [group.group_id] and batch.arrays["input_ids"].shape == (1, 5)
        assert trainer.status().batches == 1


# ================================================================= durability
@pytest.fixture
def sqlite_process(
    server_process: type[ServerProcess], tmp_path: object
) -> Iterator[tuple[type[ServerProcess], str]]:
    yield server_process, str(tmp_path / "store.db")  # type: ignore[operator]


async def test_kill_9_between_submit_and_batch_loses_nothing(
    sqlite_process: tuple[type[ServerProcess], str],
) -> None:
    make, db = sqlite_process
    first = make("--port", "0", "--db", db).start()
    address = first.address
    async with TrainerClient(address) as trainer, StoreClient(address) as store:
        groups = await trainer.submit_groups(["a", "b", "c"], 2)
        await run_rollouts(store, {}, 6)
        taken = await trainer.get_batch(min_groups=1, max_groups=1, request_id="before-kill")
    first.kill()
    second = make("--port", str(first.port), "--db", db).start()
    async with TrainerClient(second.address) as trainer:
        status = await trainer.status()
        train = next(c for c in status.groups if str(c.mode) == "train")
        assert (train.ready, train.consumed) == (2, 1)
        again = await trainer.get_batch(min_groups=1, max_groups=1, request_id="before-kill")
        assert again.group_ids == taken.group_ids
        rest = await trainer.get_batch(min_groups=2, max_groups=5)
        assert sorted(rest.group_ids + taken.group_ids) == sorted(g.group_id for g in groups)
        assert len(rest) == 4
    second.terminate()


async def test_the_stub_answers_every_rpc_kind(server: RunningServer) -> None:
    """Unary and server-streaming RPCs of TrainerService, straight from the generated stub."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.TrainerServiceStub(channel)
        status = await stub.GetTrainerStatus(pb.GetTrainerStatusRequest())
        assert status.batches == 0
        await stub.ReportStep(pb.ReportStepRequest(step=1, policy_version=1))
        events = [m async for m in stub.WatchTraining(pb.WatchTrainingRequest())]
        assert [e.event.step for e in events] == [1]


# ================================================================= CLI
def test_cli_shows_a_rollouts_triplets_and_the_trainer_status(server_process: type[ServerProcess]) -> None:
    import subprocess
    import sys

    process = server_process("--port", "0", "--memory").start()

    async def prepare() -> tuple[str, str]:
        async with TrainerClient(process.address) as trainer, StoreClient(process.address) as store:
            [group] = await trainer.submit_groups(["a"], 2)
            plays = {
                group.rollout_ids[0]: Play(
                    calls=[([1, 2], [3, 4]), ([1, 2], [3, 4]), ([1, 2, 3, 4, 9], [5])]
                ),
                group.rollout_ids[1]: Play(calls=tool_turns([5, 9])),
            }
            await run_rollouts(store, plays, 2)
            await trainer.get_batch(aggregation="trajectory")
            return group.rollout_ids[0], group.rollout_ids[1]

    rollout_id, re_rendered = asyncio.run(prepare())
    cli = [sys.executable, "-m", "lightning_grpc.cli.main"]
    shown = subprocess.run(
        [*cli, "triplets", rollout_id, "--store", process.address, "--aggregation", "trajectory"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert rollout_id in out and "llm calls:" in out and "duplicate_call" in out
    assert "rows:" in out and "reward:" in out and "fell back" not in out
    fell_back = subprocess.run(
        [*cli, "triplets", re_rendered, "--store", process.address, "--aggregation", "trajectory"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fell_back.returncode == 0, fell_back.stderr
    assert "trajectory fell back to one row per call (prompt_not_extension): call 2 (span" in fell_back.stdout
    status = subprocess.run(
        [*cli, "trainer", "status", "--store", process.address], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    assert "consumed" in status.stdout and "batches:" in status.stdout
    assert (
        "trajectory fell back to per-call rows" in status.stdout and "prompt_not_extension" in status.stdout
    )
    missing = subprocess.run(
        [*cli, "triplets", "ro-nope", "--store", process.address], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "ro-nope" in missing.stderr and "Traceback" not in missing.stderr
