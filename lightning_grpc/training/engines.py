"""The inference engine a training run serves its policy with, behind one small interface.

:class:`EmbeddedEngine` is the project's CPU engine (``lightning-grpc engine``, the default);
:class:`VllmEngine` is a real vLLM server (``[engine] kind = "vllm"``), the same code that serves on GPUs.
Both are started by the run as child processes (or name one already running), take each update's weights
from a ``save_pretrained`` directory (:meth:`Engine.load_weights`) and answer in vLLM's dialect, so the
proxy records the ids and log-probs they sampled, never a re-tokenization.

How the run keeps vLLM's control to itself. vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``:
``/pause``, ``/resume``, ``/collective_rpc``, ``/update_weight_version``, ``/sleep``, ...) are not covered
by its ``--api-key``: its middleware guards only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (vLLM 0.32.0, ``entrypoints/serve/middleware/authenticate.py``). A key would leave anyone who
reaches the port able to reload weights or run a collective RPC. So vLLM listens on no TCP port at all:
it is bound to a Unix socket (``--uds``) in a private directory (mode 0700, made by ``mkdtemp``) that only
the run's user can enter, and the run drives the control routes over that socket. The agents' inference
reaches it through a small forwarder, the *gate* (``python -m lightning_grpc.training.engines gate``, a
child process of the run), listening on loopback TCP and passing on only ``/v1/*`` (without the runtime
LoRA routes), ``/health`` and ``/metrics``: the same exposure as the embedded engine's inference port. Responses,
streams included, are relayed chunk by chunk; a call the proxy drops is dropped upstream too, so vLLM
stops generating it.

The policy version. vLLM's chat and completion answers carry no weight version (only its token-in/out
route ``/inference/v1/generate`` reports ``weight_versions``). After each reload the run sets it with
``POST /update_weight_version {"new_version": "N"}``, reads it back from ``GET /weight_info``, and hands
*that* number to the proxy as the backend's policy version, which every later call records.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lightning_grpc._extras import extra_imports

with extra_imports("train"):
    import aiohttp

from lightning_grpc import environment, logs
from lightning_grpc.processes import CLI, Background, log_field, model_child_env

from .experiment import ExperimentConfig

log = logs.get_logger(__name__)

#: Where ``make vllm-env`` builds vLLM's environment (the repository root's ``.venv-vllm``).
DEFAULT_VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"


class EngineError(RuntimeError):
    """The engine refused or failed a control call (start, weights, pause)."""


class Engine(Protocol):
    """What a training run needs of the server behind its proxy."""

    kind: str
    #: Where inference is served, without ``/v1`` (``http://127.0.0.1:PORT``); "" before :meth:`start`.
    url: str
    #: Whether each answer carries the policy version it was sampled with (else the proxy's backend
    #: entry carries it: see :meth:`load_weights`).
    reports_version: bool
    #: The child processes this engine started (watched by the run, stopped by :meth:`stop`).
    processes: list[Background]

    def start(self, model_dir: Path, policy_version: int) -> str:
        """Start serving ``model_dir`` as ``policy_version``; returns :attr:`url` once it serves."""
        ...

    async def load_weights(self, path: Path, policy_version: int) -> int:
        """Serve the weights of ``path`` (a ``save_pretrained`` directory) from now on, as
        ``policy_version``; returns the version the engine reports it now serves."""
        ...

    async def pause(self) -> None:
        """Stop generating (a weight swap follows); no-op where the proxy's own pause suffices."""
        ...

    async def resume(self) -> None: ...

    def stop(self) -> None: ...


def _stop_all(processes: Sequence[Background], timeout: float = 20) -> None:
    for process in reversed(processes):
        process.stop(timeout=timeout)


# ------------------------------------------------------------------ the embedded engine


