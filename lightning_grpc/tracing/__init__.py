"""Tracing: spans of agents (and of the libraries they use) into the Store, per attempt."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from lightning_grpc.client.config import ClientConfig
from lightning_grpc.client.spans import SpanStreamer

from .context import AttemptContext, RolloutTraceIds, attempt_context, current_attempt, should_stop
from .emitters import (
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    operation,
    rollout_span,
)
from .processor import LightningSpanProcessor, span_to_message

_processor: LightningSpanProcessor | None = None


def install_tracing(
    target: str | ClientConfig | None = None,
    *,
    token: str | None = None,
    service_name: str = "lightning-runner",
) -> LightningSpanProcessor:
    """Send spans made anywhere in this process to the Store (idempotent; returns the one processor).

    Adds the process's :class:`LightningSpanProcessor` to the global SDK tracer provider (creating
    one when the process has none yet), so spans of instrumented libraries are captured too. With
    ``target`` (an address, or a :class:`~lightning_grpc.client.ClientConfig` with TLS and token), a
    streamer to that Store is opened (the first becomes the default destination).
    """
    global _processor
    if _processor is None:
        _processor = LightningSpanProcessor()
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            trace.set_tracer_provider(
                TracerProvider(
                    resource=Resource.create({"service.name": service_name}), id_generator=RolloutTraceIds()
                )
            )
            provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            raise RuntimeError("a tracer provider that is not the OpenTelemetry SDK's is installed globally")
        if type(provider.id_generator) is RandomIdGenerator:  # the SDK's default: rollouts get their trace id
            provider.id_generator = RolloutTraceIds()
        provider.add_span_processor(_processor)
    if target is not None:
        _processor.streamer_for(target, token)
    return _processor


__all__ = [
    "AttemptContext",
    "LightningSpanProcessor",
    "RolloutTraceIds",
    "SpanStreamer",
    "attempt_context",
    "current_attempt",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "install_tracing",
    "operation",
    "rollout_span",
    "should_stop",
    "span_to_message",
]
