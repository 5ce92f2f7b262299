"""Run ``lightning-grpc engine`` as a subprocess and wait until it serves (no torch import here).

    with EngineProcess(model_dir) as engine:
        client = openai.OpenAI(base_url=engine.base_url, api_key="EMPTY")

The process logs one line per event on stdout, which a thread reads into ``lines``
(:class:`lightning_grpc.processes.Background`); ``start`` waits, within its timeout, for
``event=engine_started`` (whose ``address=HOST:PORT`` gives the port when ``--port 0``). ``stop`` sends
SIGTERM (the engine finishes cleanly) and kills after ``timeout``. The engine runs in a process group of
its own and stops by itself if this process dies.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from lightning_grpc import environment
from lightning_grpc.processes import CLI, Background, log_field

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
        self._process: Background | None = None

    @property
    def lines(self) -> list[str]:
        """What the engine printed so far (the latest lines: :attr:`.Background.lines`)."""
        return self._process.lines if self._process is not None else []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self, timeout: float = 120.0) -> EngineProcess:
        """Start the engine and wait, at most ``timeout`` seconds, until it serves; RuntimeError if it
        exits or stays silent that long (it is killed then), with the last lines it printed."""
        self._process = Background("engine", [*CLI, "engine", *self.args], self.env)
        self.proc = self._process.proc
        try:
            ready = self._process.wait_for(READY_EVENT, timeout=timeout)[0]
        except RuntimeError as exc:
            self.kill()
            raise RuntimeError(
                f"the engine did not start ({exc}; exit {self.proc.poll()}):\n{self._process.tail()}"
            ) from None
        self.port = int(log_field(ready, "address").rsplit(":", 1)[1])
        return self

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (the engine finishes cleanly), SIGKILL after ``timeout`` seconds; the exit code."""
        return self._process.stop(timeout) if self._process is not None else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
