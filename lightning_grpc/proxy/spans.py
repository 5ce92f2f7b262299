"""The span the proxy writes for each LLM call (:data:`lightning_grpc.semconv.SPAN_LLM_CALL`)."""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from lightning_grpc import semconv
from lightning_grpc.types import Span

from .backends import Backend
from .capture import Capture, Kind

_DEFAULT_DIALECT = {"chat": semconv.DIALECT_CHAT_COMPLETIONS, "completion": semconv.DIALECT_COMPLETIONS}
SPAN_KIND_CLIENT = 3
STATUS_OK = 1
STATUS_ERROR = 2
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def trace_context(traceparent: str | None) -> tuple[str, str]:
    """(trace id, parent span id) from a W3C ``traceparent`` header, else a new trace."""
    match = _TRACEPARENT.match((traceparent or "").strip().lower())
    if match and set(match.group(1)) != {"0"} and set(match.group(2)) != {"0"}:
        return match.group(1), match.group(2)
    return secrets.token_hex(16), ""


@dataclass
class CallRecord:
    """One call as the proxy saw it, from admission to the end of its response."""

    kind: Kind
    model_name: str
    backend: Backend
    request: dict[str, Any]
    streamed: bool
    start_time_unix_nano: int
    rollout_id: str = ""
    attempt_id: str = ""
    trace_id: str = field(default_factory=lambda: secrets.token_hex(16))
    parent_span_id: str = ""
    span_id: str = field(default_factory=lambda: secrets.token_hex(8))
    end_time_unix_nano: int = 0
    latency_ms: float = 0.0
    http_status: int = 0
    header_policy_version: int | None = None
    error: str = ""
    #: What the agent is told of the error, when that differs from ``error`` (which goes to the span and
    #: the log): never the backend's address.
    agent_error: str = ""
    #: The body of an error answer (when the backend answered one).
    error_body: Any = None
    capture: Capture | None = None
    #: The API shape the agent spoke (:data:`lightning_grpc.semconv.LLM_DIALECTS`), and its request as sent
    #: when that was translated (``request`` is then the chat request the backend got).
    dialect: str = ""
    dialect_request: dict[str, Any] | None = None
    _request_json: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capture is None:
            self.capture = Capture(self.kind)

    def request_json(self) -> str:
        """``request`` as compact JSON, encoded once: the body a backend is sent and the span's attribute."""
        if self._request_json is None:
            self._request_json = _json(self.request)
        return self._request_json

    @property
    def recorded(self) -> bool:
        return bool(self.rollout_id and self.attempt_id)

    def policy_version(self) -> int:
        assert self.capture is not None
        for version in (self.capture.policy_version, self.header_policy_version):
            if version is not None:
                return version
        return self.backend.policy_version


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def llm_call_span(rec: CallRecord) -> Span:
    cap = rec.capture
    assert cap is not None
    attrs: dict[str, Any] = {
        semconv.LLM_MODEL: rec.model_name,
        semconv.LLM_BACKEND: rec.backend.api_base,
        semconv.LLM_POLICY_VERSION: rec.policy_version(),
        semconv.LLM_REQUEST: rec.request_json(),
        semconv.LLM_STREAMED: rec.streamed,
        semconv.LLM_LATENCY_MS: float(rec.latency_ms),
        # what the engine sampled with: the request it got (a dialect's translated to chat), defaults filled in
        **semconv.sampling_attributes(rec.request),
    }
    attrs[semconv.LLM_DIALECT] = rec.dialect or _DEFAULT_DIALECT[rec.kind]
    if rec.dialect_request is not None:
        attrs[semconv.LLM_DIALECT_REQUEST] = _json(rec.dialect_request)
    response = cap.response()
    if response is None and rec.error_body is not None:
        response = rec.error_body
    if response is not None:
        attrs[semconv.LLM_RESPONSE] = cap.body_json or _json(
            response
        )  # the body's own text when there is one
    if cap.prompt_token_ids is not None:
        attrs[semconv.LLM_PROMPT_TOKEN_IDS] = cap.prompt_token_ids
    if cap.response_token_ids is not None:
        attrs[semconv.LLM_RESPONSE_TOKEN_IDS] = cap.response_token_ids
    if cap.forced_positions is not None and cap.response_token_ids is not None:
        attrs[semconv.LLM_RESPONSE_FORCED_POSITIONS] = cap.forced_positions
    if cap.logprobs is not None and all(math.isfinite(x) for x in cap.logprobs):
        attrs[semconv.LLM_RESPONSE_LOGPROBS] = [float(x) for x in cap.logprobs]
    if cap.response_id:
        attrs[semconv.LLM_RESPONSE_ID] = cap.response_id
    if cap.finish_reason:
        attrs[semconv.LLM_FINISH_REASON] = cap.finish_reason
    prompt_tokens, completion_tokens = cap.usage_counts()
    if prompt_tokens is not None:
        attrs[semconv.LLM_USAGE_PROMPT_TOKENS] = prompt_tokens
    if completion_tokens is not None:
        attrs[semconv.LLM_USAGE_COMPLETION_TOKENS] = completion_tokens
    if rec.error:
        attrs[semconv.LLM_ERROR] = rec.error
    return Span(
        trace_id=rec.trace_id,
        span_id=rec.span_id,
        parent_span_id=rec.parent_span_id,
        name=semconv.SPAN_LLM_CALL,
        rollout_id=rec.rollout_id,
        attempt_id=rec.attempt_id,
        kind=SPAN_KIND_CLIENT,
        start_time_unix_nano=rec.start_time_unix_nano,
        end_time_unix_nano=rec.end_time_unix_nano,
        status_code=STATUS_ERROR if rec.error else STATUS_OK,
        status_message=rec.error,
        attributes=attrs,
    )
