"""Dynamic sampling ([data] filter_groups, verl's algorithm.filter_groups): groups whose rollouts all earned the
same reward are set aside and more groups drawn, up to data.max_num_gen_batches rounds a step.

The pure parts (which groups carry a signal, joining the kept groups of several batches, the rounds'
bookkeeping) on hand-made batches; then short runs through the whole system (engine, server, runners,
learner as real processes) with an agent whose "flat" task earns 0.5 whatever it answers and whose other
task earns each rollout's sample index (0 or 1: a spread in every group).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_grpc.batching import BatchRollout
from lightning_grpc.batching.tensors import PackRow, concat, pack, pad, take
from lightning_grpc.client.trainer import TrainingBatch
from lightning_grpc.examples.combination_lock import write_jsonl
from lightning_grpc.training.dynamic_sampling import (
    GenerationRounds,
    combine,
    group_rewards,
    has_signal,
    split_groups,
)
from lightning_grpc.training.experiment import ConfigError, experiment_from_dict
from lightning_grpc.training.loop import TrainingRun
from lightning_grpc.training.metrics import undocumented
from lightning_grpc.training.verl_backend import verl_overrides
from lightning_grpc.types import RolloutStatus
from tests.training.test_experiment_config import minimal
from tests.training.test_training import experiment, rows


# ================================================================= pure parts
def test_a_group_has_a_signal_when_its_rewards_differ_or_one_rollout_is_left() -> None:
    assert has_signal([0.0, 1.0]) and has_signal([0.5, 0.5, 0.25])
    assert not has_signal([0.5, 0.5]) and not has_signal([1.0, 1.0, 1.0])
    assert has_signal([0.0])  # GRPO gives a lone rollout its reward as advantage (verl keeps it too)
    assert not has_signal([])  # every rollout of the group dropped: nothing to train


def _tokens(group: str, sample: int, turn: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's prompt and response, from its group, sample and turn only (so any batch holding it agrees)."""
    base = sum(map(ord, group)) % 40 + 3 * sample + turn
    prompt = np.arange(base, base + 1 + (sample + turn) % 3, dtype=np.int32)
    response = np.full(1 + (base % 4), 100 + base, dtype=np.int32)
    return prompt, response


def batch_of(
    batch_id: str, groups: dict[str, list[float]], *, log_probs: bool = True, drops: int = 1
) -> TrainingBatch:
    """A batch as TrainerService gives it: two rows (two calls) per rollout; a group with no rewards lost
    every rollout (it is in group_ids, with no rows)."""
    packed: list[PackRow] = []
    rollouts: list[BatchRollout] = []
    span_ids: list[str] = []
    versions: list[int] = []
    for group, rewards in groups.items():
        for sample, reward in enumerate(rewards):
            index = len(rollouts)
            rid = f"{group}-r{sample}"
            rollouts.append(BatchRollout(rid, f"{rid}-a", group, RolloutStatus.SUCCEEDED, reward, False, 2))
            for turn in range(2):
                prompt, response = _tokens(group, sample, turn)
                packed.append(
                    PackRow(
                        prompt,
                        response,
                        np.ones(len(response), np.uint8),
                        np.full(len(response), -0.25 * (turn + 1), np.float32) if log_probs else None,
                        score=reward if turn else 0.0,
                        rollout_reward=reward,
                        rollout_index=index,
                        turn_index=turn,
                    )
                )
                span_ids.append(f"{rid}-call{turn}")
                versions.append(sample + turn)
    ragged = pack(packed)
    rows_rollout = ragged.rollout_index
    names = np.array([r.group_id for r in rollouts], dtype=object)
    ids = np.array([r.rollout_id for r in rollouts], dtype=object)
    return TrainingBatch(
        batch_id=batch_id,
        group_ids=list(groups),
        rollouts=rollouts,
        arrays=pad(ragged, pad_token_id=0),
        drops={"no_reward": drops},
        carried_over_groups=0,
        closed_by_deadline=False,
        trajectory_breaks=0,
        ragged=ragged,
        uid=names[rows_rollout] if rollouts else np.zeros(0, object),
        rollout_ids=ids[rows_rollout] if rollouts else np.zeros(0, object),
        call_span_ids=span_ids,
        call_policy_versions=np.array(versions, dtype=np.int64),
    )


