"""The one error table: reasons, status codes and the retry decision, on both sides of the wire."""

from __future__ import annotations

import pytest

from lightning_grpc.errors import (
    ERROR_CLASSES,
    TRANSPARENT_RETRY_CODES,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    Reason,
    ResourceExhaustedError,
    UnavailableError,
    error_from_status,
)


def test_reasons_compare_equal_to_their_wire_strings() -> None:
    err = NotFoundError("rollout ro-1 not found", reason=Reason.ROLLOUT_NOT_FOUND)
    assert err.reason == "ROLLOUT_NOT_FOUND" == Reason.ROLLOUT_NOT_FOUND
    assert type(err.reason) is str  # what travels in ErrorInfo is the plain string


def test_every_class_has_a_default_reason_in_the_enum() -> None:
    for cls in ERROR_CLASSES:
        assert Reason(cls.default_reason).value == cls.code_name


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (UnavailableError("the server is shutting down", reason=Reason.SHUTTING_DOWN), True),
        (DeadlineExceededError("too slow"), True),
        (ResourceExhaustedError("the store is full", reason=Reason.STORE_MEMORY_FULL), True),
        (ResourceExhaustedError("span s1 is too large", reason=Reason.SPAN_TOO_LARGE), False),
        (NotFoundError("no rollout ro-1", reason=Reason.ROLLOUT_NOT_FOUND), False),
        (InvalidArgumentError("spans[0].span_id", "must be 16 hex digits"), False),
    ],
)
def test_the_retry_decision_survives_the_wire(error: Exception, transient: bool) -> None:
    assert error.transient is transient  # type: ignore[attr-defined]
    rebuilt = error_from_status(error.code_name, error.message, error.reason, error.metadata)  # type: ignore[attr-defined]
    assert type(rebuilt) is type(error)
    assert rebuilt.transient is transient
    assert rebuilt.reason == error.reason  # type: ignore[attr-defined]


def test_grpc_retries_on_its_own_only_what_no_server_took() -> None:
    assert TRANSPARENT_RETRY_CODES == ("UNAVAILABLE",)
