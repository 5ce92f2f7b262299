"""Real vLLM for the tests of this folder (`make vllm-test`): one vLLM server per session, started the way a
training run starts it (:class:`lightning_grpc.training.engines.VllmEngine`: a child process bound to a
Unix socket in a private directory, its inference on loopback TCP through the gate), serving the tiny model
built 128 wide (vLLM's CPU attention refuses the default head size of 16).

vLLM lives in its own environment (`make vllm-env` builds `.venv-vllm`); `make vllm-test` names its interpreter
in `$LIGHTNING_GRPC_VLLM_PYTHON`. Without that variable (as under `make test`) every test here is skipped,
saying so. Nothing is mocked.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from lightning_grpc import environment
from lightning_grpc.proxy import Backend, LLMProxy, ProxyConfig
from lightning_grpc.server.app import RunningServer
from lightning_grpc.training.engines import DEFAULT_VLLM_VENV, VllmEngine
from tests.engine_fixtures import CLI, QUIET_ENV, ROOT, loopback_guard

MODEL = "policy"
SERVED = "tiny-vllm"
MAX_MODEL_LEN = 512


def vllm_interpreter() -> tuple[str, str]:
    """(the interpreter that has vLLM, "") or ("", why the tests are skipped)."""
    python = os.environ.get(environment.VLLM_PYTHON, "")
    if not python:  # `make test` stays as it is: these run under `make vllm-test`, which names vLLM's Python
        return "", (
            f"vLLM's tests run under `make vllm-test` (it sets ${environment.VLLM_PYTHON} to "
            f"{DEFAULT_VLLM_VENV / 'bin' / 'python'}, built by `make vllm-env`)"
        )
    if not Path(python).exists():
        return "", (
            f"no vLLM environment ({python} is missing): `make vllm-env` builds .venv-vllm and "
            f"`make vllm-test` runs these tests (or set ${environment.VLLM_PYTHON})"
        )
    found = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=60,
    )
    if found.returncode != 0:
        return "", f"{python} has no vllm: `make vllm-env` builds .venv-vllm with it"
    return python, ""


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    yield from loopback_guard(monkeypatch)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python, why = vllm_interpreter()
    if not python:
        pytest.skip(why)
    return python


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, 128 wide (4 heads of 32)."""
    path = tmp_path_factory.mktemp("vllm-model") / "model"
    done = subprocess.run(
        [*CLI, "init-model", str(path), "--hidden-size", "128"],
        cwd=ROOT,
        env=QUIET_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return path


@pytest.fixture(scope="session")
def vllm(vllm_python: str, wide_model: Path) -> Iterator[VllmEngine]:
    """vLLM serving the wide tiny model, as policy version 0 (tests that change it put it back)."""
    engine = VllmEngine(served_name=SERVED, python=vllm_python, max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.5)
    engine.start(wide_model, 0)
    print(f"\nvLLM served after {engine.start_seconds:.1f}s at {engine.url} (socket {engine.socket_path})")
    try:
        yield engine
    finally:
        engine.stop()


def vllm_backend(engine: VllmEngine, policy_version: int = 0) -> Backend:
    return Backend(
        model_name=MODEL, api_base=f"{engine.url}/v1", backend_model=SERVED, policy_version=policy_version
    )


@pytest_asyncio.fixture
async def proxy(store_server: RunningServer, vllm: VllmEngine) -> AsyncIterator[LLMProxy]:
    """The proxy with vLLM as its one backend, in vLLM's dialect, recording into a real Store."""
    version = await vllm.reported_version()
    config = ProxyConfig(store=f"127.0.0.1:{store_server.port}", backends=[vllm_backend(vllm, version)])
    running = await LLMProxy(config).start()
    try:
        yield running
    finally:
        await running.stop(5)
