"""The engine's errors: what a client gets as ``{"error": {message, type, param, code}}`` with a status.

Apart from :mod:`.protocol` so that the request checks of every module (``protocol``, ``tools``) share them
without importing each other.
"""

from __future__ import annotations

from typing import Any, ClassVar


class EngineError(Exception):
    """An error the client gets as ``{"error": {message, type, param, code}}`` with ``status``."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        503: "ServiceUnavailable",
    }

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> EngineError:
    return EngineError(message, status=400, param=param)
