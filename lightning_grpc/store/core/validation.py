"""The pure checks of the store core: each refuses a malformed argument with InvalidArgumentError,
naming the field, and touches no state."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.types import (
    RETRYABLE_ATTEMPT_STATUSES,
    AttemptStatus,
    Resource,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
)

from .. import rows
from .limits import MAX_ATTEMPTS_LIMIT, MAX_WAIT_SECONDS

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


def check_id(value: str, field: str) -> None:
    if not _ID_RE.fullmatch(value):
        raise InvalidArgumentError(
            field,
            "must be 1-128 characters of letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
        )


def check_worker_id(value: str, field: str = "worker_id") -> None:
    """Worker ids are optional; a given one follows the id syntax."""
    if value:
        check_id(value, field)


def check_config(
    config: RolloutConfig, field: str, timeout_rule: Callable[[float, str], None]
) -> RolloutConfig:
    for name in ("timeout", "unresponsive_timeout"):
        value = getattr(config, name)
        if value is not None:
            timeout_rule(value, f"{field}.{name}")
    if config.max_attempts < 0 or config.max_attempts > MAX_ATTEMPTS_LIMIT:
        raise InvalidArgumentError(
            f"{field}.max_attempts",
            f"must be between 0 and {MAX_ATTEMPTS_LIMIT} (got {config.max_attempts})",
        )
    retry_on = []
    for i, status in enumerate(config.retry_on):
        if status not in RETRYABLE_ATTEMPT_STATUSES:
            got = status.name if isinstance(status, AttemptStatus) else repr(status)
            raise InvalidArgumentError(
                f"{field}.retry_on[{i}]", f"must be FAILED, TIMEOUT or UNRESPONSIVE (got {got})"
            )
        if status not in retry_on:
            retry_on.append(status)
    return replace(config, max_attempts=max(1, config.max_attempts), retry_on=tuple(retry_on))


def check_mode(mode: int, field: str) -> RolloutMode:
    try:
        return RolloutMode(mode)
    except ValueError:
        raise InvalidArgumentError(field, f"is not a rollout mode (got {mode})") from None


def check_metadata(metadata: Any, field: str) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidArgumentError(field, "must be an object")
    check_json(metadata, field)
    return metadata


def check_limit(value: int, field: str, maximum: int) -> None:
    if value < 0 or value > maximum:
        raise InvalidArgumentError(field, f"must be between 0 and {maximum} (got {value})")


def rollout_statuses(statuses: Iterable[int], field: str = "statuses") -> set[RolloutStatus]:
    """A filter's rollout statuses, each a known one."""
    wanted = set()
    for i, s in enumerate(statuses):
        try:
            wanted.add(RolloutStatus(s))
        except ValueError:
            raise InvalidArgumentError(f"{field}[{i}]", f"is not a rollout status (got {s})") from None
    return wanted


def check_wait(seconds: float | None, field: str) -> float:
    if seconds is None:
        return 0.0
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_WAIT_SECONDS:
        raise InvalidArgumentError(field, f"must be between 0 and {MAX_WAIT_SECONDS:.0f} s (got {seconds})")
    return seconds


def check_resources(resources: dict[str, Resource], field: str = "resources") -> None:
    if len(resources) > 1000:
        raise InvalidArgumentError(field, "must hold at most 1000 entries")
    for name, resource in resources.items():
        if not name or len(name) > 256:
            raise InvalidArgumentError(f"{field}[{name[:40]!r}]", "names must be 1-256 characters")
        check_json(rows.resource_to_dict(resource), f"{field}[{name!r}]")


def check_timeout(seconds: float, field: str) -> None:
    """A rollout timeout is a finite, positive number of seconds."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgumentError(field, f"must be a positive number of seconds (got {seconds:g} s)")


def check_json(value: Any, field: str, depth: int = 0) -> None:
    """JSON values must be finite and not absurdly deep (they are stored and echoed as JSON)."""
    if depth > 64:
        raise InvalidArgumentError(field, "is nested more than 64 levels deep")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(field, f"must hold finite numbers only (got {value})")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json(v, f"{field}.{k}" if len(field) < 200 else field, depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_json(v, f"{field}[{i}]" if len(field) < 200 else field, depth + 1)