@dataclass
class EmbeddedEngine:
    """The project's CPU engine: ``lightning-grpc engine`` started as a child, or one already running at
    ``url`` (its admin key then in ``$LIGHTNING_GRPC_ENGINE_ADMIN_KEY``)."""

    url: str = ""
    admin_key: str = field(default="", repr=False)
    served_name: str = "policy"
    threads: int = 1
    max_batch_size: int = 64
    kind: str = "embedded"
    reports_version: bool = True
    processes: list[Background] = field(default_factory=list)

    def start(self, model_dir: Path, policy_version: int) -> str:
        if self.url:  # already running
            return self.url
        # handed to the child in its environment, not its arguments
        self.admin_key = secrets.token_urlsafe(32)
        engine = self._process(model_dir, policy_version, port=0)
        self.processes.append(engine)
        self.url = "http://" + log_field(
            engine.wait_until_serving("event=engine_started", timeout=120)[0], "address"
        )
        return self.url

    def restart(self, model_dir: Path, policy_version: int) -> Background:
        """The engine this run started, again, on its port: serving ``model_dir`` (the weights last published)
        as ``policy_version``. Returns the new process once it serves."""
        port = int(self.url.rsplit(":", 1)[1])
        engine = self._process(model_dir, policy_version, port=port)
        engine.wait_until_serving("event=engine_started", timeout=120)
        self.processes[:] = [engine]
        return engine

    def _process(self, model_dir: Path, policy_version: int, *, port: int) -> Background:
        return Background(
            "engine",
            [
                *CLI,
                "engine",
                "--model",
                str(model_dir),
                "--port",
                str(port),
                "--served-model-name",
                self.served_name,
                "--threads",
                str(self.threads),
                "--policy-version",
                str(policy_version),
                "--max-batch-size",
                str(self.max_batch_size),
            ],
            {**model_child_env(self.threads), environment.ENGINE_ADMIN_KEY: self.admin_key},
        )

    async def load_weights(self, path: Path, policy_version: int) -> int:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{self.url}/admin/load_weights",
                json={"path": str(path.resolve()), "policy_version": policy_version},
                headers={"Authorization": f"Bearer {self.admin_key}"},
            ) as resp,
        ):
            if resp.status == 401:
                raise EngineError(
                    "the engine refused the new weights: its admin key is needed; set "
                    f"${environment.ENGINE_ADMIN_KEY} to it (the engine logs the file it wrote it to)"
                )
            if resp.status != 200:
                raise EngineError(f"the engine refused the new weights: {resp.status} {await resp.text()}")
        return policy_version  # its answers carry the version from now on

    async def pause(self) -> None:
        return None  # the proxy's pause and drain hold every call: nothing runs in the engine

    async def resume(self) -> None:
        return None

    def stop(self) -> None:
        _stop_all(self.processes)


# ------------------------------------------------------------------ vLLM


def vllm_python(configured: str = "") -> str:
    """The interpreter that has vLLM: ``engine.python``, else ``$LIGHTNING_GRPC_VLLM_PYTHON``, else the
    repository's ``.venv-vllm`` (``make vllm-env``), else this interpreter."""
    if configured:
        return configured
    if python := environment.read(environment.VLLM_PYTHON):
        return python
    candidate = DEFAULT_VLLM_VENV / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


