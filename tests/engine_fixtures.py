"""Fixtures shared by the tests that need a real model: the tiny local model, the engine serving it in
its own process (one per test session), its tokenizer, and a guard that keeps every connection on
the loopback interface."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc.engine import EngineProcess
from lightning_grpc.proxy import Backend

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "lightning_grpc.cli.main"]
MODEL = "policy"
#: Keep the engine and the CLI processes polite on a shared machine.
QUIET_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")},
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def loopback_guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every socket this process connects must stay on the loopback interface."""
    outside: list[Any] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                loopback = ipaddress.ip_address(address[0]).is_loopback
            except ValueError:
                loopback = address[0] == "localhost"
            if not loopback:
                outside.append(address)
                raise OSError(f"test tried to reach {address} (only loopback is allowed)")

    def connect(sock: socket.socket, address: Any) -> None:
        check(sock, address)
        real_connect(sock, address)

    def connect_ex(sock: socket.socket, address: Any) -> int:
        check(sock, address)
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield outside
    assert not outside, f"connections outside the loopback interface: {outside}"


@dataclass
class Engine:
    api_base: str
    model_path: Path
    served_model: str
    process: EngineProcess

    def backend(self, model_name: str = MODEL, **kw: Any) -> Backend:
        return Backend(model_name=model_name, api_base=self.api_base, backend_model=self.served_model, **kw)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model") / "model"
    done = subprocess.run(
        [*CLI, "init-model", str(path)], cwd=ROOT, env=QUIET_ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return path


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Iterator[Engine]:
    """``lightning-grpc engine`` in its own process, serving the tiny model."""
    process = EngineProcess(
        tiny_model, served_model_name="tiny", extra_args=["--threads", "1"], env=QUIET_ENV
    )
    with process:
        yield Engine(process.base_url, tiny_model, "tiny", process)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))
