"""Token ids and log-probs as numpy arrays, and prefix tests on them (no per-token Python loops)."""

from __future__ import annotations

from typing import Any

import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)
EMPTY_IDS = np.empty(0, dtype=np.int32)


def token_ids_from(value: Any) -> np.ndarray | None:
    """A list of non-negative ints as an int32 array; an empty array for an empty list; None when the
    value is missing or is not such a list."""
    if value is None or isinstance(value, str | bytes | dict):
        return None
    if isinstance(value, list | tuple) and not value:
        return EMPTY_IDS
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        return None
    if array.size and (int(array.min()) < 0 or int(array.max()) > INT32_MAX):
        return None
    return array.astype(np.int32, copy=False)


def logprobs_from(value: Any, length: int) -> np.ndarray | None:
    """Finite log-probs, one per response token, as a float32 array; None when they are missing, not
    numbers, not finite, or not ``length`` long."""
    if value is None or isinstance(value, str | bytes | dict):
        return None
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if array.ndim != 1 or array.size != length or not np.isfinite(array).all():
        return None
    return array.astype(np.float32)


def starts_with(ids: np.ndarray, *parts: np.ndarray) -> bool:
    """Whether ``ids`` begins with the concatenation of ``parts``, token for token."""
    offset = 0
    for part in parts:
        end = offset + len(part)
        if end > len(ids) or not np.array_equal(ids[offset:end], part):
            return False
        offset = end
    return True


def first_difference(ids: np.ndarray, expected: np.ndarray) -> int | None:
    """The first position where ``ids`` does not begin with ``expected`` (``len(ids)`` when ``ids`` ends
    first), or None when it begins with all of it."""
    shared = min(len(ids), len(expected))
    differing = np.flatnonzero(ids[:shared] != expected[:shared])
    if differing.size:
        return int(differing[0])
    return None if len(ids) >= len(expected) else shared