#: Run by vLLM's interpreter: vLLM's OpenAI server in a process group of its own (its engine and worker
#: processes join it), stopped (SIGTERM) once the run that started it is gone, as every child of a run is
#: (``processes.stop_with_parent``). The group is what :meth:`VllmEngine.stop` kills last: vLLM's engine
#: process outlives a server that died abruptly (measured: still there a minute after a SIGKILL).
_VLLM_LAUNCHER = """
import os, runpy, signal, sys, threading, time
os.setpgrp()
parent = os.getppid()
def watch():
    while os.getppid() == parent:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""


#: A vLLM worker extension (``--worker-extension-cls``), written into the run's private directory and put on
#: vLLM's ``PYTHONPATH``: vLLM's own environment never holds this project.
#:
#: Why: with tied embeddings (``tie_word_embeddings``, as in Qwen2.5 0.5B-3B and the tiny model), vLLM's CPU
#: build computes the output head from a copy of the embedding prepacked for its GEMM kernels
#: (``dispatch_cpu_unquantized_gemm`` in ``UnquantizedEmbeddingMethod.process_weights_after_loading``), made
#: once per layer. An in-place ``reload_weights`` re-processes the embedding layer but never the head (it
#: takes no tensor of the checkpoint), so the head keeps sampling from the OLD embedding: measured, vLLM's
#: log-probs after a reload equal a transformers forward with the new body and the old head (to 1e-6). This
#: re-ties the head to the embedding and re-processes it, after every reload.
VLLM_WORKER_EXTENSION = '''
"""lightning-grpc's extension of vLLM's workers (written by lightning_grpc.training.engines)."""


class LightningWorkerExtension:
    def lightning_refresh_tied_head(self):
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None or head is embed:
            return "not tied"
        if head.weight is not embed.weight:
            head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
        return "refreshed"
'''
VLLM_WORKER_EXTENSION_CLS = "lightning_grpc_vllm_worker.LightningWorkerExtension"


def _has_cuda() -> bool:
    """Whether this machine has an NVIDIA GPU (vLLM's CUDA build then serves; else its CPU build)."""
    return shutil.which("nvidia-smi") is not None


def unix_session(socket_path: str | Path, timeout: float = 600.0) -> aiohttp.ClientSession:
    """An HTTP client of a server bound to a Unix socket (URLs then name any host: ``http://vllm/...``)."""
    return aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=str(socket_path)),
        timeout=aiohttp.ClientTimeout(total=timeout),
    )


