"""Each call's recorded sampling temperature, from its span to the triplets and the batch rows, through a real
gRPC server (both backends): one temperature per row, 1.0 where a span does not say, and a trajectory whose
calls were sampled at different temperatures falls back to one row per call, counted."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest_asyncio

from lightning_grpc import semconv
from lightning_grpc.batching.tensors import PackRow, pack, pad
from lightning_grpc.client import StoreClient, TrainerClient
from lightning_grpc.client.trainer import batch_from_messages
from lightning_grpc.server.app import RunningServer
from lightning_grpc.types import Span
from lightning_grpc.v1 import trainer_service_pb2 as pb
from tests.helpers import llm_call, reward_span

#: (prompt, response, sampling attributes) of one call.
Call = tuple[list[int], list[int], dict[str, object]]


@pytest_asyncio.fixture
async def trainer(server: RunningServer) -> AsyncIterator[TrainerClient]:
    client = TrainerClient(f"127.0.0.1:{server.port}")
    try:
        yield client
    finally:
        await client.close()


def sampled(temperature: float, top_p: float = 1.0) -> dict[str, object]:
    """The attributes the proxy writes for a call sampled so (``semconv.sampling_attributes``)."""
    return semconv.sampling_attributes({"temperature": temperature, "top_p": top_p})


async def play(store: StoreClient, calls_by_rollout: dict[str, Sequence[Call]]) -> None:
    """Dequeue every rollout named and write its LLM calls (with their sampling attributes) and a reward."""
    done = 0
    while done < len(calls_by_rollout):
        for rollout in await store.dequeue_rollouts(len(calls_by_rollout) - done, worker_id="w", wait=5):
            attempt = rollout.latest_attempt
            assert attempt is not None
            spans: list[Span] = [
                llm_call(
                    prompt, response, logprobs=[-0.5] * len(response), start_ns=1_000_000 * (i + 1), **attrs
                )
                for i, (prompt, response, attrs) in enumerate(calls_by_rollout[rollout.rollout_id])
            ]
            spans.append(reward_span(1.0, start_ns=1_000_000 * (len(spans) + 1)))
            await store.add_spans(spans, rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id)
            await store.complete_attempt(rollout.rollout_id, attempt.attempt_id, "succeeded")
            done += 1


async def test_each_row_carries_its_calls_temperature_in_every_layout(
    trainer: TrainerClient, client: StoreClient
) -> None:
    [group] = await trainer.submit_groups(["task"], 3)
    hot, plain, unknown = group.rollout_ids
    await play(
        client,
        {
            hot: [([1, 2], [3, 4], sampled(0.7, 0.9))],
            plain: [([1, 2], [5], sampled(1.0))],
            unknown: [([1, 2], [6, 7, 8], {})],  # a span written before the attributes: 1.0
        },
    )
    ragged = await trainer.get_batch(request_id="t", pad_token_id=0)
    padded = await trainer.get_batch(request_id="t", pad_token_id=0, layout="padded")
    for batch in (ragged, padded):
        assert list(batch.rollout_ids) == [hot, plain, unknown]
        temperatures = batch.arrays["temperatures"]
        assert temperatures.dtype == np.float32 and temperatures.shape == (3,)
        np.testing.assert_array_equal(temperatures, np.array([0.7, 1.0, 1.0], np.float32))
    assert ragged.ragged is not None and ragged.ragged.temperatures is not None
    [triplet] = (await trainer.triplets(hot)).triplets
    assert (triplet.temperature, triplet.top_p, triplet.sampling_temperature) == (0.7, 0.9, 0.7)
    [triplet] = (await trainer.triplets(unknown)).triplets
    assert (triplet.temperature, triplet.top_p, triplet.sampling_temperature) == (None, None, 1.0)
    # A server from before the array sends none: the batch has no temperatures (the learner then keeps
    # its configured one), in either layout.
    for batch in (ragged, padded):
        old = [pb.GetBatchResponse.FromString(m.SerializeToString()) for m in batch.messages]
        for message in old:
            del message.tensors["temperatures"]
        rebuilt = batch_from_messages(old)
        assert "temperatures" not in rebuilt.arrays and len(rebuilt) == 3
        if rebuilt.ragged is not None:
            assert rebuilt.ragged.temperatures is None


TASK, CALL_1, RESULT_1, CALL_2 = [1, 2], [3, 4], [50, 51], [5, 6]


async def test_a_trajectory_sampled_at_two_temperatures_falls_back_to_one_row_per_call(
    trainer: TrainerClient, client: StoreClient
) -> None:
    [group] = await trainer.submit_groups(["task"], 2)
    steady, changed = group.rollout_ids
    second_prompt = TASK + CALL_1 + RESULT_1
    await play(
        client,
        {
            steady: [(TASK, CALL_1, sampled(0.7)), (second_prompt, CALL_2, sampled(0.7))],
            changed: [(TASK, CALL_1, sampled(0.7)), (second_prompt, CALL_2, sampled(0.0))],
        },
    )
    batch = await trainer.get_batch(aggregation="trajectory", pad_token_id=0)
    assert batch.fallbacks == {"temperature_differs": 1} and batch.trajectory_breaks == 1
    assert [(r.rollout_id, r.row_count) for r in batch.rollouts] == [(steady, 1), (changed, 2)]
    np.testing.assert_array_equal(batch.arrays["temperatures"], np.array([0.7, 0.7, 0.0], np.float32))
    assert batch.arrays["responses"][0].tolist() == CALL_1 + RESULT_1 + CALL_2
    assert (await trainer.status()).fallbacks == {"temperature_differs": 1}
    report = await trainer.triplets(changed, aggregation="trajectory")
    fallback = report.aggregation_fallback
    assert fallback is not None and (fallback.reason, fallback.call_index) == ("temperature_differs", 1)
    assert (fallback.position, fallback.expected_token, fallback.actual_token) == (-1, -1, -1)
    assert "sampled at temperature 0, call 0 at 0.7" in fallback.detail
    assert [t.temperature for t in report.triplets] == [0.7, 0.0]
    assert (await trainer.triplets(steady, aggregation="trajectory")).aggregation_fallback is None


def test_packed_rows_keep_their_temperature_through_slices_and_padding() -> None:
    rows = [
        PackRow(np.array([1]), np.array([2, 3]), np.array([1, 1]), None, 1.0, 1.0, 0, temperature=0.7),
        PackRow(np.array([1]), np.array([4]), np.array([1]), None, 0.0, 0.0, 1),
    ]
    ragged = pack(rows)
    np.testing.assert_array_equal(ragged.temperatures, np.array([0.7, 1.0], np.float32))
    np.testing.assert_array_equal(ragged.row_slice(1, 2).temperatures, np.array([1.0], np.float32))
    np.testing.assert_array_equal(pad(ragged)["temperatures"], ragged.temperatures)
    assert "temperatures" in ragged.arrays() and "temperatures" in ragged.row_arrays()
