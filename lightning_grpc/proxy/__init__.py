"""The LLM proxy: an OpenAI-compatible HTTP proxy that records every LLM call of an attempt, with the
exact token ids the model saw and produced, as a span in the Store; controlled over gRPC (ProxyService).

Agents call ``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1`` with any OpenAI client
(:meth:`lightning_grpc.types.ProxyLLM.for_attempt` builds that URL).

vLLM-dialect backends (vLLM, the embedded engine) are called directly and their bytes passed
through; other OpenAI-compatible backends go through LiteLLM. LiteLLM is not used for the former
because its vLLM streaming path drops ``prompt_token_ids`` from the chunks (see :mod:`.upstream`).

Its client is :mod:`lightning_grpc.client.proxy` (``ProxyClient``), its gRPC servicer
:mod:`lightning_grpc.server.proxy_servicer`, and the servers that host it (on its own, or next to the
Store) :mod:`lightning_grpc.server.proxy_app`: each lives with its kind, in the layer above this one.
"""

from __future__ import annotations

from lightning_grpc.types import ProxyStatus

from .app import LLMProxy
from .backends import Backend, BackendDialect, BackendStats, BackendTable
from .core import ProxyConfig, ProxyCore

__all__ = [
    "Backend",
    "BackendDialect",
    "BackendStats",
    "BackendTable",
    "LLMProxy",
    "ProxyConfig",
    "ProxyCore",
    "ProxyStatus",
]