@dataclass
class VllmEngine:
    """A vLLM OpenAI server, bound to a Unix socket in a private directory, inference passed on by a gate.

    ``url`` set at construction: a vLLM already running there (``services.engine``): its inference is
    used, and weights go to its control routes at the same address (they must be reachable: vLLM's
    ``--api-key`` does not cover them, so keep such a server on a private network). :meth:`start` then
    checks that it can serve the run (:meth:`_attach`) and refuses, saying what to change, when not; such a
    server is the user's to restart. One started here that dies is started again by the run where it was
    (:meth:`restart`, :meth:`restart_gate`), at the policy version last published.
    """

    model_dir: Path | None = None
    served_name: str = "policy"
    python: str = ""
    max_model_len: int = 1024
    kv_cache_gib: float = 1.0
    args: tuple[str, ...] = ()
    threads: int = 1
    start_timeout: float = 600.0
    url: str = ""
    kind: str = "vllm"
    reports_version: bool = False
    processes: list[Background] = field(default_factory=list)
    #: The private directory holding vLLM's socket (made by :meth:`start`, removed by :meth:`stop`).
    socket_dir: Path | None = None
    #: Seconds from the start of vLLM's process to its first healthy answer, and of the last reload.
    start_seconds: float = 0.0
    reload_seconds: float = 0.0
    #: Whether vLLM's workers have :data:`VLLM_WORKER_EXTENSION` (always when started here).
    refreshes_head: bool = False

    @property
    def socket_path(self) -> Path | None:
        return None if self.socket_dir is None else self.socket_dir / "vllm.sock"

    def command(self, model_dir: Path) -> list[str]:
        """vLLM's server arguments (after the launcher)."""
        assert self.socket_path is not None
        return [
            "--model",
            str(model_dir),
            "--served-model-name",
            self.served_name,
            "--uds",
            str(self.socket_path),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--disable-uvicorn-access-log",
            # vLLM's own (OpenAI's) defaults for what a request leaves out, not the model's
            # generation_config.json (a Qwen's temperature 0.7, top_k 20, ...): the proxy records an absent
            # temperature or top_p as 1.0, and the learner computes log-probs at the recorded temperature
            "--generation-config",
            "vllm",
            "--worker-extension-cls",
            VLLM_WORKER_EXTENSION_CLS,
            *(self._cpu_args() if not _has_cuda() else []),
            # whole GiB go in VLLM_CPU_KVCACHE_SPACE (which takes only those); a fraction, in bytes
            *([] if self.kv_cache_gib.is_integer() else ["--kv-cache-memory-bytes", str(self._kv_bytes)]),
            *self.args,
        ]

    def _cpu_args(self) -> list[str]:
        """Whole prompts in one step on vLLM's CPU build: a request with its own ``seed`` whose prompt is
        prefilled over several steps kills vLLM-CPU 0.32.0's engine (``_bookkeeping_sync`` rewinds the
        request's generator with ``get_offset()``, and a CPU generator has none: "RuntimeError: CPU
        Generator does not use offset", then EngineDeadError). The agents' calls carry seeds, and 128 of
        them at once make the scheduler split prompts; without chunked prefill it never does (vLLM's CPU
        platform itself turns it off the same way for MLA models)."""
        return [
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(self.max_model_len, 2048)),
        ]

    @property
    def _kv_bytes(self) -> int:
        return int(self.kv_cache_gib * 2**30)

    def environment(self) -> dict[str, str]:
        return {
            **model_child_env(self.threads),
            # its internal sockets on loopback (else it picks a non-loopback interface)
            "VLLM_HOST_IP": "127.0.0.1",
            **(
                {"VLLM_CPU_KVCACHE_SPACE": str(int(self.kv_cache_gib))}
                if self.kv_cache_gib.is_integer()
                else {}
            ),
            # the control routes (/pause, /resume, /collective_rpc, /update_weight_version, /weight_info)
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # the Unix sockets between its own processes (ZMQ ipc), in the private directory too, removed with it:
            # by default they go in the temporary directory, where each vLLM a run started left about seven
            **({"VLLM_RPC_BASE_PATH": str(self.socket_dir)} if self.socket_dir is not None else {}),
            # the worker extension, in the private directory
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(self.socket_dir or ""), os.environ.get("PYTHONPATH", "")) if p
            ),
        }

    def start(self, model_dir: Path, policy_version: int) -> str:
        if self.url:  # already running
            self._attach(model_dir, policy_version)
            return self.url
        self.model_dir = model_dir
        self.refreshes_head = True
        self.socket_dir = Path(tempfile.mkdtemp(prefix="lightning-grpc-vllm-"))  # mode 0700
        write_worker_extension(self.socket_dir)
        started = time.monotonic()
        try:
            server = self._server(model_dir)
            self.processes.append(server)
            self._wait_healthy(server)
            self.start_seconds = time.monotonic() - started
            # the version every call records from now on: the one vLLM reports back
            self._sync_call("POST", "/update_weight_version", {"new_version": str(policy_version)})
            gate = self._gate(port=0)
            self.processes.append(gate)
            address = log_field(
                gate.wait_until_serving("event=engine_gate_started", timeout=60)[0], "address"
            )
        except BaseException:
            self.stop()
            raise
        self.url = f"http://{address}"
        log.info(
            "event=vllm_started url=%s socket=%s start_seconds=%.1f policy_version=%d",
            self.url,
            self.socket_path,
            self.start_seconds,
            policy_version,
        )
        return self.url

    def restart(self, model_dir: Path, policy_version: int) -> Background:
        """The vLLM this run started, again, on its socket (so the gate's address, the proxy's upstream, stays
        the same): serving ``model_dir`` (the weights last published, with the tokenizer beside them) as
        ``policy_version``. What is left of the dead server goes first: its engine process outlives it and
        holds its memory. Returns the new server once it serves; EngineError when it does not (the
        supervisor tries again, and this ends the one that failed)."""
        assert self.socket_path is not None, "only a vLLM this run started is restarted"
        for dead in [p for p in self.processes if p.name == "engine"]:
            _end_group(dead)
        self.socket_path.unlink(missing_ok=True)  # vLLM binds its socket anew: a file left there refuses it
        started = time.monotonic()
        server = self._server(model_dir)
        self._replace(server)
        self._wait_healthy(server)
        try:
            self._sync_call("POST", "/update_weight_version", {"new_version": str(policy_version)})
        except OSError as exc:
            raise EngineError(f"vLLM restarted but did not take its weight version: {exc}") from None
        self.model_dir = model_dir
        log.info(
            "event=vllm_restarted socket=%s start_seconds=%.1f policy_version=%d model=%s",
            self.socket_path,
            time.monotonic() - started,
            policy_version,
            model_dir,
        )
        return server

    def restart_gate(self) -> Background:
        """The gate again, on its port (the proxy's upstream address stays the same), to the same socket."""
        gate = self._gate(port=int(self.url.rsplit(":", 1)[1]))
        self._replace(gate)
        gate.wait_until_serving("event=engine_gate_started", timeout=60)
        return gate

    def _server(self, model_dir: Path) -> Background:
        """vLLM's server serving ``model_dir``, started by the launcher (in a process group of its own)."""
        return Background(
            "engine",
            [vllm_python(self.python), "-c", _VLLM_LAUNCHER, *self.command(model_dir)],
            self.environment(),
            python=False,
        )

    def _gate(self, port: int) -> Background:
        """The gate to vLLM's socket on loopback ``port`` (0: a free one)."""
        return Background(
            "engine-gate",
            [
                "-m",
                "lightning_grpc.training.engines",
                "gate",
                "--uds",
                str(self.socket_path),
                "--port",
                str(port),
            ],
            model_child_env(1),
        )

    def _replace(self, process: Background) -> None:
        """``process`` in the place of the one of its name (what :meth:`stop` stops is always the latest)."""
        self.processes[:] = [p for p in self.processes if p.name != process.name] + [process]

    def _attach(self, model_dir: Path, policy_version: int) -> None:
        """Checks that the vLLM at ``url`` can serve this run and sets its weight version; EngineError,
        naming what to change, when it cannot: it must answer, serve ``model.served_name`` on ``/v1``
        without an API key (the proxy calls it without one), have its control routes
        (``VLLM_SERVER_DEV_MODE=1``), and, for a model with tied embeddings, this project's worker extension
        (see :data:`VLLM_WORKER_EXTENSION`; ``python -m lightning_grpc.training.engines extension DIR``)."""
        import json

        where = f"vLLM at {self.url} (services.engine)"
        try:
            status, _ = self._sync_call("GET", "/health", timeout=10, check=False)
        except OSError as exc:
            raise EngineError(f"{where} does not answer: {exc}") from None
        if status != 200:
            raise EngineError(f"{where} is not healthy: GET /health answered {status}")
        status, data = self._sync_call("GET", "/v1/models", check=False)
        if status == 401:
            raise EngineError(
                f"{where} asks for an API key on /v1; the run's proxy calls it without one: serve it "
                "without --api-key, on a network only the run reaches"
            )
        served = [m.get("id") for m in json.loads(data or b"{}").get("data", [])] if status == 200 else []
        if self.served_name not in served:
            raise EngineError(
                f"{where} serves {served or 'no model'}, not model.served_name = {self.served_name!r}: "
                f"start it with --served-model-name {self.served_name}"
            )
        status, _ = self._sync_call("GET", "/weight_info", check=False)
        if status == 404:
            raise EngineError(
                f"{where} has no control routes (GET /weight_info answered 404): start it with "
                "VLLM_SERVER_DEV_MODE=1 in its environment; the run reloads weights and sets the policy "
                "version through them"
            )
        status, _ = self._sync_call(
            "POST", "/collective_rpc", {"method": "lightning_refresh_tied_head"}, check=False
        )
        self.refreshes_head = 200 <= status < 300
        if not self.refreshes_head and ties_embeddings(model_dir):
            raise EngineError(
                f"{where} lacks lightning-grpc's worker extension, which a model with tied embeddings "
                f"({model_dir}) needs after each reload, or vLLM keeps sampling from the old output head: "
                "write it with `python -m lightning_grpc.training.engines extension DIR` and start vLLM "
                f"with DIR on its PYTHONPATH and --worker-extension-cls {VLLM_WORKER_EXTENSION_CLS}"
            )
        self._sync_call("POST", "/update_weight_version", {"new_version": str(policy_version)})
        log.info(
            "event=vllm_attached url=%s policy_version=%d refreshes_head=%s",
            self.url,
            policy_version,
            self.refreshes_head,
        )

    def _wait_healthy(self, server: Background) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not server.alive():
                raise EngineError(
                    f"vLLM exited (code {server.proc.returncode}) before serving:\n{server.tail(40)}"
                )
            if self.socket_path is not None and self.socket_path.exists():
                try:
                    status, _ = self._sync_call("GET", "/health", timeout=5, check=False)
                    if status == 200:
                        return
                except OSError:
                    pass
            time.sleep(0.5)
        raise EngineError(f"vLLM did not serve within {self.start_timeout:.0f}s:\n{server.tail(40)}")

    def _sync_call(
        self, method: str, path: str, body: Any = None, *, timeout: float = 60.0, check: bool = True
    ) -> tuple[int, bytes]:
        """A control call without an event loop (while the run starts its services): over the Unix socket
        of a vLLM started here, else to ``url``."""
        import http.client
        import json
        import socket
        from urllib.parse import urlsplit

        sock: socket.socket | None = None
        if self.socket_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            conn = http.client.HTTPConnection("vllm", timeout=timeout)
        else:
            parts = urlsplit(self.url)
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout)
        try:
            if sock is not None:
                sock.connect(str(self.socket_path))
                conn.sock = sock
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status, data = resp.status, resp.read()
        finally:
            conn.close()
            if sock is not None:
                sock.close()
        if check and not 200 <= status < 300:
            raise EngineError(f"vLLM {method} {path}: {status} {data[:2000].decode('utf-8', 'replace')}")
        return status, data

    def _control(self, timeout: float = 600.0) -> aiohttp.ClientSession:
        """A client of vLLM's own routes: over its Unix socket, or at ``url`` for a vLLM not started here."""
        if self.socket_path is not None:
            return unix_session(self.socket_path, timeout)
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))

    @property
    def _base(self) -> str:
        return "http://vllm" if self.socket_path is not None else self.url

    async def call(self, method: str, path: str, body: Any = None, timeout: float = 600.0) -> Any:
        """One control call to vLLM; its JSON answer (None when empty); EngineError unless 2xx."""
        async with (
            self._control(timeout) as http,
            http.request(method, f"{self._base}{path}", json=body) as resp,
        ):
            text = await resp.text()
            if not 200 <= resp.status < 300:
                raise EngineError(f"vLLM {method} {path}: {resp.status} {text[:2000]}")
            if not text:
                return None
            try:
                return await resp.json(content_type=None)
            except ValueError:
                return text

    async def _set_version(self, policy_version: int) -> int:
        await self.call("POST", "/update_weight_version", {"new_version": str(policy_version)})
        return await self.reported_version()

    def served_version(self) -> int:
        """:meth:`reported_version` without an event loop (while the run starts its services)."""
        import json

        _, data = self._sync_call("GET", "/weight_info")
        return _version(json.loads(data or b"{}"))

    async def reported_version(self) -> int:
        """The weight version vLLM reports (``GET /weight_info``), as the policy version it serves."""
        return _version(await self.call("GET", "/weight_info"))

    async def load_weights(self, path: Path, policy_version: int) -> int:
        """vLLM's in-place reload (``POST /collective_rpc`` ``reload_weights`` with ``weights_path``: every
        worker loads the directory into the running model), a tied output head re-made (see
        :data:`VLLM_WORKER_EXTENSION`), its prefix cache reset, then its weight version set and read back."""
        started = time.perf_counter()
        await self.call(
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(Path(path).resolve())}},
        )
        # the output head of a tied embedding re-made from the new weights (VLLM_WORKER_EXTENSION)
        if self.refreshes_head:
            await self.call("POST", "/collective_rpc", {"method": "lightning_refresh_tied_head"})
        # KV blocks cached under the old weights would answer later prompts with stale keys and values:
        # drop them (requests still running are preempted and recomputed with the new weights)
        reset = await self.call("POST", "/reset_prefix_cache?reset_running_requests=true")
        if isinstance(reset, dict) and reset.get("success") is False:
            raise EngineError("vLLM could not reset its prefix cache after the reload")
        version = await self._set_version(policy_version)
        self.reload_seconds = time.perf_counter() - started
        log.info(
            "event=vllm_weights_loaded path=%s policy_version=%d seconds=%.3f",
            path,
            version,
            self.reload_seconds,
        )
        return version

    async def pause(self) -> None:
        """vLLM holds new requests and keeps those in flight frozen (``mode=keep``) until :meth:`resume`."""
        await self.call("POST", "/pause?mode=keep")

    async def resume(self) -> None:
        await self.call("POST", "/resume")

    def stop(self) -> None:
        groups = [p.proc.pid for p in self.processes if p.name == "engine"]
        _stop_all(self.processes, timeout=30)
        self.processes.clear()
        for group in groups:  # whatever of vLLM outlived its server (its engine and worker processes)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None


