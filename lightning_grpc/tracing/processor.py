"""An OpenTelemetry span processor that sends finished spans to the Store, per attempt.

At span start it stamps the attempt of the running code (from :mod:`.context`) on the span as
attributes, so a span started inside a rollout is attributed to it even if it ends after the
rollout's context is gone, and spans from instrumented libraries inside the agent are attributed
like the agent's own. At span end it converts the span
(:func:`lightning_grpc.convert.spans.otel_span_to_pb`) and hands it to the span shipper
(:class:`lightning_grpc.client.spans.SpanStreamer`), which sends it to the Store.
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from lightning_grpc import logs, semconv
from lightning_grpc.client.config import ClientConfig
from lightning_grpc.client.spans import SpanStreamer
from lightning_grpc.convert.spans import otel_span_to_pb

from .context import current_attempt

log = logs.get_logger(__name__)

#: The SDK span conversion, under the name this package gave it.
span_to_message = otel_span_to_pb


class LightningSpanProcessor(SpanProcessor):
    """Routes finished spans to the Store of their attempt; spans outside any rollout are counted and skipped.

    One processor serves the whole process. Each Store address gets one :class:`SpanStreamer`;
    runners register which streamer an attempt's spans go to (:meth:`route`); spans of an attempt
    nobody registered (for example ids set by hand) go to the default streamer.
    """

    def __init__(self) -> None:
        self.streamers: dict[str, SpanStreamer] = {}
        self.default: SpanStreamer | None = None
        self.routes: dict[str, SpanStreamer] = {}
        self.unattributed = 0

    def streamer_for(self, target: str | ClientConfig, token: str | None = None) -> SpanStreamer:
        """The streamer to a Store (an address, or a client configuration with TLS and token), created on
        first use; the first one becomes the default."""
        config = target if isinstance(target, ClientConfig) else ClientConfig(target=target, token=token)
        streamer = self.streamers.get(config.target)
        if streamer is None:
            streamer = self.streamers[config.target] = SpanStreamer(config, log=log)
        if self.default is None:
            self.default = streamer
        return streamer

    def route(self, attempt_id: str, streamer: SpanStreamer) -> None:
        self.routes[attempt_id] = streamer

    def unroute(self, attempt_id: str) -> None:
        self.routes.pop(attempt_id, None)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        ctx = current_attempt()
        if ctx is None:
            return
        attributes = span.attributes or {}
        if semconv.ROLLOUT_ID not in attributes:
            span.set_attribute(semconv.ROLLOUT_ID, ctx.rollout_id)
            span.set_attribute(semconv.ATTEMPT_ID, ctx.attempt_id)

    def on_end(self, span: ReadableSpan) -> None:
        rollout_id, attempt_id = semconv.attribution(span.attributes or {})
        if not (rollout_id and attempt_id) and span.resource is not None:
            rollout_id, attempt_id = semconv.attribution(span.resource.attributes)
        streamer = self.routes.get(attempt_id) or self.default
        if not (rollout_id and attempt_id) or streamer is None:
            self.unattributed += 1
            return
        try:
            payload = otel_span_to_pb(span, rollout_id, attempt_id).SerializeToString()
        except Exception as exc:  # a span we cannot convert must not break the agent
            log.warning("event=span_not_converted name=%s error=%r", span.name, exc)
            return
        streamer.submit(rollout_id, attempt_id, payload)

    def shutdown(self) -> None:
        for streamer in self.streamers.values():
            streamer.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return all(s.flush(timeout=timeout_millis / 1000) for s in self.streamers.values())