def test_take_keeps_the_masked_rows_tokens_masks_and_log_probs() -> None:
    ragged = batch_of("b", {"a": [0.0, 1.0], "b": [0.5]}).ragged
    assert ragged is not None
    part = take(ragged, np.array([False, True, True, False, True, False]))
    expected = concat([ragged.row_slice(1, 3), ragged.row_slice(4, 5)])
    for name, array in expected.arrays().items():
        np.testing.assert_array_equal(part.arrays()[name], array, err_msg=name)
    assert part.rows == 3 and part.rollout_index.tolist() == [0, 1, 2]  # still pointing into the whole
    with pytest.raises(ValueError, match="row mask"):
        take(ragged, np.array([True, False]))


def test_combine_joins_the_kept_groups_as_if_they_had_been_one_batch() -> None:
    first = batch_of("run-b1", {"flat": [0.5, 0.5], "mixed": [0.0, 1.0], "gone": []})
    second = batch_of("run-b1-r1", {"also": [1.0, 0.0], "flat2": [1.0, 1.0]})
    combined = combine([(first, ["mixed"]), (second, ["also"])], pad_token_id=0)
    expected = batch_of("x", {"mixed": [0.0, 1.0], "also": [1.0, 0.0]})
    assert combined.batch_id == "run-b1+run-b1-r1"
    assert combined.group_ids == ["mixed", "also"]
    assert [r.rollout_id for r in combined.rollouts] == ["mixed-r0", "mixed-r1", "also-r0", "also-r1"]
    assert set(combined.arrays) == set(expected.arrays)
    for name, array in expected.arrays.items():
        assert combined.arrays[name].dtype == array.dtype, name
        np.testing.assert_array_equal(combined.arrays[name], array, err_msg=name)
    assert combined.uid.tolist() == expected.uid.tolist() == ["mixed"] * 4 + ["also"] * 4
    assert combined.rollout_ids.tolist() == expected.rollout_ids.tolist()
    assert combined.call_span_ids == expected.call_span_ids
    np.testing.assert_array_equal(combined.call_policy_versions, expected.call_policy_versions)
    assert len(combined) == 8 and [r.turn_index for r in combined.rows] == [0, 1] * 4
    assert combined.drops == {"no_reward": 2}  # every part's drops: they were counted building them
    # nothing left out of a single batch: the batch itself
    assert combine([(first, ["flat", "mixed", "gone"])], pad_token_id=0) is first
    # nothing kept at all: an empty batch the update skips
    empty = combine([(first, [])], pad_token_id=0)
    assert len(empty) == 0 and empty.group_ids == [] and empty.uid.size == 0


def test_combine_fills_the_log_probs_of_a_batch_that_recorded_none() -> None:
    with_lp = batch_of("a", {"g1": [0.0, 1.0]})
    without = batch_of("b", {"g2": [1.0, 0.0]}, log_probs=False)
    combined = combine([(with_lp, ["g1"]), (without, ["g2"])], pad_token_id=0)
    has = combined.arrays["has_rollout_log_probs"]
    assert has.tolist() == [True] * 4 + [False] * 4
    assert not combined.arrays["rollout_log_probs"][~has].any()
    np.testing.assert_array_equal(
        combined.arrays["rollout_log_probs"][has], with_lp.arrays["rollout_log_probs"]
    )


