"""How the clients read their arguments."""

from __future__ import annotations

from typing import Any, TypeVar

from lightning_grpc.errors import InvalidArgumentError

T = TypeVar("T")


def enum_member(kind: type[T], value: Any) -> T:
    """Accept an enum member, its number, or its name in any case ("succeeded", "SUCCEEDED")."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind[value.upper()]  # type: ignore[index,no-any-return]
        except KeyError:
            raise InvalidArgumentError(kind.__name__, f"{value!r} is not a {kind.__name__}") from None
    try:
        return kind(value)  # type: ignore[call-arg]
    except ValueError:
        return value  # type: ignore[no-any-return]  # an unknown number: the server answers INVALID_ARGUMENT
