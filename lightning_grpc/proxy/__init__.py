"""The LLM proxy: an OpenAI-compatible HTTP proxy that records every LLM call of an attempt, with the
exact token ids the model saw and produced, as a span in the Store; controlled over gRPC (ProxyService).

Agents call ``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1`` with any OpenAI client
(:meth:`lightning_grpc.types.ProxyLLM.for_attempt` builds that URL).

vLLM-dialect backends (vLLM, the embedded engine) are called directly and their bytes passed
through; other OpenAI-compatible backends go through LiteLLM. LiteLLM is not used for the former
because its vLLM streaming path drops ``prompt_token_ids`` from the chunks (see :mod:`.upstream`).

The proxy's client lives with the other clients (:mod:`lightning_grpc.client.proxy`); its servicer
(:mod:`lightning_grpc.server.proxy_servicer`) and the servers that host the proxy
(:mod:`lightning_grpc.server.proxy_app`) live with the other servers. Their names are still offered
here for existing callers, loaded on first use: those modules import the proxy, and the server layer
sits above it, so new code imports them from where they live.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .app import LLMProxy
from .backends import Backend, BackendDialect, BackendStats, BackendTable
from .core import ProxyConfig, ProxyCore, ProxyStatus

if TYPE_CHECKING:
    from lightning_grpc.client.proxy import ProxyClient

_ELSEWHERE = {
    "ProxyClient": "lightning_grpc.client.proxy",
    **{
        name: "lightning_grpc.server.proxy_servicer"
        for name in ("PROXY_SERVICE", "ProxyServicer", "add_proxy_service", "service_hook")
    },
    **{
        name: "lightning_grpc.server.proxy_app"
        for name in (
            "RunningProxy",
            "serve_proxy",
            "serve_with_store",
            "start_proxy_server",
            "start_with_store",
        )
    },
}


def __getattr__(name: str) -> Any:
    module = _ELSEWHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "PROXY_SERVICE",
    "Backend",
    "BackendDialect",
    "BackendStats",
    "BackendTable",
    "LLMProxy",
    "ProxyClient",
    "ProxyConfig",
    "ProxyCore",
    "ProxyServicer",
    "ProxyStatus",
    "RunningProxy",
    "add_proxy_service",
    "serve_proxy",
    "serve_with_store",
    "service_hook",
    "start_proxy_server",
    "start_with_store",
]
