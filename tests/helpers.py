"""Small builders shared by the tests."""

from __future__ import annotations

import itertools
import time
import uuid

from lightning_grpc.types import Span

_span_counter = itertools.count(1)


def make_span(
    name: str = "step", *, span_id: str | None = None, trace_id: str | None = None, **attributes: object
) -> Span:
    now = time.time_ns()
    return Span(
        trace_id=trace_id or uuid.uuid4().hex,
        span_id=span_id or f"{next(_span_counter):016x}",
        name=name,
        start_time_unix_nano=now,
        end_time_unix_nano=now + 1000,
        attributes=dict(attributes),
    )


def make_spans(n: int, name: str = "step", trace_id: str | None = None) -> list[Span]:
    trace = trace_id or uuid.uuid4().hex
    return [make_span(name, trace_id=trace, index=i) for i in range(n)]


def llm_call(
    prompt: list[int],
    response: list[int],
    *,
    logprobs: list[float] | None = None,
    version: int = 0,
    start_ns: int | None = None,
    **attributes: object,
) -> Span:
    """An LLM-call span as the proxy writes it (token ids as int arrays)."""
    from lightning_grpc import semconv

    span = make_span(semconv.SPAN_LLM_CALL, **attributes)
    span.attributes.update(
        {
            semconv.LLM_PROMPT_TOKEN_IDS: list(prompt),
            semconv.LLM_RESPONSE_TOKEN_IDS: list(response),
            semconv.LLM_POLICY_VERSION: version,
            semconv.LLM_MODEL: "policy",
        }
    )
    if logprobs is not None:
        span.attributes[semconv.LLM_RESPONSE_LOGPROBS] = list(logprobs)
    if start_ns is not None:
        span.start_time_unix_nano, span.end_time_unix_nano = start_ns, start_ns + 1000
    return span


def reward_span(value: float, *, start_ns: int | None = None) -> Span:
    from lightning_grpc import semconv

    span = make_span(semconv.SPAN_REWARD, **semconv.reward_attributes(value))
    if start_ns is not None:
        span.start_time_unix_nano, span.end_time_unix_nano = start_ns, start_ns + 1000
    return span
