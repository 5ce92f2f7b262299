"""The LLM proxy: an OpenAI-compatible HTTP proxy that records every LLM call of an attempt, with the
exact token ids the model saw and produced, as a span in the Store; controlled over gRPC (ProxyService).

Agents call ``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1`` with any OpenAI client
(:meth:`lightning_grpc.types.ProxyLLM.for_attempt` builds that URL).

vLLM-dialect backends (vLLM, the embedded engine) are called directly and their bytes passed
through; other OpenAI-compatible backends go through LiteLLM. LiteLLM is not used for the former
because its vLLM streaming path drops ``prompt_token_ids`` from the chunks (see :mod:`.upstream`).
"""

from .app import LLMProxy
from .backends import Backend, BackendDialect, BackendStats, BackendTable
from .client import ProxyClient
from .core import ProxyConfig, ProxyCore, ProxyStatus
from .server import RunningProxy, serve_proxy, serve_with_store, start_proxy_server, start_with_store
from .service import PROXY_SERVICE, ProxyServicer, add_proxy_service, service_hook

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
