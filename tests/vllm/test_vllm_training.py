"""`lightning-grpc train` with ``[engine] kind = "vllm"`` (examples/combination_lock/vllm.toml), end to end:
the run starts vLLM as its child, the agents' calls go through the proxy to it, the learner updates, and
every update's weights reach vLLM (the learner's log-probs of the tokens vLLM sampled then equal vLLM's)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from lightning_grpc.processes import model_child_env
from lightning_grpc.training.engines import (
    VLLM_WORKER_EXTENSION_CLS,
    EngineError,
    VllmEngine,
)
from tests.engine_fixtures import CLI, QUIET_ENV, ROOT

from .helpers import train_command, train_env

pytestmark = pytest.mark.timeout(900)


def train_vllm_example(vllm_python: str, tmp_path: Path, settings: dict[str, str]) -> list[dict[str, str]]:
    """:func:`train_command` run to its end; the rows of its metrics.csv."""
    done = subprocess.run(
        train_command(tmp_path, settings),
        cwd=ROOT,
        env=train_env(vllm_python),
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_training_with_vllm_serving_the_policy(vllm_python: str, tmp_path: Path, mode: str) -> None:
    settings = {
        "experiment.steps": "3",
        "experiment.mode": mode,
        **({"experiment.async_groups": "32"} if mode == "async" else {}),
    }
    rows = train_vllm_example(vllm_python, tmp_path, settings)
    assert [int(float(r["policy_version"])) for r in rows] == [1, 2, 3]
    for row in rows:
        assert float(row["batch_rows"]) > 0
        # the tokens were sampled by vLLM, their log-probs recorded by the proxy from vLLM's answer; the
        # learner's own log-probs of them agree: vLLM served the learner's weights at every step
        if mode == "sync":  # async batches may hold calls one version old, whose log-probs differ by design
            assert float(row["log_prob_gap_max"]) < 1e-4, row
        assert float(row["weight_sync_seconds"]) < 10
    print(
        f"\n{mode}: "
        + "; ".join(
            f"step {r['step']}: {float(r['step_seconds']):.2f}s (generation {float(r['generation_seconds']):.2f}, "
            f"update {float(r['update_seconds']):.2f}, weight sync {float(r['weight_sync_seconds']):.3f})"
            for r in rows
        )
    )


def test_the_reward_rises_with_vllm_serving_and_two_fsdp_ranks_learning(
    vllm_python: str, tmp_path: Path
) -> None:
    """30 sync steps of examples/combination_lock/vllm.toml as it is (vLLM, 2 FSDP ranks placed by Ray): the
    reward rises (measured at seed 1: 0.24 over the first 3 steps, 0.40 over the last 5; 128 rollouts a step). The
    whole demo opens the lock in about 105 steps: see docs/real-engines.md."""
    settings = {
        "experiment.steps": "30",
        # sync runs are reproducible; seed 0 now draws its tasks in another order and learns later
        "experiment.seed": "1",
    }
    rows = train_vllm_example(vllm_python, tmp_path, settings)
    rewards = [float(r["reward_mean"]) for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    print(f"\nvLLM + 2 ranks: reward_mean first 3 steps {first:.3f} -> last 5 steps {last:.3f}")
    assert last >= first + 0.15, rewards
    assert all("update_rank1_seconds" in r for r in rows)  # the second rank took part in every update


class UserVllm:
    """vLLM as a user serves it themselves: its own OpenAI server on a loopback TCP port, started from
    vLLM's environment (not by the run), in a process group of its own that :meth:`stop` ends."""

    def __init__(self, python: str, model: Path, *, extension_dir: Path | None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # vLLM's sockets between its own processes, in a directory of this test's (short: a socket's path is
        # limited to 107 bytes), removed by stop(); vLLM's default, /tmp, keeps those of a killed vLLM for good
        self.sockets = Path(tempfile.mkdtemp(prefix="vllm-ipc-"))
        env = {
            **QUIET_ENV,
            **model_child_env(1),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_RPC_BASE_PATH": str(self.sockets),
            **({"PYTHONPATH": str(extension_dir)} if extension_dir else {}),
        }
        command = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048",
            *(["--worker-extension-cls", VLLM_WORKER_EXTENSION_CLS] if extension_dir else []),
        ]  # fmt: skip
        self.log = (model.parent / f"vllm-{self.port}.log").open("w")
        self.proc = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError("vLLM did not serve within 600 s")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.sockets, ignore_errors=True)


def test_training_against_a_vllm_the_user_serves_named_by_address(vllm_python: str, tmp_path: Path) -> None:
    """``services.engine`` names a vLLM the user started: without this project's worker extension the run
    refuses it (the tiny model ties its embeddings: vLLM-CPU would sample from a stale head after each
    reload); started as the refusal says, the run trains through it, and vLLM's log-probs of what it sampled
    equal the learner's at every step (the head followed the weights)."""
    model = tmp_path / "model"
    done = subprocess.run(
        [*CLI, "init-model", str(model), "--hidden-size", "128"],
        env=QUIET_ENV,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    bare = UserVllm(vllm_python, model, extension_dir=None)
    try:
        with pytest.raises(
            EngineError, match=r"lacks lightning-grpc's worker extension.*--worker-extension-cls"
        ):
            VllmEngine(url=bare.url, served_name="policy").start(model, 0)
    finally:
        bare.stop()
    extension = tmp_path / "extension"
    written = subprocess.run(
        [*CLI[:1], "-m", "lightning_grpc.training.engines", "extension", str(extension)],
        env=QUIET_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert written.returncode == 0 and VLLM_WORKER_EXTENSION_CLS in written.stdout, written.stderr
    served = UserVllm(vllm_python, model, extension_dir=extension)
    try:
        settings = {
            "experiment.steps": "3",
            "services.engine": f"{served.url}/v1",
            "learner.ranks": "1",
        }
        rows = train_vllm_example(vllm_python, tmp_path, settings)
        assert [int(float(r["policy_version"])) for r in rows] == [1, 2, 3]
        for row in rows:
            assert float(row["batch_rows"]) > 0
            assert float(row["log_prob_gap_max"]) < 1e-4, row
        with urllib.request.urlopen(f"{served.url}/weight_info", timeout=10) as resp:
            assert json.loads(resp.read())["weight_version"] == "3"  # the version the run set last
    finally:
        served.stop()