def _end_group(process: Background, timeout: float = 30.0) -> None:
    """SIGKILL to the process group ``process`` leads (vLLM's server, and the engine and worker processes it
    started, which outlive a server that died), then up to ``timeout`` seconds for the group to be gone."""
    process.proc.poll()  # the leader reaped if it has exited (a zombie would count as the group still there)
    group = process.proc.pid
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)
        while True:
            process.proc.poll()
            os.killpg(group, 0)  # ProcessLookupError once none of the group is left
            if time.monotonic() > deadline:
                log.warning("event=vllm_group_lingers group=%d seconds=%.0f", group, timeout)
                return
            time.sleep(0.1)


def ties_embeddings(model_dir: Path) -> bool:
    """Whether the model at ``model_dir`` shares its input embedding with its output head."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings"))
    return True if tied is None else bool(tied)  # transformers' own default


def write_worker_extension(directory: Path) -> Path:
    """Writes :data:`VLLM_WORKER_EXTENSION` into ``directory`` (for vLLM's PYTHONPATH); returns the file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "lightning_grpc_vllm_worker.py"
    path.write_text(VLLM_WORKER_EXTENSION)
    return path


def _version(info: Any) -> int:
    raw = info.get("weight_version") if isinstance(info, dict) else None
    try:
        return int(str(raw))
    except ValueError:
        raise EngineError(f"vLLM reports weight version {raw!r}, not a policy version") from None


def make_engine(config: ExperimentConfig) -> Engine:
    """The engine ``[engine]`` and ``services.engine`` of an experiment describe (not started)."""
    svc, eng = config.services, config.engine
    if eng.kind == "vllm":
        return VllmEngine(
            served_name=config.model.served_name,
            python=eng.python,
            max_model_len=eng.max_model_len,
            kv_cache_gib=eng.kv_cache_gib,
            args=eng.args,
            threads=svc.engine_threads,
            url=svc.engine.rstrip("/").removesuffix("/v1") if svc.engine else "",
        )
    return EmbeddedEngine(
        url=svc.engine,
        admin_key=os.environ.get(environment.ENGINE_ADMIN_KEY, ""),
        served_name=config.model.served_name,
        threads=svc.engine_threads,
        max_batch_size=max(64, config.agent.concurrency * config.agent.processes),
    )


# ------------------------------------------------------------------ the gate: vLLM's inference on loopback TCP

#: Hop-by-hop and length headers: the gate frames what it relays itself (the bytes pass as they came, their
#: content-encoding with them).
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade", "host"}
)
#: Under /v1 but control, not inference (present when vLLM allows runtime LoRA updates).
_CLOSED_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def gate_app(socket_path: str | Path) -> Any:
    """The gate's aiohttp application: ``/v1/*``, ``/health`` and ``/metrics`` relayed to the server at
    ``socket_path``."""
    from aiohttp import web

    sessions: dict[str, aiohttp.ClientSession] = {}

    def upstream() -> aiohttp.ClientSession:
        if "s" not in sessions or sessions["s"].closed:
            sessions["s"] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(socket_path), limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_read=3600),
                auto_decompress=False,
            )
        return sessions["s"]

    async def relay(request: web.Request) -> web.StreamResponse:
        if request.path in _CLOSED_PATHS:
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        body = await request.read()
        try:
            resp = await upstream().request(
                request.method,
                f"http://vllm{request.path_qs}",
                data=body if body else None,
                headers=headers,
            )
        except (aiohttp.ClientError, OSError) as exc:
            return web.json_response(
                {"error": {"message": f"the engine is unreachable: {exc}", "type": "api_error", "code": 502}},
                status=502,
            )
        try:
            out = web.StreamResponse(
                status=resp.status,
                headers={k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS},
            )
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            resp.release()  # the connection to vLLM goes back to the pool
            return out
        except aiohttp.ClientPayloadError:
            # vLLM went away mid-answer: cut the caller's connection too, so it is seen broken, not complete
            if request.transport is not None:
                request.transport.abort()
            raise
        finally:
            resp.close()  # a caller gone mid-stream: vLLM sees its connection drop and aborts the request

    async def close(_: web.Application) -> None:
        for session in sessions.values():
            await session.close()

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_route("*", "/v1/{tail:.*}", relay)
    app.router.add_get("/health", relay)
    app.router.add_get("/metrics", relay)
    app.on_cleanup.append(close)
    return app