def test_generation_rounds_keep_the_groups_with_a_spread_until_the_batch_is_full_or_the_cap() -> None:
    rounds = GenerationRounds(wanted=3, limit=2)
    first = batch_of("b1", {"flat": [1.0, 1.0], "mixed": [0.0, 1.0], "lone": [1.0], "gone": []})
    assert group_rewards(first) == {"flat": [1.0, 1.0], "mixed": [0.0, 1.0], "lone": [1.0], "gone": []}
    assert split_groups(first) == (["mixed", "lone"], ["flat", "gone"])
    assert rounds.add(first) == ["flat", "gone"]
    assert (rounds.kept, rounds.missing, rounds.more, rounds.capped) == (2, 1, True, False)
    rounds.add(batch_of("b1-r1", {"flat2": [0.5, 0.5]}))
    assert (rounds.rounds, rounds.kept, rounds.filtered) == (2, 2, 3)
    assert (rounds.more, rounds.capped) == (False, True)
    assert rounds.batch(pad_token_id=0).group_ids == ["mixed", "lone"]
    metrics = rounds.metrics(solved_at=1.0)
    assert metrics["filtered_groups"] == 3 and metrics["gen_batches"] == 2
    assert metrics["filter_groups_capped"] == 1.0
    # the reward metrics are those of every group generated (a group with no rows has no rollout to count)
    assert metrics["groups"] == 4 and metrics["rollouts"] == 7
    assert metrics["zero_variance_groups"] == 3  # flat, flat2, and lone (one reward: all equal)
    assert metrics["reward_mean"] == pytest.approx((2 + 1 + 1 + 1) / 7)

    full = GenerationRounds(wanted=1, limit=4)
    full.add(batch_of("c1", {"mixed": [0.0, 1.0]}))
    assert (full.more, full.capped, full.metrics(1.0)["filter_groups_capped"]) == (False, False, 0.0)


