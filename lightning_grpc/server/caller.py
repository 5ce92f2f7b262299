"""The caller of the call being handled, as the access-control interceptor found it (see :mod:`.auth`).

The adapter and the receivers ask these functions; each does nothing when authentication is off.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_grpc.access import Principal, Role, Rule


class Checks(Protocol):
    """What a handler asks of access control (:class:`.auth.AccessControl` is the one)."""

    def authorize(self, call: Call, request: Any) -> None: ...

    def answer(self, call: Call, response: Any) -> None: ...

    def check_spans(self, call: Call, attempts: Iterable[tuple[str, str]]) -> None: ...

    def stand_in(self, call: Call, method: str) -> Call: ...


@dataclass(frozen=True)
class Call:
    """What the interceptor learned about a call, for its handler."""

    control: Checks
    principal: Principal
    method: str
    rule: Rule


#: The current call's caller; None when authentication is off.
CALLER: contextvars.ContextVar[Call | None] = contextvars.ContextVar("lightning_grpc_caller", default=None)


def current_call() -> Call | None:
    return CALLER.get()


def authorize_request(request: Any) -> None:
    """Called by the adapter before a unary or server-streaming handler runs."""
    call = CALLER.get()
    if call is not None:
        call.control.authorize(call, request)


async def authorized_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream whose every message is checked like a unary request."""
    call = CALLER.get()
    async for message in requests:
        if call is not None:
            call.control.authorize(call, message)
        yield message


def authorize_as(method: str, request: Any) -> Call | None:
    """Check one message of a stream that stands for a call of ``method`` (a RunnerSession's): its role and
    its request, as a call of ``method`` would be checked. Returns the call to answer it with
    (:func:`answer_as`); None when authentication is off."""
    call = CALLER.get()
    if call is None:
        return None
    stand_in = call.control.stand_in(call, method)
    stand_in.control.authorize(stand_in, request)
    return stand_in


def answer_as(stand_in: Call | None, response: Any) -> None:
    """Finish the answer to a message checked by :func:`authorize_as` (attempt credentials, secrets)."""
    if stand_in is not None:
        stand_in.control.answer(stand_in, response)


def answer(response: Any) -> None:
    call = CALLER.get()
    if call is not None:
        call.control.answer(call, response)


def authorize_spans(attempts: Iterable[tuple[str, str]]) -> None:
    """For writes whose spans name their own attempts (OTLP Export; span-level ids in AddSpans, AddSpansStream
    and CompleteAttempt): every attempt named must be the caller's."""
    call = CALLER.get()
    if call is not None:
        call.control.check_spans(call, attempts)


def attempt_of_caller() -> tuple[str, str]:
    """The attempt an attempt credential names (("", "") for any other caller): its spans' default attribution."""
    call = CALLER.get()
    if call is None or call.principal.role != Role.ATTEMPT:
        return "", ""
    return call.principal.rollout_id, call.principal.attempt_id
