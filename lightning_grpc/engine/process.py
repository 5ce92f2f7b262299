"""Run ``lightning-grpc engine`` as a subprocess and wait until it serves (no torch import here).

    with EngineProcess(model_dir) as engine:
        client = openai.OpenAI(base_url=engine.base_url, api_key="EMPTY")

The process logs one line per event on stdout; ``start`` reads them until ``event=engine_started``
(whose ``address=HOST:PORT`` gives the port when ``--port 0``), then a thread keeps draining them into
``lines``. ``stop`` sends SIGTERM (the engine finishes cleanly) and kills after ``timeout``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from lightning_grpc import environment
from lightning_grpc.processes import CLI

READY_EVENT = "event=engine_started"


class EngineProcess:
    def __init__(
        self,
        model: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        max_batch_size: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.args = ["--model", str(model), "--host", host, "--port", str(port)]
        if served_model_name:
            self.args += ["--served-model-name", served_model_name]
        if max_batch_size:
            self.args += ["--max-batch-size", str(max_batch_size)]
        self.args += extra_args or []
        #: The key of the engine's /admin routes (made here unless given; passed in the environment).
        self.admin_key = admin_key or secrets.token_urlsafe(32)
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **(env or {}),
            environment.ENGINE_ADMIN_KEY: self.admin_key,
        }
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self._drainer: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self, timeout: float = 120.0) -> EngineProcess:
        self.proc = subprocess.Popen(
            [sys.executable, *CLI, "engine", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if READY_EVENT in line:
                self.port = int(line.split("address=")[1].split()[0].rsplit(":", 1)[1])
                self._drainer = threading.Thread(target=self._drain, daemon=True)
                self._drainer.start()
                return self
        self.kill()
        tail = "".join(self.lines[-20:])
        raise RuntimeError(f"the engine did not start (exit {self.proc.poll()}):\n{tail}")

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._drainer is not None:
            self._drainer.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
