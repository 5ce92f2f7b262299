"""The no-learning-signal watcher: each condition warns once after ``window`` steps with its figures, clears
and comes back; and ``trainer status`` names the conditions a run's last step recorded."""

from __future__ import annotations

from lightning_grpc.batching import TrainerStatus
from lightning_grpc.batching.core import GroupCounts, TrainingEvent
from lightning_grpc.cli.trainer_commands import status_text
from lightning_grpc.training.signal import SignalWatcher, truncated_share
from lightning_grpc.types import RolloutMode


def flat(groups: int = 16, zero_variance: int = 16, reward_std: float = 0.1) -> dict[str, float]:
    return {
        "zero_variance_groups": float(zero_variance),
        "groups": float(groups),
        "reward_mean": 0.5,
        "reward_std": reward_std,
        "rollouts": float(groups * 4),
        "batch_rows": float(groups * 4),
    }


def feed(watcher: SignalWatcher, steps: range, metrics: dict[str, float]) -> list[list[str]]:
    return [[s.condition for s in watcher.observe(step, metrics)] for step in steps]


def test_zero_variance_warns_once_after_the_window_with_the_figures() -> None:
    watcher = SignalWatcher(10)
    warned = []
    for step in range(41, 56):
        warned.append((step, watcher.observe(step, flat())))
    fired = [(step, stalls) for step, stalls in warned if stalls]
    assert [step for step, _ in fired] == [50]
    (stall,) = fired[0][1]
    assert stall.condition == "zero_variance" and (stall.first_step, stall.last_step) == (41, 50)
    assert "zero reward variance in 160 of 160 GRPO groups (100%)" in stall.message
    assert "the last 10 steps (steps 41-50)" in stall.message and "reward_mean 0.500" in stall.message
    assert "sampling.temperature" in stall.message and "ppo.entropy_coeff" in stall.message
    assert watcher.stalled() == ["zero_variance"]
    assert watcher.metrics()["stalled_zero_variance"] == 1.0
    assert watcher.metrics()["stalled_equal_rewards"] == 0.0


def test_a_condition_that_clears_counts_again_and_warns_again() -> None:
    watcher = SignalWatcher(3)
    assert feed(watcher, range(1, 5), flat()) == [[], [], ["zero_variance"], []]
    assert feed(watcher, range(5, 6), flat(zero_variance=2)) == [[]]
    assert watcher.metrics()["stalled_zero_variance"] == 0.0
    assert feed(watcher, range(6, 9), flat()) == [[], [], ["zero_variance"]]


def test_a_share_of_flat_groups_below_the_threshold_does_not_warn() -> None:
    watcher = SignalWatcher(2)
    assert feed(watcher, range(1, 6), flat(zero_variance=14)) == [[]] * 5  # 14/16 < 0.9
    assert feed(SignalWatcher(2, zero_variance_fraction=0.8), range(1, 3), flat(zero_variance=14)) == [
        [],
        ["zero_variance"],
    ]


def test_equal_rewards_needs_more_than_one_rollout() -> None:
    watcher = SignalWatcher(2)
    assert feed(watcher, range(1, 3), flat(reward_std=0.0)) == [[], ["zero_variance", "equal_rewards"]]
    message = SignalWatcher(1).observe(7, flat(reward_std=0.0))[1].message
    assert "every rollout of each step earned the same reward (reward_std 0, 64 rollouts)" in message
    single = {"reward_std": 0.0, "rollouts": 1.0, "reward_mean": 1.0}
    assert feed(SignalWatcher(1), range(1, 3), single) == [[], []]


def test_max_tokens_only_when_the_metrics_carry_it() -> None:
    cut = {"truncated_responses": 0.95, "batch_rows": 20.0}
    (stall,) = SignalWatcher(1).observe(3, cut)
    assert stall.condition == "max_tokens"
    assert "19 of 20 responses (95%) stopped at sampling.max_tokens" in stall.message
    assert "raise sampling.max_tokens" in stall.message
    assert feed(SignalWatcher(1), range(1, 2), {"truncated_responses": 0.5, "batch_rows": 20.0}) == [[]]
    assert feed(SignalWatcher(1), range(1, 2), {"batch_rows": 20.0}) == [[]]


def test_all_stale_when_every_call_was_dropped_as_stale() -> None:
    watcher = SignalWatcher(2)
    stale = {"drop_stale_policy": 12.0, "batch_rows": 0.0}
    assert feed(watcher, range(1, 3), stale) == [[], ["all_stale"]]
    assert feed(SignalWatcher(1), range(1, 2), {"drop_stale_policy": 12.0, "batch_rows": 3.0}) == [[]]
    (stall,) = SignalWatcher(1).observe(4, stale)
    assert "every call was dropped as stale (12 calls" in stall.message
    assert "experiment.max_staleness" in stall.message


def test_window_0_turns_the_watch_off() -> None:
    watcher = SignalWatcher(0)
    assert feed(watcher, range(1, 4), flat(reward_std=0.0)) == [[], [], []]
    assert watcher.metrics() == {} and watcher.stalled() == []


def test_trainer_status_names_the_conditions_of_the_last_step() -> None:
    metrics = {
        "reward_mean": 0.5,
        "stalled_zero_variance": 1.0,
        "stalled_all_stale": 0.0,
        "stall_window": 10.0,
    }
    status = TrainerStatus(
        groups=[GroupCounts(RolloutMode.TRAIN, consumed=16)],
        drops={},
        batches=50,
        rows=640,
        policy_version=50,
        last_event=TrainingEvent(1, "run", 50, 50, metrics, 0.0),
    )
    assert "no learning signal: zero_variance (for the last 10 steps or more)" in status_text(status)
    status.last_event = TrainingEvent(1, "run", 50, 50, {"stalled_zero_variance": 0.0}, 0.0)
    assert "no learning signal" not in status_text(status)
    status.last_event = None
    assert "no learning signal" not in status_text(status)


def test_a_response_is_cut_when_it_reaches_max_tokens_without_its_stop_token() -> None:
    eos = 2
    responses = [[5, eos, 0], [5, 6, 0], [7, 0, 0], [5, 6, 7]]  # right-padded rows
    lengths = [2, 2, 1, 3]
    # max_tokens 2: row 0 ended with its stop token at the limit (whole), row 1 was cut, row 2 is short,
    # row 3 is past the limit without a stop token
    assert truncated_share(lengths, responses, 2, frozenset({eos})) == 0.5
    assert truncated_share([], [], 2, frozenset({eos})) == 0.0


def test_a_condition_left_out_is_neither_watched_nor_recorded() -> None:
    """A task that cuts its answers at max_tokens on purpose (the demo's lock) leaves that condition out."""
    watcher = SignalWatcher(2, conditions=["zero_variance"])
    cut = {"truncated_responses": 1.0, "zero_variance_groups": 0.0, "groups": 4.0, "reward_std": 0.4}
    assert watcher.observe(1, cut) == [] and watcher.observe(2, cut) == []
    assert watcher.stalled() == [] and watcher.metrics() == {
        "stall_window": 2.0,
        "stalled_zero_variance": 0.0,
    }
