"""The learner computes each row's log-probs at the temperature its calls were sampled at (the batch's
``temperatures``, recorded per call by the proxy), with the tiny model; and the run's mismatch metric and
warning when those temperatures are not ``sampling.temperature``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_grpc.training import ppo
from lightning_grpc.training.learner import Learner, OptimConfig, UpdateInput, row_temperatures
from lightning_grpc.training.sampling import TemperatureCheck, mismatch_warning, temperature_mismatch

PROMPT, RESPONSE = 4, 3


def batch(temperatures: list[float] | None, seed: int = 0) -> dict[str, np.ndarray]:
    """Two rows (two rollouts of one group), left-padded prompts and right-padded responses, as the
    TrainerService pads them; ``temperatures`` None: a batch without the array."""
    rng = np.random.default_rng(seed)
    rows, width = 2, PROMPT + RESPONSE
    a: dict[str, np.ndarray] = {
        name: np.zeros((rows, width), np.int64) for name in ("input_ids", "attention_mask", "position_ids")
    }
    a["responses"] = np.zeros((rows, RESPONSE), np.int64)
    a["response_mask"] = np.zeros((rows, RESPONSE), np.int64)
    for i, (p, r) in enumerate([(PROMPT, RESPONSE), (2, 2)]):
        prompt, response = rng.integers(1, 1000, p), rng.integers(1, 1000, r)
        a["input_ids"][i, PROMPT - p : PROMPT] = prompt
        a["input_ids"][i, PROMPT : PROMPT + r] = response
        a["attention_mask"][i, PROMPT - p : PROMPT + r] = 1
        a["position_ids"][i] = np.clip(np.cumsum(a["attention_mask"][i]) - 1, 0, None)
        a["responses"][i, :r] = response
        a["response_mask"][i, :r] = 1
    a["rollout_index"] = np.arange(rows, dtype=np.int64)
    a["rollout_rewards"] = np.array([0.0, 1.0], np.float32)
    a["has_rollout_log_probs"] = np.zeros(rows, np.bool_)
    if temperatures is not None:
        a["temperatures"] = np.array(temperatures, np.float32)
    return a


def direct_log_probs(learner: Learner, arrays: dict[str, np.ndarray], temperature: float) -> torch.Tensor:
    """The responses' log-probs straight from the model's whole logits: log_softmax(logits / temperature)."""
    with torch.no_grad():
        logits = learner.model(
            input_ids=torch.as_tensor(arrays["input_ids"]),
            attention_mask=torch.as_tensor(arrays["attention_mask"]),
            position_ids=torch.as_tensor(arrays["position_ids"]),
        ).logits[:, PROMPT - 1 : PROMPT + RESPONSE - 1]
    scaled = torch.log_softmax(logits.float() / temperature, dim=-1)
    return scaled.gather(-1, torch.as_tensor(arrays["responses"]).unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def learner(tiny_model: Path) -> Learner:
    return Learner(tiny_model, optim=OptimConfig(temperature=1.0), device="cpu")


def test_a_row_sampled_at_07_gets_the_log_probs_of_logits_over_07(learner: Learner) -> None:
    arrays = batch([0.7, 1.0])
    mask = torch.as_tensor(arrays["response_mask"]).bool()
    with torch.no_grad():
        got, entropy = learner._log_probs(learner.model, learner._tensors(arrays), with_entropy=True)
    at_07, at_1 = direct_log_probs(learner, arrays, 0.7), direct_log_probs(learner, arrays, 1.0)
    torch.testing.assert_close(got[0][mask[0]], at_07[0][mask[0]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1][mask[1]], at_1[1][mask[1]], rtol=1e-5, atol=1e-6)
    assert float((at_07[0] - at_1[0])[mask[0]].abs().min()) > 1e-3  # 0.7 is not 1.0
    # the entropy too is the sampled distribution's
    assert entropy is not None
    with torch.no_grad():
        whole = learner.model(
            input_ids=torch.as_tensor(arrays["input_ids"]),
            attention_mask=torch.as_tensor(arrays["attention_mask"]),
            position_ids=torch.as_tensor(arrays["position_ids"]),
        ).logits[0, PROMPT - 1 : PROMPT + RESPONSE - 1]
    torch.testing.assert_close(entropy[0], ppo.entropy_from_logits(whole / 0.7), rtol=1e-5, atol=1e-5)
    # without the array: the configured temperature, as before
    with torch.no_grad():
        old, _ = learner._log_probs(learner.model, learner._tensors(batch(None)), with_entropy=False)
    torch.testing.assert_close(old[0][mask[0]], at_1[0][mask[0]], rtol=1e-5, atol=1e-6)


def test_an_update_compares_the_recorded_log_probs_at_each_rows_temperature(tiny_model: Path) -> None:
    """The proxy's log-probs of a row sampled at 0.7 agree with the learner's only at 0.7 (log_prob_gap)."""
    gaps = {}
    for name, temperatures in (("recorded", [0.7, 0.7]), ("absent", None)):
        fresh = Learner(tiny_model, optim=OptimConfig(temperature=1.0, lr=1e-3), device="cpu")
        arrays = batch(temperatures)
        arrays["rollout_log_probs"] = (
            direct_log_probs(fresh, arrays, 0.7).numpy() * arrays["response_mask"]
        ).astype(np.float32)
        arrays["has_rollout_log_probs"][:] = True
        metrics = fresh.update(UpdateInput(arrays, np.array(["g", "g"], dtype=object)))
        gaps[name] = metrics["log_prob_gap_mean"]
        assert math.isfinite(metrics["loss"])
    assert gaps["recorded"] < 1e-5 < 1e-2 < gaps["absent"], gaps


def test_greedy_and_unusable_recorded_temperatures_keep_the_configured_one() -> None:
    got = row_temperatures(np.array([0.7, 0.0, np.nan, -1.0, 1.3], np.float32), 0.9)
    torch.testing.assert_close(got, torch.tensor([0.7, 0.9, 0.9, 0.9, 1.3]))


def test_per_row_temperatures_equal_one_temperature_per_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    tokens = torch.randint(0, 11, (3, 5))
    per_row = ppo.token_log_probs(logits, tokens, torch.tensor([0.7, 1.0, 2.5]))
    for row, temperature in enumerate((0.7, 1.0, 2.5)):
        torch.testing.assert_close(per_row[row], ppo.token_log_probs(logits[row], tokens[row], temperature))
        torch.testing.assert_close(
            ppo.scale_logits(logits, torch.tensor([0.7, 1.0, 2.5]))[row], logits[row] / temperature
        )
    with pytest.raises(ValueError, match="one per row"):
        ppo.token_log_probs(logits, tokens, torch.tensor([0.7, 1.0]))
    with pytest.raises(ValueError, match="> 0 on every row"):
        ppo.token_log_probs(logits, tokens, torch.tensor([0.7, 0.0, 1.0]))


# ------------------------------------------------------------ the mismatch metric and warning
def test_the_mismatch_metric_counts_rows_sampled_at_another_temperature() -> None:
    arrays = {"temperatures": np.array([0.7, 1.0, 0.7, 0.0], np.float32)}
    assert temperature_mismatch(arrays, 1.0) == {
        "temperature_mismatch_rows": 3.0,
        "temperature_greedy_rows": 1.0,
        "temperature_distinct": 3.0,
        "temperature_min": 0.0,
        "temperature_max": pytest.approx(1.0),
    }
    assert temperature_mismatch(arrays, 0.7)["temperature_mismatch_rows"] == 2.0  # float32 0.7 is 0.7
    assert temperature_mismatch({"temperatures": np.zeros(0, np.float32)}, 1.0) == {}
    assert temperature_mismatch({}, 1.0) == {}  # a batch from a server before the array


def test_the_mismatch_warning_is_given_once_per_run_and_names_both_temperatures() -> None:
    said: list[str] = []
    check = TemperatureCheck(1.0, said.append)
    assert check({"temperatures": np.ones(2, np.float32)})["temperature_mismatch_rows"] == 0.0
    assert said == []
    check({"temperatures": np.array([0.7, 1.0], np.float32)})
    check({"temperatures": np.array([0.5, 0.5], np.float32)})
    [line] = said
    assert line.startswith("warning: 1 of 2 rows were sampled at temperature 0.7 ")
    assert "not at sampling.temperature = 1" in line
    assert "the learner computes each row's log-probs at the temperature recorded for its calls" in line
    verl = mismatch_warning({"temperatures": np.array([0.7], np.float32)}, 1.0, learner_uses_recorded=False)
    assert "the verl backend computes every row's log-probs at sampling.temperature" in verl
