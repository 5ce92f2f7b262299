"""Shared fixtures: a real gRPC server on 127.0.0.1 (port 0) over each backend, and clients."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from lightning_grpc.client import StoreClient
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.engine_fixtures"]
BACKENDS = ["memory", "sqlite"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server_config(backend: str, tmp_path: Path) -> ServerConfig:
    return ServerConfig(port=0, db=tmp_path / "store.db" if backend == "sqlite" else None, grace=1.0)


@pytest_asyncio.fixture
async def server(server_config: ServerConfig) -> AsyncIterator[RunningServer]:
    running = await start_server(server_config)
    try:
        yield running
    finally:
        await running.stop()


@pytest_asyncio.fixture
async def client(server: RunningServer) -> AsyncIterator[StoreClient]:
    c = StoreClient(f"127.0.0.1:{server.port}")
    try:
        yield c
    finally:
        await c.close()


@pytest_asyncio.fixture
async def store_server() -> AsyncIterator[RunningServer]:
    """A Store server in memory, no token (files that need another define their own)."""
    running = await start_server(ServerConfig(port=0, grace=1.0))
    try:
        yield running
    finally:
        await running.stop()


@pytest_asyncio.fixture
async def store(store_server: RunningServer) -> AsyncIterator[StoreClient]:
    """A client of :func:`store_server`."""
    client = StoreClient(f"127.0.0.1:{store_server.port}")
    try:
        yield client
    finally:
        await client.close()


def status_of(exc: BaseException) -> str:
    """The gRPC status code name of a raw stub error."""
    assert isinstance(exc, grpc.RpcError)
    return exc.code().name  # type: ignore[attr-defined, no-any-return]


class ServerProcess:
    """`lightning-grpc serve` in its own process (for kill -9 and CLI tests)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.lines: list[str] = []
        self._drainer: threading.Thread | None = None

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def start(self, timeout: float = 20.0) -> ServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_grpc.cli.main", "serve", "--host", "127.0.0.1", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=ROOT,
        )
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if "event=server_started" in line:
                self.port = int(line.split("address=")[1].split()[0].rsplit(":", 1)[1])
                self._drainer = threading.Thread(target=self._drain, daemon=True)
                self._drainer.start()
                return self
        raise RuntimeError(f"server did not start: exit={self.proc.poll()}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(timeout)
        if self._drainer is not None:
            self._drainer.join(5)
        return code


@pytest.fixture
def server_process() -> Iterator[type[ServerProcess]]:
    started: list[ServerProcess] = []

    class Tracked(ServerProcess):
        def start(self, timeout: float = 20.0) -> ServerProcess:
            started.append(self)
            return super().start(timeout)

    yield Tracked
    for p in started:
        p.kill()