async def _serve_gate(socket_path: str, host: str, port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(gate_app(socket_path), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    log.info("event=engine_gate_started address=%s:%d socket=%s", bound[0], bound[1], socket_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    with contextlib.suppress(Exception):
        await runner.cleanup()


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> None:
    """``python -m lightning_grpc.training.engines gate --uds PATH [--host H] [--port P]`` or
    ``... extension DIR``."""
    parser = argparse.ArgumentParser(prog="python -m lightning_grpc.training.engines")
    sub = parser.add_subparsers(dest="command", required=True)
    gate = sub.add_parser("gate", help="serve a Unix-socket vLLM's /v1, /health and /metrics on loopback TCP")
    gate.add_argument("--uds", required=True)
    gate.add_argument("--host", default="127.0.0.1")
    gate.add_argument("--port", type=int, default=0)
    extension = sub.add_parser(
        "extension", help="write the worker extension a vLLM you start yourself needs (tied embeddings)"
    )
    extension.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if args.command == "extension":
        path = write_worker_extension(args.directory)
        print(
            f"wrote {path}\nstart vLLM with PYTHONPATH={path.parent} VLLM_SERVER_DEV_MODE=1 and "
            f"--worker-extension-cls {VLLM_WORKER_EXTENSION_CLS}"
        )
        return
    logs.configure_logging("INFO")
    from lightning_grpc.processes import stop_with_parent

    stop_with_parent()
    asyncio.run(_serve_gate(args.uds, args.host, args.port))


if __name__ == "__main__":
    main()
