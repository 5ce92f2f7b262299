"""Calls to OpenAI-dialect backends (any OpenAI-compatible server or hosted provider) through LiteLLM.

LiteLLM is imported lazily, and only after switching off everything that reaches out at run time:
the model price table is read from the copy inside the package (``LITELLM_LOCAL_MODEL_COST_MAP``,
which must be set before the import), token counting is off (so tiktoken never looks for an
encoding file) and Hugging Face tokenizers are never downloaded.

vLLM-dialect backends do not come here (see :mod:`.upstream` for why).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

from lightning_grpc._extras import import_extra

from . import sse
from .backends import Backend
from .upstream import BackendUnreachable, UpstreamCall

#: Body fields LiteLLM takes as named parameters; anything else travels in ``extra_body``.
CHAT_PARAMS = frozenset(
    {
        "messages", "temperature", "top_p", "n", "stream_options", "stop", "max_tokens",
        "max_completion_tokens", "presence_penalty", "frequency_penalty", "logit_bias", "user",
        "response_format", "seed", "tools", "tool_choice", "parallel_tool_calls", "logprobs",
        "top_logprobs", "reasoning_effort", "functions", "function_call", "modalities", "audio",
        "prediction", "service_tier", "metadata",
    }
)  # fmt: skip
COMPLETION_PARAMS = frozenset(
    {
        "prompt", "temperature", "top_p", "n", "stream_options", "stop", "max_tokens",
        "presence_penalty", "frequency_penalty", "logit_bias", "user", "seed", "logprobs", "echo",
        "best_of", "suffix",
    }
)  # fmt: skip

_litellm: ModuleType | None = None


def load_litellm() -> ModuleType:
    """The litellm module, configured to stay offline."""
    global _litellm
    if _litellm is None:
        os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
        litellm = import_extra("litellm", "proxy")
        litellm.disable_hf_tokenizer_download = True
        litellm.disable_token_counter = True
        litellm.disable_streaming_logging = True
        litellm.suppress_debug_info = True
        _litellm = litellm
    return _litellm


def _split_params(body: dict[str, Any], known: frozenset[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("model", "stream"):
            continue
        (params if key in known else extra)[key] = value
    if extra:
        params["extra_body"] = extra
    return params


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in out:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def _unreachable(exc: BaseException) -> bool:
    """LiteLLM reports a refused connection as a 500: look for the transport error beneath it."""
    import openai

    return any(isinstance(e, openai.APIConnectionError) for e in _chain(exc))


def _timed_out(exc: BaseException) -> bool:
    import openai

    return any(isinstance(e, openai.APITimeoutError | TimeoutError) for e in _chain(exc))


def _error_call(exc: Exception) -> UpstreamCall:
    status = getattr(exc, "status_code", None)
    message = str(getattr(exc, "message", "") or exc)
    if not isinstance(status, int) or status < 400:
        status = 502
    body = {"error": {"message": message, "type": type(exc).__name__, "param": None, "code": None}}
    return UpstreamCall(status=status, body=json.dumps(body).encode())


def _dump(obj: Any) -> dict[str, Any]:
    dumped = obj.model_dump(exclude_none=True) if hasattr(obj, "model_dump") else dict(obj)
    return dumped


async def _events(stream: Any) -> AsyncIterator[sse.Event]:
    async for chunk in stream:
        payload = _dump(chunk)
        raw = sse.encode(payload)
        yield sse.Event(raw, raw[6:-2].decode())
    yield sse.Event(sse.DONE_EVENT, sse.DONE)


class LiteLLMClient:
    """LiteLLM as the client library of OpenAI-dialect backends, with its retries."""

    def __init__(self, *, retries: int = 2, timeout: float = 600.0) -> None:
        self.retries = retries
        self.timeout = timeout

    async def close(self) -> None:
        """Close the HTTP clients LiteLLM cached for this event loop."""
        if _litellm is None:
            return
        await _litellm.close_litellm_async_clients()
        _litellm.in_memory_llm_clients_cache.flush_cache()

    async def open(
        self, backend: Backend, path: str, body: dict[str, Any], stream: bool, *, encoded: str
    ) -> UpstreamCall:
        """Call the backend through LiteLLM, which builds its own request from ``body`` (``encoded`` unused)."""
        litellm = load_litellm()
        chat = path == "chat/completions"
        call = litellm.acompletion if chat else litellm.atext_completion
        params = _split_params(body, CHAT_PARAMS if chat else COMPLETION_PARAMS)
        try:
            result = await call(
                model=f"openai/{backend.target_model}",
                api_base=backend.api_base,
                api_key=backend.api_key or "none",
                stream=stream,
                num_retries=self.retries,
                timeout=self.timeout,
                **params,
            )
        except Exception as exc:
            if _unreachable(exc):
                raise BackendUnreachable(f"{backend.api_base}: {exc}", timed_out=_timed_out(exc)) from None
            return _error_call(exc)
        if stream:
            return UpstreamCall(status=200, stream=_events(result), content_type="text/event-stream")
        return UpstreamCall(status=200, body=json.dumps(_dump(result)).encode())
