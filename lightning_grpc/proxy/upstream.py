"""Calls to the model backends.

Two ways out, behind one interface (:class:`UpstreamCall`):

- vLLM-dialect backends (vLLM, the embedded engine) are called directly (:mod:`.http1`) and their
  bytes are passed through as they come. LiteLLM is *not* used for them (the trap of Agent
  Lightning issue #262, checked against the engine by ``tests/proxy/test_proxy.py`` on litellm 1.106.2):
  its vLLM provider (``hosted_vllm/``) still drops the top-level ``prompt_token_ids`` and
  ``policy_version`` from streamed chunks; its generic ``openai/`` route keeps them today, but
  re-serializes every response (non-streamed ``choices[].token_ids`` move into
  ``provider_specific_fields``, the last chunk is split, ``created`` is rewritten), so capture
  through it would hang on LiteLLM internals that have already regressed once. A direct relay is
  byte-exact and adds no latency to the first token.
- Every other OpenAI-compatible backend goes through LiteLLM (:mod:`.litellm_client`).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_grpc import logs

from . import sse
from .backends import Backend
from .http1 import HTTP1Client, Response

log = logs.get_logger(__name__)

#: Statuses worth another try before anything reached the agent.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
POLICY_VERSION_HEADER = "x-policy-version"


class BackendUnreachable(Exception):
    """No response came back from the backend (connection refused, reset, or timed out)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


async def _nothing() -> None:
    return None


@dataclass
class UpstreamCall:
    """A backend's answer: a whole body, or (status 200, streaming) a stream of events."""

    status: int
    body: bytes = b""
    stream: AsyncIterator[sse.Event] | None = None
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    close: Callable[[], Awaitable[None]] = _nothing

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def text(self) -> str | None:
        """The body as UTF-8 text (None when it is not)."""
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def policy_version(self) -> int | None:
        try:
            return int(self.headers[POLICY_VERSION_HEADER])
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 2
    initial_backoff: float = 0.25
    max_backoff: float = 4.0

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after:
            try:
                return min(float(retry_after), self.max_backoff)
            except ValueError:
                pass
        base: float = min(self.initial_backoff * 2**attempt, self.max_backoff)
        return base * random.uniform(0.75, 1.25)


def _auth(backend: Backend) -> dict[str, str]:
    return {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}


class DirectClient:
    """Client of vLLM-dialect backends (:mod:`.http1`): no reshaping, real streaming, retries before the first
    byte."""

    def __init__(
        self,
        retry: RetryPolicy | None = None,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self._http = HTTP1Client(
            connect_timeout=connect_timeout, read_timeout=read_timeout, keepalive_timeout=30
        )

    async def close(self) -> None:
        await self._http.close()

    async def open(
        self, backend: Backend, path: str, body: dict[str, Any], stream: bool, *, encoded: str
    ) -> UpstreamCall:
        """POST ``body``, given as its JSON text ``encoded`` (the caller records that same text), to the backend."""
        url = f"{backend.api_base}/{path}"
        data = encoded.encode()
        headers = {**_auth(backend), "Content-Type": "application/json"}
        attempt = 0
        while True:
            try:
                resp = await self._http.post(url, data, headers)
            except (OSError, TimeoutError) as exc:
                if attempt >= self.retry.retries:
                    timed_out = isinstance(exc, TimeoutError)
                    raise BackendUnreachable(
                        f"{url}: {type(exc).__name__}: {exc}".rstrip(": "), timed_out=timed_out
                    ) from None
                await asyncio.sleep(self.retry.delay(attempt))
                attempt += 1
                continue
            if resp.status in RETRY_STATUSES and attempt < self.retry.retries:
                retry_after = resp.headers.get("retry-after")
                resp.close()
                log.info(
                    "event=proxy_backend_retry url=%s status=%d attempt=%d", url, resp.status, attempt + 1
                )
                await asyncio.sleep(self.retry.delay(attempt, retry_after))
                attempt += 1
                continue
            return await self._answer(resp, stream)

    @staticmethod
    async def _answer(resp: Response, stream: bool) -> UpstreamCall:
        version = resp.headers.get(POLICY_VERSION_HEADER)
        headers = {POLICY_VERSION_HEADER: version} if version is not None else {}
        content_type = resp.headers.get("content-type", "application/json")
        is_sse = content_type.startswith("text/event-stream")
        if resp.status == 200 and stream and is_sse:

            async def close() -> None:
                resp.close()  # drops the connection unless the stream ended: the backend stops generating

            return UpstreamCall(
                status=200,
                stream=sse.events(resp.chunks()),
                content_type=content_type,
                headers=headers,
                close=close,
            )
        try:
            body = await resp.read()
        except (OSError, TimeoutError) as exc:
            raise BackendUnreachable(f"{resp.url}: response cut short: {exc!r}") from None
        return UpstreamCall(status=resp.status, body=body, content_type=content_type, headers=headers)