def test_the_keys_are_checked_and_named(tmp_path: Path) -> None:
    config = experiment_from_dict(minimal(tmp_path), base_dir=tmp_path)
    assert config.data.filter_groups is False and config.data.max_num_gen_batches == 4
    with pytest.raises(ConfigError, match=r"^data\.max_num_gen_batches must be at least 1 .*0 = no cap"):
        experiment_from_dict(minimal(tmp_path, data={"max_num_gen_batches": 0}), base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^data\.filter_groups needs data\.group_size of at least 2"):
        experiment_from_dict(
            minimal(tmp_path, data={"filter_groups": True, "group_size": 1}), base_dir=tmp_path
        )
    with pytest.raises(ConfigError, match=r"^data\.filter_groups has the wrong kind of value"):
        experiment_from_dict(minimal(tmp_path, data={"filter_groups": 1}), base_dir=tmp_path)
    on = experiment_from_dict(
        minimal(tmp_path, data={"filter_groups": True, "max_num_gen_batches": 3}), base_dir=tmp_path
    )
    assert on.to_dict()["data"]["filter_groups"] is True
    # --backend verl: verl's names for the same settings
    keys = dict(o.split("=", 1) for o in verl_overrides(on))
    assert keys["algorithm.filter_groups._target_"] == "verl.trainer.config.FilterGroupsConfig"
    assert keys["algorithm.filter_groups.enable"] == "true"
    assert keys["algorithm.filter_groups.max_num_gen_batches"] == "3"
    assert keys["algorithm.filter_groups.metric"] == "seq_final_reward"
    assert dict(o.split("=", 1) for o in verl_overrides(config))["algorithm.filter_groups.enable"] == "false"


# ================================================================= through the whole system
AGENT = '''
from lightning_grpc.runner.llm import openai_client


async def agent(task, llm, rollout):
    """One call to the policy; a flat task earns 0.5 whatever it answered, the other the rollout's sample
    index (its id ends in -r<index>): 0 and 1 in a group of two."""
    await openai_client(llm).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "Say anything."}], max_tokens=2
    )
    if task["flat"]:
        return 0.5
    return float(rollout.rollout_id.rsplit("-r", 1)[1])
'''


class RecordedRun(TrainingRun):
    """The run as it is, keeping the batch each step trained on (what dynamic sampling handed the update)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained: dict[int, TrainingBatch] = {}

    async def _filter_groups(self, step: int, *args: Any) -> tuple[TrainingBatch, dict[str, float]]:
        batch, metrics = await super()._filter_groups(step, *args)
        self.trained[step] = batch
        return batch, metrics


def filtering_experiment(tmp_path: Path, tiny_model: Path, flat: int = 1, **data: Any) -> Any:
    (tmp_path / "flat_agent.py").write_text(AGENT)
    config = experiment(
        tmp_path,
        tiny_model,
        experiment={"steps": 2, "stall_window": 0},
        agent={"agent": f"{tmp_path / 'flat_agent.py'}:agent", "val_tasks": "", "concurrency": 16},
        data={"group_size": 2, "filter_groups": True, **data},
    )
    # after experiment(), which writes the lock's tasks: ``flat`` flat tasks and one with a spread in every
    # group (the plan draws each once an epoch)
    write_jsonl([{"flat": True}] * flat + [{"flat": False}], tmp_path / "train.jsonl")
    return config


def test_flat_groups_are_set_aside_and_more_groups_drawn_until_the_batch_is_full(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Two groups a step from two tasks: the first round holds one flat group (set aside) and one with a
    spread; further rounds draw the missing group until it has a spread. The update sees only groups whose
    rewards differ, from rounds tagged s<step>-r<round>, and no group twice."""
    config = filtering_experiment(tmp_path, tiny_model, batch_size=2, max_num_gen_batches=8)
    run = RecordedRun(config, progress=False)
    result = asyncio.run(run.run())
    assert result.steps == 2
    history = rows(config.output_dir / "metrics.csv")
    trained_groups: list[str] = []
    for step, row in zip((1, 2), history, strict=True):
        batch = run.trained[step]
        rewards = group_rewards(batch)
        assert len(rewards) == 2 and all(sorted(r) == [0.0, 1.0] for r in rewards.values()), rewards
        trained_groups += batch.group_ids
        rounds = int(float(row["gen_batches"]))
        assert rounds >= 2 and float(row["filter_groups_capped"]) == 0.0
        # every round but the last set a flat group aside (the plan decides how many a round drew)
        assert float(row["filtered_groups"]) >= rounds - 1
        assert float(row["batch_rows"]) == len(batch) == 4
        # the reward metrics count every group generated: the flat ones too
        assert float(row["groups"]) == 2 + float(row["filtered_groups"])
        assert float(row["zero_variance_groups"]) == float(row["filtered_groups"])
        assert all(re.fullmatch(rf"t-s{step}(-r[1-7])?-g\d+", g) for g in batch.group_ids), batch.group_ids
        assert any(re.search(r"-s\d+-r\d+-", g) for g in batch.group_ids)  # one came from a later round
    assert len(set(trained_groups)) == len(trained_groups) == 4
    assert undocumented(["filtered_groups", "gen_batches", "filter_groups_capped"]) == []  # docs/metrics.md


def test_at_the_cap_the_step_trains_on_what_it_has_and_says_so_once(
    tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three groups a step from three flat tasks and one with a spread: two rounds draw at most six groups,
    two epochs of the plan, so at most two groups with a spread. With max_num_gen_batches = 2 every step ends
    capped and trains on the groups with a spread it found, said once."""
    config = filtering_experiment(tmp_path, tiny_model, flat=3, batch_size=3, max_num_gen_batches=2)
    said: list[str] = []
    run = RecordedRun(config, progress=False, say=said.append)
    with caplog.at_level("WARNING", logger="lightning_grpc.training"):
        asyncio.run(run.run())
    history = rows(config.output_dir / "metrics.csv")
    assert [float(r["filter_groups_capped"]) for r in history] == [1.0, 1.0]
    assert [float(r["gen_batches"]) for r in history] == [2.0, 2.0]
    for step, row in zip((1, 2), history, strict=True):
        kept = len(run.trained[step].group_ids)
        assert 1 <= kept <= 2
        # round 1 drew three, round 2 the missing ones: every group not trained was set aside
        assert float(row["filtered_groups"]) == 3 + (3 - kept_after_round_1(run, step)) - kept
        assert all(sorted(r) == [0.0, 1.0] for r in group_rewards(run.trained[step]).values())
    warnings = [line for line in said if "dynamic sampling reached data.max_num_gen_batches = 2" in line]
    assert len(warnings) == 1 and "at step 1 with" in warnings[0] and "of 3 groups" in warnings[0], said
    logged = [r.getMessage() for r in caplog.records if "event=filter_groups_capped" in r.getMessage()]
    assert len(logged) == 1 and "step=1 kept_groups=" in logged[0] and "gen_batches=2" in logged[0], logged


def kept_after_round_1(run: RecordedRun, step: int) -> int:
    """Groups of the step's first round that were trained (their ids carry no round tag)."""
    return sum(1 for g in run.trained[step].group_ids if re.fullmatch(rf"t-s{step}-g\d+", g))
