"""The one-process learner on CUDA computes the update it computes on CPU.

A GPU user's :class:`Learner` runs on ``"cuda"`` by default, so these tests check that place against the
CPU reference: the same model, seed and batches give the same metrics and the same weights after several
PPO updates (two epochs of mini-batches, so the ratios move and clip; rows sampled at different
temperatures; the entropy bonus and the KL loss against the reference), a checkpoint written on the GPU
loads and resumes on a CPU, and the model really sits on the GPU while it is updated. Skipped where no
CUDA device is present (CI); the GPU machine runs them as
``python3 -m pytest --noconftest -p no:cacheprovider -q -rs -s tests/training/test_learner_cuda.py``.

It imports only the learner, its losses and the tiny-model builder (no gRPC, OpenTelemetry or store), so
it runs without ``tests/conftest.py``.

Tolerances: both learners compute in float32 (the learner loads the model as float32 and keeps
``torch.backends.cuda.matmul.allow_tf32`` as torch leaves it, off: checked below, since TF32 would round
matmul inputs to 10 mantissa bits, about 1e-3 relative, and fail these bounds). What differs between the
two places is the order of float32 sums (cuBLAS and the CUDA reductions against the CPU kernels), a
relative error of a few float32 epsilons (1.2e-7) per operation, grown over a dozen optimiser steps.
Metrics are held to 1e-4 relative (2e-4 for the gradient norm, a sum of squares over every parameter)
with a 1e-5 absolute floor for values near zero; on CPU, float32 against float64 differ by at most 2e-5.
Weights: Adam divides each gradient by its own running size, so an entry whose gradient is at rounding
level (the key projection's bias, whose gradient is zero in exact arithmetic) takes steps whose size and
sign are rounding noise, up to a fraction of ``lr`` each (float32 against float64 on CPU: up to 1.3e-5
after the updates here, on a handful of entries, while the mean difference is 1e-8). So each weight is
held to ``lr / 10`` (1e-4), and the whole difference to 1e-3 of how far the weights moved, in norm
(float32 against float64: 1e-5), which catches any error of the update itself.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_grpc.training import ppo
from lightning_grpc.training.learner import STATE_FILE, Learner, OptimConfig, UpdateInput

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the learner's GPU place); CI has none"
)

METRIC_RTOL = 1e-4
GRAD_NORM_RTOL = 2e-4
METRIC_ATOL = 1e-5
WEIGHT_ATOL = 1e-4
WEIGHT_RTOL_NORM = 1e-3
UPDATES = 3

#: Two epochs of mini-batches of 4 rollouts, a tight clip range and a learning rate at which the second
#: epoch's ratios leave it: the ratio, clipping and dual-clip paths all run.
OPTIM = OptimConfig(lr=1e-3, ppo_epochs=2, mini_batch_rollouts=4, temperature=1.0)
CLIPPED = ppo.PPOConfig(clip_ratio_low=0.02, clip_ratio_high=0.03)
SETUPS = {
    "plain": CLIPPED,
    "entropy_and_kl": dataclasses.replace(
        CLIPPED, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl"
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_grpc.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def make_batch(
    seed: int, groups: int = 3, group_size: int = 4, prompt: int = 6, response: int = 6
) -> UpdateInput:
    """Rollouts of one or two rows (left-padded prompts, right-padded responses, as the TrainerService
    pads them), groups with mixed rewards, each row sampled at 0.7, 1.0 or 1.3 (and one greedy row,
    computed at the configured temperature), the proxy's log-probs recorded on two rows in three."""
    rng = np.random.default_rng(seed)
    layout = []  # (group, rollout, reward, prompt length, response length)
    rollout = 0
    for group in range(groups):
        rewards = rng.permutation([0.0, 1.0] + [float(rng.integers(0, 3)) / 2 for _ in range(group_size - 2)])
        for member in range(group_size):
            for _ in range(1 + (rollout % 3 == 1)):
                layout.append(
                    (
                        group,
                        rollout,
                        rewards[member],
                        int(rng.integers(2, prompt + 1)),
                        int(rng.integers(1, response + 1)),
                    )
                )
            rollout += 1
    rows, width = len(layout), prompt + response
    arrays: dict[str, np.ndarray] = {
        name: np.zeros((rows, width), np.int64) for name in ("input_ids", "attention_mask", "position_ids")
    }
    arrays["responses"] = np.zeros((rows, response), np.int64)
    arrays["response_mask"] = np.zeros((rows, response), np.int64)
    arrays["rollout_log_probs"] = np.zeros((rows, response), np.float32)
    arrays["has_rollout_log_probs"] = np.zeros(rows, np.bool_)
    arrays["rollout_index"] = np.zeros(rows, np.int64)
    arrays["rollout_rewards"] = np.zeros(rows, np.float32)
    uid = np.empty(rows, dtype=object)
    for i, (group, index, reward, p, r) in enumerate(layout):
        prompt_ids, response_ids = rng.integers(5, 2000, p), rng.integers(5, 2000, r)
        arrays["input_ids"][i, prompt - p : prompt] = prompt_ids
        arrays["input_ids"][i, prompt : prompt + r] = response_ids
        arrays["attention_mask"][i, prompt - p : prompt + r] = 1
        arrays["position_ids"][i] = np.clip(np.cumsum(arrays["attention_mask"][i]) - 1, 0, None)
        arrays["responses"][i, :r] = response_ids
        arrays["response_mask"][i, :r] = 1
        arrays["rollout_index"][i] = index
        arrays["rollout_rewards"][i] = reward
        if i % 3:
            arrays["has_rollout_log_probs"][i] = True
            arrays["rollout_log_probs"][i, :r] = -7.6 + rng.normal(0, 0.1, r)
        uid[i] = f"g{group}"
    arrays["temperatures"] = rng.choice(np.array([0.7, 1.0, 1.3], np.float32), rows)
    arrays["temperatures"][-1] = 0.0
    return UpdateInput(arrays, uid)


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: value.detach().to("cpu", copy=True) for name, value in learner.model.state_dict().items()}


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def weight_gap(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """The largest difference of one weight, and the norm of the difference over the norm of ``a - start``."""
    assert a.keys() == b.keys() == start.keys()
    gap = sum(float((a[name] - b[name]).double().square().sum()) for name in a) ** 0.5
    moved = sum(float((a[name] - start[name]).double().square().sum()) for name in a) ** 0.5
    assert moved > 0, "the update did not change the weights"
    return max_weight_difference(a, b), gap / moved


def compare_metrics(reference: dict[str, float], other: dict[str, float]) -> tuple[float, str]:
    """Asserts ``other`` matches ``reference`` metric by metric; returns the largest share of its bound that
    a metric's difference takes (``max(rtol * |value|, METRIC_ATOL)``) and a line naming that metric."""
    names = [name for name in reference if not name.endswith("_seconds")]
    assert set(names) <= set(other), set(names) - set(other)
    worst, line = -1.0, ""
    for name in names:
        rtol = GRAD_NORM_RTOL if name == "grad_norm" else METRIC_RTOL
        want, got = reference[name], other[name]
        assert got == pytest.approx(want, rel=rtol, abs=METRIC_ATOL), (name, want, got)
        share = abs(got - want) / max(rtol * abs(want), METRIC_ATOL)
        if share > worst:
            worst = share
            line = f"{name} {want:.6g} vs {got:.6g} (diff {abs(got - want):.1e}, {share:.0%} of its bound)"
    return worst, line


def record_devices(learner: Learner) -> list[tuple[str, str]]:
    """(the input ids' device, the parameters' device) of every forward pass of the learner's model."""
    seen: list[tuple[str, str]] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append((str(kwargs["input_ids"].device), str(next(module.parameters()).device)))

    learner.model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def timed_update(learner: Learner, batch: UpdateInput) -> tuple[dict[str, float], float]:
    if learner.device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    metrics = learner.update(batch)
    if learner.device == "cuda":
        torch.cuda.synchronize()
    return metrics, time.perf_counter() - started


def test_tf32_stays_off_for_the_learner(model_dir: Path) -> None:
    """The learner leaves float32 matmuls at full precision on the GPU (torch's default): TF32 would change
    the update by about 1e-3 relative against the CPU's."""
    learner = Learner(model_dir, device="cuda")
    learner.update(make_batch(0))
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    print(
        f"\n[cuda learner] device={torch.cuda.get_device_name(0)} torch={torch.__version__} "
        f"cuda={torch.version.cuda} allow_tf32={torch.backends.cuda.matmul.allow_tf32} "
        f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32} "
        f"float32_matmul_precision={torch.get_float32_matmul_precision()}"
    )


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_the_cuda_update_equals_the_cpu_update(model_dir: Path, setup: str) -> None:
    config = SETUPS[setup]
    cpu = Learner(model_dir, ppo_config=config, optim=OPTIM, device="cpu", seed=0)
    cuda = Learner(model_dir, ppo_config=config, optim=OPTIM, device="cuda", seed=0)
    start = weights(cpu)
    assert max_weight_difference(start, weights(cuda)) == 0.0  # the same starting model on both
    assert {p.device.type for p in cuda.model.parameters()} == {"cuda"}
    if cuda.reference is not None:
        assert {p.device.type for p in cuda.reference.parameters()} == {"cuda"}
    seen = record_devices(cuda)

    closest, clipped, timings = (-1.0, ""), 0.0, []
    for step in range(UPDATES):
        batch = make_batch(step)
        on_cpu, cpu_seconds = timed_update(cpu, batch)
        on_cuda, cuda_seconds = timed_update(cuda, batch)
        timings.append((cpu_seconds, cuda_seconds))
        closest = max(closest, compare_metrics(on_cpu, on_cuda))
        clipped = max(clipped, on_cpu["pg_clipfrac"])
        if config.entropy_coeff:
            assert "entropy_loss" in on_cuda and "kl_loss" in on_cuda and "kl" in on_cuda
    assert clipped > 0, "no token was clipped: the ratio path was not exercised"
    assert seen and all(where == ("cuda:0", "cuda:0") for where in seen), seen

    after_cpu, after_cuda = weights(cpu), weights(cuda)
    moved = max_weight_difference(start, after_cpu)
    gap, relative = weight_gap(after_cpu, after_cuda, start)
    assert moved > 10 * WEIGHT_ATOL, moved  # the updates changed the weights well beyond the tolerance
    assert gap <= WEIGHT_ATOL and relative <= WEIGHT_RTOL_NORM, (gap, relative, moved)
    print(
        f"\n[cuda learner] {setup}: {UPDATES} updates, {len(seen)} forward passes on cuda; "
        f"metric closest to its bound: {closest[1]}; max weight diff {gap:.2e} "
        f"(tol {WEIGHT_ATOL:g}; weights moved up to {moved:.2e}); weight diff / movement in norm "
        f"{relative:.2e} (tol {WEIGHT_RTOL_NORM:g}); max pg_clipfrac {clipped:.3f}; "
        "seconds per update cpu/cuda: " + ", ".join(f"{c:.3f}/{g:.3f}" for c, g in timings)
    )


