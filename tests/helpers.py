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
