"""Environment variables: the one place that names every variable lightning-grpc reads.

Each constant below is a variable's name, and the docstring under it says what the variable does and its
default. Code spells a name through these constants only (``os.environ.get(environment.TOKEN)``, or
:func:`read`), never as a string of its own, so the readers, the processes that set a variable for their
children, and the help texts cannot drift apart. The TypeScript client reads :data:`STORE`, :data:`TOKEN`,
:data:`CONCURRENCY` and :data:`WORKER_ID` under the same names.

Variables of other tools that the project only sets for its children (``OMP_NUM_THREADS``, ``VLLM_*``,
``HF_HUB_OFFLINE``, ``MASTER_ADDR``, ...) are written where they are set.
"""

from __future__ import annotations

import os

#: Every lightning-grpc variable starts with this; :func:`lightning_grpc.processes.child_env` leaves them all
#: out of the environment of a child that must not inherit the user's token or store.
PREFIX = "LIGHTNING_GRPC_"

# ------------------------------------------------------------------ the store and its callers
TOKEN = "LIGHTNING_GRPC_TOKEN"
"""Bearer token for the store: the admin token ``serve`` requires (auth is off when unset), and the token
every command that calls a store (``runner``, ``proxy``, ``credential``, the inspect commands, a training
run, an agent command) sends; a ``--token`` option overrides it. Default: unset."""

STORE = "LIGHTNING_GRPC_STORE"
"""The store's address, ``HOST:PORT``: the default of ``--store`` of the inspect commands, and what a
training run tells an agent command (``agent.command``) to connect to. Default: ``127.0.0.1:4747``."""

CONCURRENCY = "LIGHTNING_GRPC_CONCURRENCY"
"""How many rollouts an agent command runs at once; a training run sets it from ``agent.concurrency``.
Default: the agent command's own (8 for the TypeScript example runner)."""

WORKER_ID = "LIGHTNING_GRPC_WORKER_ID"
"""The worker id an agent command registers under; a training run sets a unique one per process
(``<experiment>-runner-<index>-<hex>``). Default: one the runner makes."""

LOG_LEVEL = "LIGHTNING_GRPC_LOG_LEVEL"
"""The log level (DEBUG, INFO, WARNING or ERROR) of the runner processes the ``runner`` command starts;
``runner`` sets it from its ``--log-level``. Default: ``INFO``."""

# ------------------------------------------------------------------ the proxy and the engines
BACKEND_API_KEY = "LIGHTNING_GRPC_BACKEND_API_KEY"
"""Bearer token the proxy sends to its LLM backends (the default of ``proxy --backend-api-key``).
Default: empty, no token."""

ENGINE_API_KEY = "LIGHTNING_GRPC_ENGINE_API_KEY"
"""Key an engine (``engine serve``) requires on its inference routes (the default of ``--api-key``).
Default: unset, the routes are open (for an engine on loopback)."""

ENGINE_ADMIN_KEY = "LIGHTNING_GRPC_ENGINE_ADMIN_KEY"
"""Key an engine requires on its ``/admin`` routes (weight reloads), the default of ``--admin-key``; a
training run makes one and hands it to the engines it starts, and reads it to reach an engine given by
``url``. Default: the engine's ``--api-key``, else one the engine makes and writes to a file it logs."""

VLLM_PYTHON = "LIGHTNING_GRPC_VLLM_PYTHON"
"""The Python interpreter that has vLLM installed, when the experiment's ``engine.python`` is empty.
Default: the interpreter of the ``.venv-vllm`` that ``make vllm-env`` builds."""

# ------------------------------------------------------------------ process plumbing
PARENT_PID = "LIGHTNING_GRPC_PARENT_PID"
"""Set for a child that :class:`lightning_grpc.processes.Background` starts: the pid of the parent whose
end the child stops with (see :func:`lightning_grpc.processes.stop_with_parent`). Default: unset, the
process outlives its parent."""

BIN = "LIGHTNING_GRPC_BIN"
"""The ``lightning-grpc`` command the TypeScript client's tests start (read by those tests only).
Default: ``.venv/bin/lightning-grpc`` at the repository root."""

# ------------------------------------------------------------------ OpenTelemetry's, read by a training run
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""OpenTelemetry's OTLP endpoint for every signal. When neither it nor
:data:`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, a training run points an agent command's span export at
the store. Default: unset."""

OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""OpenTelemetry's OTLP endpoint for spans; a training run sets it to the store's address for an agent
command when the user's environment names no endpoint. Default: unset."""

OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
"""OpenTelemetry's OTLP protocol for spans; a training run sets ``grpc`` with
:data:`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`. Default: the exporter's own."""


def read(name: str) -> str | None:
    """The value of the variable ``name``; ``None`` when it is unset or empty."""
    return os.environ.get(name) or None
