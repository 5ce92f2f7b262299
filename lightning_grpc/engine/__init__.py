"""The embedded CPU model engine: an OpenAI-compatible server (vLLM's dialect) over a transformers LM.

In process (tests, a trainer sharing the process)::

    from lightning_grpc.engine import build_tiny_model, start_engine

    build_tiny_model(tmp / "tiny")                      # a few seconds, nothing downloaded
    engine = await start_engine(tmp / "tiny", port=0)   # EngineServer; engine.base_url ends in /v1
    ...
    await engine.load_weights(checkpoint_dir)           # or POST /admin/load_weights; returns the version
    await engine.stop()

As a subprocess (``lightning-grpc engine --model DIR --port 0``)::

    with EngineProcess(tmp / "tiny") as engine:
        openai.OpenAI(base_url=engine.base_url, api_key="EMPTY")

``EngineProcess`` imports nothing heavy; the other names load torch and transformers when first used.
The wire format is described in ``server``, the batching in ``scheduler``, the tiny model in ``tiny``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_grpc.engine.process import EngineProcess

if TYPE_CHECKING:
    from lightning_grpc.engine.errors import EngineError
    from lightning_grpc.engine.protocol import SamplingParams
    from lightning_grpc.engine.scheduler import Scheduler
    from lightning_grpc.engine.server import EngineConfig, EngineServer, serve_forever, start_engine
    from lightning_grpc.engine.tiny import TinyModelSpec, build_tiny_model

_LAZY = {
    "EngineError": "errors",
    "SamplingParams": "protocol",
    "Scheduler": "scheduler",
    "EngineConfig": "server",
    "EngineServer": "server",
    "serve_forever": "server",
    "start_engine": "server",
    "TinyModelSpec": "tiny",
    "build_tiny_model": "tiny",
}

__all__ = [
    "EngineConfig",
    "EngineError",
    "EngineProcess",
    "EngineServer",
    "SamplingParams",
    "Scheduler",
    "TinyModelSpec",
    "build_tiny_model",
    "serve_forever",
    "start_engine",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
