"""Opaque page tokens: a position plus a hash of the filters it belongs to."""

from __future__ import annotations

import base64
import hashlib
import heapq
import itertools
import json
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from lightning_grpc.errors import InvalidArgumentError

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def filter_hash(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_token(position: Any, filters: str) -> str:
    raw = json.dumps({"p": position, "f": filters}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def read_token(token: str, filters: str, field: str = "page_token") -> Any:
    """The position a token points at; INVALID_ARGUMENT when it is malformed or belongs to other filters."""
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        position, token_filters = data["p"], data["f"]
    except Exception:
        raise InvalidArgumentError(field, "is not a page token this store issued") from None
    if token_filters != filters:
        raise InvalidArgumentError(field, "was issued for a request with other filters")
    return position


def page_size(value: int, default: int = DEFAULT_PAGE_SIZE, maximum: int = MAX_PAGE_SIZE) -> int:
    if value < 0:
        raise InvalidArgumentError("page_size", f"must not be negative (got {value})")
    if value == 0:
        return default
    return min(value, maximum)


def keyset_page_of(
    rows: list[T], key: Callable[[T], tuple[Any, ...]], size: int, after: Any, descending: bool = False
) -> tuple[list[T], list[Any] | None]:
    """:func:`keyset_page` of ``rows`` in any order: only the page is sorted (the smallest keys after the
    cursor, or the largest when ``descending``), not every row."""
    if after is not None:
        rows = rows_after(rows, key, after, descending)
    pick = heapq.nlargest if descending else heapq.nsmallest
    top = pick(size + 1, rows, key=key)
    page = top[:size]
    return page, (list(key(page[-1])) if len(top) > size else None)


def keyset_page(
    rows: Iterable[T], key: Callable[[T], tuple[Any, ...]], size: int, after: Any, descending: bool = False
) -> tuple[list[T], list[Any] | None]:
    """The page of ``rows`` (coming in ``key`` order, largest first when ``descending``) that follows the
    cursor ``after``, reading ``rows`` only as far as the end of the page.

    A cursor is the key of the last row served, so rows that change or disappear between pages
    never make the next page skip or repeat others. Returns the page and the next cursor (None at the end).
    """
    if after is not None:
        position = _position(after)
        if descending:
            rows = itertools.dropwhile(lambda r: key(r) >= position, rows)
        else:
            rows = itertools.dropwhile(lambda r: key(r) <= position, rows)
    try:
        top = list(itertools.islice(rows, size + 1))
    except TypeError:  # a cursor whose parts do not compare with these keys
        raise InvalidArgumentError("page_token", "is not a page token this store issued") from None
    page = top[:size]
    return page, (list(key(page[-1])) if len(top) > size else None)


def _position(after: Any) -> tuple[Any, ...]:
    if not isinstance(after, list):
        raise InvalidArgumentError("page_token", "is not a page token this store issued")
    return tuple(after)


def rows_after(
    rows: list[T], key: Callable[[T], tuple[Any, ...]], after: Any, descending: bool = False
) -> list[T]:
    """The rows past the cursor ``after`` (the key of the last row served), in their order;
    INVALID_ARGUMENT naming ``page_token`` when ``after`` is no cursor of these rows' keys."""
    position = _position(after)
    try:
        return [r for r in rows if (key(r) < position if descending else key(r) > position)]
    except TypeError:
        raise InvalidArgumentError("page_token", "is not a page token this store issued") from None