def test_a_cuda_checkpoint_loads_and_resumes_on_cpu(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = SETUPS["entropy_and_kl"]
    cuda = Learner(model_dir, ppo_config=config, optim=OPTIM, device="cuda", seed=0)
    for step in range(UPDATES):
        cuda.update(make_batch(step))

    exported = load_file(str(cuda.export_weights(tmp_path / "export") / "model.safetensors"), device="cpu")
    saved = cuda.save_checkpoint(tmp_path / "checkpoint", extra={"epoch": 1})
    on_file = load_file(str(saved / "model.safetensors"), device="cpu")
    current = weights(cuda)
    for name, value in on_file.items():
        assert value.device.type == "cpu" and value.dtype == torch.float32
        assert torch.equal(value, exported[name])
        assert torch.equal(value, current[name]), name
    locations: set[str] = set()

    def to_cpu(storage: Any, location: str) -> Any:
        locations.add(location)
        return storage

    # The optimiser's and the reference's tensors are saved where they lived (cuda:0): a CPU machine reads
    # the state through a map_location, as Learner.resume does.
    state = torch.load(saved / STATE_FILE, map_location=to_cpu, weights_only=False)
    assert state["step"] == UPDATES and state["extra"] == {"epoch": 1}
    assert state["reference"] is not None

    resumed, extra = Learner.resume(saved, ppo_config=config, optim=OPTIM, device="cpu", seed=0)
    assert extra == {"epoch": 1} and resumed.step == UPDATES
    assert {p.device.type for p in resumed.model.parameters()} == {"cpu"}
    assert max_weight_difference(weights(resumed), current) == 0.0
    optimiser_cpu = resumed.optimizer.state_dict()["state"]
    optimiser_cuda = cuda.optimizer.state_dict()["state"]
    assert optimiser_cpu.keys() == optimiser_cuda.keys()
    for index, values in optimiser_cuda.items():
        for key, value in values.items():
            assert torch.equal(optimiser_cpu[index][key].cpu(), value.cpu()), (index, key)
    assert cuda.reference is not None and resumed.reference is not None
    reference_cuda = {name: value.cpu() for name, value in cuda.reference.state_dict().items()}
    assert max_weight_difference(resumed.reference.state_dict(), reference_cuda) == 0.0

    batch = make_batch(UPDATES)
    next_cpu = resumed.update(batch)
    next_cuda = cuda.update(batch)
    _, closest = compare_metrics(next_cuda, next_cpu)
    gap, relative = weight_gap(weights(cuda), weights(resumed), current)
    assert gap <= WEIGHT_ATOL and relative <= WEIGHT_RTOL_NORM, (gap, relative)
    print(
        f"\n[cuda learner] checkpoint written on cuda (storages saved at {sorted(locations)}), resumed on cpu: "
        f"next update's metric closest to its bound: {closest}; max weight diff {gap:.2e}, "
        f"weight diff / movement in norm {relative:.2e}"
    )
