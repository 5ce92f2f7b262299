"""Emit rewards, messages, objects, exceptions, annotations and operations as spans.

They use the global OpenTelemetry tracer provider (the runner installs one that sends to the
Store), so they work the same from agent code, library code, sync or async functions.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar, overload

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from lightning_grpc import semconv

from .context import root_trace_id

F = TypeVar("F", bound=Callable[..., Any])
_TRACER_NAME = "lightning_grpc"


def _tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME)


def _emit(name: str, attributes: Mapping[str, Any], ok: bool = True) -> None:
    with _tracer().start_as_current_span(name, attributes=dict(attributes)) as span:
        if ok:
            span.set_status(Status(StatusCode.OK))


@contextmanager
def rollout_span(rollout_id: str, attempt_id: str, sequence_number: int) -> Iterator[trace.Span]:
    """The root span of one attempt, current while the agent runs: one rollout is one trace.

    Every span the agent makes (operations, rewards, instrumented libraries) is under it, and every
    attempt of the rollout takes the rollout's trace id (:func:`semconv.rollout_trace_id`).
    """
    attributes: dict[str, str | int] = {
        semconv.ROLLOUT_ID: rollout_id,
        semconv.ATTEMPT_ID: attempt_id,
        semconv.ATTEMPT_SEQUENCE_NUMBER: sequence_number,
    }
    with root_trace_id(semconv.rollout_trace_id(rollout_id)):
        span = _tracer().start_span(semconv.SPAN_ROLLOUT, attributes=attributes)
    with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        yield span


def emit_reward(
    reward: float | Mapping[str, float],
    *,
    primary: str | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Record a reward: a number, or several named dimensions with ``primary`` naming the one to train on.

    Returns the dimensions as stored (float64, read back exactly).
    """
    attrs = semconv.reward_attributes(reward, primary)
    _emit(semconv.SPAN_REWARD, {**(attributes or {}), **attrs})
    return semconv.read_reward(attrs) or {}


def emit_message(text: str, attributes: Mapping[str, Any] | None = None) -> None:
    _emit(semconv.SPAN_MESSAGE, {**(attributes or {}), **semconv.message_attributes(text)}, ok=False)


def emit_object(obj: Any, attributes: Mapping[str, Any] | None = None) -> None:
    _emit(semconv.SPAN_OBJECT, {**(attributes or {}), **semconv.object_attributes(obj)})


def emit_exception(exc: BaseException, attributes: Mapping[str, Any] | None = None) -> None:
    attrs = {
        semconv.EXCEPTION_TYPE: type(exc).__name__,
        semconv.EXCEPTION_MESSAGE: str(exc),
        semconv.EXCEPTION_STACKTRACE: "".join(traceback.format_exception(exc)),
    }
    with _tracer().start_as_current_span(
        semconv.SPAN_EXCEPTION, attributes={**(attributes or {}), **attrs}
    ) as span:
        span.set_status(Status(StatusCode.ERROR, str(exc)))


def emit_annotation(annotation: Mapping[str, Any], *, tags: list[str] | None = None) -> None:
    """Free key/values (nested data is flattened into dotted attributes), optionally tagged."""
    attrs: dict[str, Any] = {}
    for key, value in annotation.items():
        attrs.update(semconv.flatten(str(key), value))
    attrs.update(semconv.tag_attributes(tags or []))
    _emit(semconv.SPAN_ANNOTATION, attrs)


class Operation:
    """The span of an operation; ``set_input``/``set_output`` record its data."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def set_input(self, *args: Any, **kwargs: Any) -> None:
        for i, value in enumerate(args):
            self._set(f"{semconv.OPERATION_INPUT}.args.{i}", value)
        for key, value in kwargs.items():
            self._set(f"{semconv.OPERATION_INPUT}.{key}", value)

    def set_output(self, value: Any) -> None:
        self._set(semconv.OPERATION_OUTPUT, value)

    def _set(self, prefix: str, value: Any) -> None:
        for key, v in semconv.flatten(prefix, value).items():
            self.span.set_attribute(key, v)


@contextmanager
def _operation_span(name: str, attributes: Mapping[str, Any]) -> Iterator[Operation]:
    attrs = {semconv.OPERATION_NAME: name, **attributes}
    with _tracer().start_as_current_span(
        semconv.SPAN_OPERATION, attributes=attrs, record_exception=True
    ) as span:
        op = Operation(span)
        yield op
        span.set_status(Status(StatusCode.OK))


@overload
def operation(fn: F, *, name: str | None = None, **attributes: Any) -> F: ...


@overload
def operation(
    fn: str | None = None, *, name: str | None = None, **attributes: Any
) -> _ContextOrDecorator: ...


def operation(
    fn: Callable[..., Any] | str | None = None, *, name: str | None = None, **attributes: Any
) -> Any:
    """Trace an operation with its inputs and output.

    As a decorator (sync or async; ``@operation``, ``@operation("search")`` or
    ``@operation(name="search")``) or as a context manager: ``with operation("search") as op:
    op.set_input(q); ...; op.set_output(r)``. Exceptions are recorded on the span and re-raised.
    """
    if isinstance(fn, str):
        if name is not None and name != fn:
            raise TypeError(f"operation() got two names: {fn!r} and name={name!r}")
        return _ContextOrDecorator(fn, attributes)
    if fn is None:
        return _ContextOrDecorator(name, attributes)
    if not callable(fn):
        raise TypeError(f"operation() takes a name or a function, not {type(fn).__name__}")
    return _decorate(fn, name or fn.__name__, attributes)


def _decorate(fn: Callable[..., Any], op_name: str, attributes: Mapping[str, Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    def record_inputs(op: Operation, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            op.set_input(*args, **kwargs)
            return
        for key, value in bound.arguments.items():
            op._set(f"{semconv.OPERATION_INPUT}.{key}", value)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            with _operation_span(op_name, attributes) as op:
                record_inputs(op, args, kwargs)
                result = await fn(*args, **kwargs)
                op.set_output(result)
                return result

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _operation_span(op_name, attributes) as op:
            record_inputs(op, args, kwargs)
            result = fn(*args, **kwargs)
            op.set_output(result)
            return result

    return wrapper


class _ContextOrDecorator:
    """``operation(name=...)``: usable as ``with`` block or as a decorator."""

    def __init__(self, name: str | None, attributes: Mapping[str, Any]) -> None:
        self.name = name
        self.attributes = dict(attributes)
        self._cm: Any = None

    def __call__(self, fn: F) -> F:
        return _decorate(fn, self.name or fn.__name__, self.attributes)  # type: ignore[return-value]

    def __enter__(self) -> Operation:
        self._cm = _operation_span(self.name or "operation", self.attributes)
        return self._cm.__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> bool | None:
        return self._cm.__exit__(*exc)  # type: ignore[no-any-return]
