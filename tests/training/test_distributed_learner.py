"""The learner as FSDP ranks placed by Ray (``[learner] ranks``): real Ray actors, torch.distributed over
gloo, the tiny model. Two ranks must compute the update one process computes on the same batch.

Tolerances (fp32; measured on this project's 2-core CPU machine in brackets): the losses and per-token
metrics agree to 1e-5 relative or 1e-6 absolute [worst 3e-7 relative for the loss, 2e-5 relative = 1e-7
absolute for a small pg_loss]; the grad norm to 5e-5 relative [1.4e-5]: the gradients agree to ~2e-8
absolute, but torch's fp32 norm over 254k parameters moves by ~5e-6 with the order it sums in; the
weights after one Adam step to 5e-5 absolute at a learning rate of 1e-2 [9e-6: 0.1% of a step; Adam
divides by |g| + 1e-8, so entries whose gradient is near 1e-8 feel the rounding most], 5e-4 after
several steps [1.5e-5]. Where each mini-batch lies with one rank (the other runs a stand-in row) the
update is bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_grpc.processes import start_ray
from lightning_grpc.training import ppo
from lightning_grpc.training.distributed import DistributedLearner, split_groups_by_tokens
from lightning_grpc.training.learner import Learner, OptimConfig, UpdateInput

ray = pytest.importorskip("ray")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.timeout(600)

METRIC_RTOL = 1e-5
GRAD_NORM_RTOL = 5e-5
METRIC_ATOL = 1e-6


def make_batch(
    seed: int,
    *,
    groups: int = 4,
    group_size: int = 3,
    prompt_len: int = 6,
    response_len: int = 5,
    long_group: int | None = 0,
    recorded: str = "some",
    temperatures: bool = False,
) -> UpdateInput:
    """A batch shaped as TrainerService cuts it (left-padded prompts, right-padded responses, rollouts of
    one or two rows); ``long_group``: a group whose rows all take the full lengths (uneven by tokens);
    ``recorded``: which rows carry the proxy's log-probs ("all", "some"); ``temperatures``: each row's
    recorded sampling temperature (0.7, 1.0 or 1.3, and one greedy row), else no such array."""
    rng = np.random.default_rng(seed)
    rows = []
    rollout = 0
    for group in range(groups):
        for _ in range(group_size):
            reward = float(rng.integers(0, 3)) / 2
            for _ in range(1 + rollout % 2):
                full = group == long_group
                p = prompt_len if full else int(rng.integers(2, prompt_len + 1))
                r = response_len if full else int(rng.integers(1, response_len + 1))
                rows.append((group, rollout, reward, p, r))
            rollout += 1
    count, width = len(rows), prompt_len + response_len
    a: dict[str, np.ndarray] = {
        name: np.zeros((count, width), np.int64) for name in ("input_ids", "attention_mask", "position_ids")
    }
    a["responses"] = np.zeros((count, response_len), np.int64)
    a["response_mask"] = np.zeros((count, response_len), np.int64)
    a["rollout_log_probs"] = np.zeros((count, response_len), np.float32)
    a["rollout_index"] = np.zeros(count, np.int64)
    a["rollout_rewards"] = np.zeros(count, np.float32)
    a["has_rollout_log_probs"] = np.zeros(count, np.bool_)
    uid = np.empty(count, dtype=object)
    for i, (group, rollout, reward, p, r) in enumerate(rows):
        prompt, response = rng.integers(1, 2000, p), rng.integers(1, 2000, r)
        a["input_ids"][i, prompt_len - p : prompt_len] = prompt
        a["input_ids"][i, prompt_len : prompt_len + r] = response
        a["attention_mask"][i, prompt_len - p : prompt_len + r] = 1
        a["position_ids"][i] = np.clip(np.cumsum(a["attention_mask"][i]) - 1, 0, None)
        a["responses"][i, :r] = response
        a["response_mask"][i, :r] = 1
        a["rollout_index"][i] = rollout
        a["rollout_rewards"][i] = reward
        if recorded == "all" or i % 3:
            a["has_rollout_log_probs"][i] = True
            a["rollout_log_probs"][i, :r] = -7.5 + rng.normal(0, 0.1, r)
        uid[i] = f"g{group}"
    if temperatures:  # drawn apart, so that the rest of the batch is the same with or without them
        a["temperatures"] = (
            np.random.default_rng(seed + 100).choice([0.7, 1.0, 1.3], count).astype(np.float32)
        )
        a["temperatures"][-1] = 0.0
    return UpdateInput(a, uid)


def weights(learner: Learner | DistributedLearner, path: Path) -> dict[str, torch.Tensor]:
    """The weights as the engine would load them (``export_weights``)."""
    return dict(safetensors_torch.load_file(str(learner.export_weights(path) / "model.safetensors")))


def assert_same_metrics(one: dict[str, float], two: dict[str, float]) -> None:
    shared = [name for name in one if not name.endswith("_seconds")]
    assert set(shared) <= set(two), set(shared) - set(two)
    for name in shared:
        rtol = GRAD_NORM_RTOL if name == "grad_norm" else METRIC_RTOL
        assert two[name] == pytest.approx(one[name], rel=rtol, abs=METRIC_ATOL), (name, one[name], two[name])


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One small local Ray for the module (the learners find it running and leave it running)."""
    start_ray(
        ray,
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


# ------------------------------------------------------------ the split
def test_groups_are_split_whole_and_balanced_by_tokens() -> None:
    batch = make_batch(0, groups=5, long_group=0)
    tokens = batch.arrays["attention_mask"].sum(axis=1)
    split = split_groups_by_tokens(batch.uid, tokens, 2)
    assert sorted(np.concatenate(split).tolist()) == list(range(len(batch.uid)))  # every row, once
    for rows in split:  # whole groups: no group on two ranks
        assert list(rows) == sorted(rows)
    groups_of = [set(batch.uid[rows].tolist()) for rows in split]
    assert not groups_of[0] & groups_of[1]
    loads = [int(tokens[rows].sum()) for rows in split]
    biggest = max(int(tokens[batch.uid == g].sum()) for g in set(batch.uid.tolist()))
    assert abs(loads[0] - loads[1]) <= biggest  # greedy bound: never worse than one group
    assert len(split[0]) != len(split[1])  # this batch splits unevenly by rows
    assert split_groups_by_tokens(batch.uid, tokens, 2)[0].tolist() == split[0].tolist()  # deterministic
    # fewer groups than ranks: the extra ranks get no rows
    one = make_batch(1, groups=1)
    parts = split_groups_by_tokens(one.uid, one.arrays["attention_mask"].sum(axis=1), 3)
    assert [len(p) for p in parts] == [len(one.uid), 0, 0]


# ------------------------------------------------------------ parity with one process
CASES = {
    # the default: one optimiser step over the whole batch, old log-probs from its own forward pass
    "token-mean": (ppo.PPOConfig(), OptimConfig(lr=1e-2)),
    # mini-batches of one group (the rank without it runs a stand-in row), two epochs, recomputed
    # old log-probs, entropy bonus, no clipping; each row at its recorded sampling temperature
    "seq-mean-token-mean": (
        ppo.PPOConfig(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01),
        OptimConfig(lr=1e-2, mini_batch_rollouts=3, ppo_epochs=2, max_grad_norm=0.0),
    ),
    # per-rollout weights, a KL loss to a (sharded) reference, the proxy's log-probs, tight clipping
    "per-rollout-mean": (
        ppo.PPOConfig(loss_agg_mode="per-rollout-mean", use_kl_loss=True, entropy_coeff=0.01),
        OptimConfig(lr=1e-2, mini_batch_rollouts=4, old_log_probs="rollout", max_grad_norm=0.05),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_compute_the_update_of_one_process(
    case: str, local_ray: None, tiny_model: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    ppo_config, optim = CASES[case]
    recorded = "all" if optim.old_log_probs == "rollout" else "some"
    per_row = case == "seq-mean-token-mean"  # the batches carry each row's recorded temperature
    batches = [
        # uneven by tokens: rank 0 takes the long group
        make_batch(0, long_group=0, recorded=recorded, temperatures=per_row),
        # one group: rank 1 has no rows
        make_batch(1, groups=1, long_group=None, recorded=recorded, temperatures=per_row),
        make_batch(2, long_group=3, recorded=recorded, temperatures=per_row),
    ]
    one = Learner(tiny_model, ppo_config=ppo_config, optim=optim)
    two = DistributedLearner(tiny_model, ppo_config=ppo_config, optim=optim, ranks=2)
    try:
        assert two.backend == "gloo"
        start = weights(one, tmp_path / "start")
        one_step = optim.mini_batch_rollouts == 0 and optim.ppo_epochs == 1
        for i, batch in enumerate(batches):
            expected = one.update(batch)
            got = two.update(batch)
            assert_same_metrics(expected, got)
            assert {"update_rank0_seconds", "update_rank1_seconds", "rank0_tokens", "rank1_tokens"} <= set(
                got
            )
            assert got["rank0_tokens"] + got["rank1_tokens"] == float(batch.arrays["attention_mask"].sum())
            after_one, after_two = weights(one, tmp_path / f"one-{i}"), weights(two, tmp_path / f"two-{i}")
            difference = max_difference(after_one, after_two)
            assert difference < (5e-5 if one_step and i == 0 else 5e-4), (i, difference)
            if case == "seq-mean-token-mean":  # each mini-batch on one rank: the other adds exact zeros
                assert difference == 0.0 and got["loss"] == expected["loss"]
            assert max_difference(after_one, start) > 1e-3  # the update moved the weights
        assert two.step == one.step == 3 and two.rank_steps() == [3, 3]
        # the exported directory is the one-process learner's: same files, same config
        assert sorted(p.name for p in (tmp_path / "two-2").iterdir()) == sorted(
            p.name for p in (tmp_path / "one-2").iterdir()
        )
        assert (tmp_path / "two-2" / "config.json").read_text() == (
            tmp_path / "one-2" / "config.json"
        ).read_text()
    finally:
        two.close()


# ------------------------------------------------------------ sharded checkpoints
def test_resume_from_a_sharded_checkpoint_restores_every_rank(
    local_ray: None, tiny_model: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    options: dict[str, Any] = {
        "ppo_config": ppo.PPOConfig(loss_agg_mode="token-mean", use_kl_loss=True),
        "optim": OptimConfig(lr=1e-2, mini_batch_rollouts=6, ppo_epochs=2),
        "ranks": 2,
        "seed": 3,
    }
    first, second = make_batch(0), make_batch(1, long_group=2)
    learner = DistributedLearner(tiny_model, **options)
    try:
        learner.update(first)
        checkpoint = learner.save_checkpoint(tmp_path / "ck", {"policy_version": 7, "experiment": "t"})
        saved = weights(learner, tmp_path / "saved")
        uninterrupted = learner.update(second)
        uninterrupted_weights = weights(learner, tmp_path / "uninterrupted")
    finally:
        learner.close()
    # an engine can start from the checkpoint: the full weights and the tokenizer are there
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer_config.json"):
        assert (checkpoint / name).exists(), name
    assert (checkpoint / "sharded" / ".metadata").exists()
    assert {p.name for p in checkpoint.glob("rank-*.pt")} == {"rank-0.pt", "rank-1.pt"}

    resumed, extra = DistributedLearner.resume(checkpoint, **options)
    try:
        assert extra == {"policy_version": 7, "experiment": "t"}
        assert resumed.step == 1 and resumed.rank_steps() == [1, 1]
        assert max_difference(weights(resumed, tmp_path / "restored"), saved) == 0.0
        again = resumed.update(second)  # Adam's moments and step count come back: the same update
        for name, value in uninterrupted.items():
            if not name.endswith("_seconds"):
                assert again[name] == value, (name, value, again[name])
        assert max_difference(weights(resumed, tmp_path / "again"), uninterrupted_weights) == 0.0
    finally:
        resumed.close()
    # the same checkpoint read whole by the one-process learner (the loop with ranks = 1)
    alone, extra = Learner.resume(
        checkpoint, ppo_config=options["ppo_config"], optim=options["optim"], seed=3
    )
    assert extra["policy_version"] == 7 and alone.step == 1
    assert_same_metrics(alone.update(second), uninterrupted)
    assert max_difference(weights(alone, tmp_path / "alone"), uninterrupted_weights) < 5e-4


def test_ranks_resume_a_checkpoint_of_the_one_process_learner(
    local_ray: None, tiny_model: Path, tmp_path: Path
) -> None:
    """From ranks = 1 to ranks = 2 in the middle of a run: the whole optimiser state is cut into shards."""
    torch.set_num_threads(1)
    ppo_config = ppo.PPOConfig(use_kl_loss=True)
    optim = OptimConfig(lr=1e-2, mini_batch_rollouts=6)
    one = Learner(tiny_model, ppo_config=ppo_config, optim=optim, seed=5)
    one.update(make_batch(0))
    checkpoint = one.save_checkpoint(tmp_path / "ck", {"policy_version": 1})
    expected = one.update(make_batch(1))
    ranks, extra = DistributedLearner.resume(checkpoint, ppo_config=ppo_config, optim=optim, seed=5, ranks=2)
    try:
        assert extra == {"policy_version": 1} and ranks.rank_steps() == [1, 1]
        assert_same_metrics(expected, ranks.update(make_batch(1)))
        assert max_difference(weights(ranks, tmp_path / "ranks"), weights(one, tmp_path / "one")) < 5e-4
    finally:
        ranks.close()
    with pytest.raises(Exception, match="is not a checkpoint"):
        DistributedLearner.resume(
            tiny_model, ppo_config=ppo_config, optim=optim, ranks=2
        )  # a model, not a checkpoint
