"""The one typed error hierarchy of lightning-grpc.

The core raises these; the server maps each class to a gRPC status code and a
``google.rpc.ErrorInfo`` (reason + domain) through :data:`STATUS_OF`; the client reverses the
reason back into the same class. Messages are for developers and never carry a traceback.
"""

from __future__ import annotations

import enum
from typing import ClassVar

#: The ErrorInfo domain of every error this project raises. Part of the contract.
ERROR_DOMAIN = "lightning-grpc.dev"


class Reason(enum.StrEnum):
    """Every ErrorInfo reason this project sends: the stable, machine-readable part of an error.

    Members compare equal to their strings, so ``error.reason == Reason.ROLLOUT_NOT_FOUND`` holds
    whether the error was raised here or rebuilt by a client from the wire.
    """

    # one per status code: the reason when nothing more precise applies
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"
    #: the dashboard's gateway: a path that names no procedure, or a streaming form browsers cannot use
    UNIMPLEMENTED = "UNIMPLEMENTED"
    # the store
    ROLLOUT_NOT_FOUND = "ROLLOUT_NOT_FOUND"
    ROLLOUT_ALREADY_EXISTS = "ROLLOUT_ALREADY_EXISTS"
    ROLLOUT_FINISHED = "ROLLOUT_FINISHED"
    ROLLOUT_NOT_FINISHED = "ROLLOUT_NOT_FINISHED"
    ATTEMPT_NOT_FOUND = "ATTEMPT_NOT_FOUND"
    ATTEMPT_ALREADY_ENDED = "ATTEMPT_ALREADY_ENDED"
    ATTEMPT_STILL_ACTIVE = "ATTEMPT_STILL_ACTIVE"
    RESOURCES_NOT_FOUND = "RESOURCES_NOT_FOUND"
    RESOURCES_ALREADY_EXIST = "RESOURCES_ALREADY_EXIST"
    RESOURCES_VERSION_MISMATCH = "RESOURCES_VERSION_MISMATCH"
    WORKER_NOT_FOUND = "WORKER_NOT_FOUND"
    RESUME_TOKEN_EXPIRED = "RESUME_TOKEN_EXPIRED"
    SEQUENCE_IDS_EXHAUSTED = "SEQUENCE_IDS_EXHAUSTED"
    SPAN_TOO_LARGE = "SPAN_TOO_LARGE"
    STORE_MEMORY_FULL = "STORE_MEMORY_FULL"
    STORE_OUT_OF_SPACE = "STORE_OUT_OF_SPACE"
    STORAGE_FAILED = "STORAGE_FAILED"
    #: the store's database server (PostgreSQL) is out of reach: UNAVAILABLE, retried; nothing acknowledged lost
    DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
    #: another server took the writer lease of the store's database: this one writes nothing and stops
    NOT_THE_WRITER = "NOT_THE_WRITER"
    STORE_CLOSED = "STORE_CLOSED"
    # the server and its clients
    SHUTTING_DOWN = "SHUTTING_DOWN"
    BAD_TOKEN = "BAD_TOKEN"
    CREDENTIAL_EXPIRED = "CREDENTIAL_EXPIRED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    ROLE_NOT_ALLOWED = "ROLE_NOT_ALLOWED"
    WRONG_WORKER = "WRONG_WORKER"
    WRONG_ATTEMPT = "WRONG_ATTEMPT"
    STORE_UNREACHABLE = "STORE_UNREACHABLE"
    # the proxy
    ATTEMPT_FINISHED = "ATTEMPT_FINISHED"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    NO_BACKENDS = "NO_BACKENDS"


#: Reasons that make an error worth retrying although its status code alone does not: the
#: in-memory store frees room as rollouts are deleted, and a disk gets space back, so a write refused
#: for either can succeed later.
TRANSIENT_REASONS: frozenset[str] = frozenset({Reason.STORE_MEMORY_FULL, Reason.STORE_OUT_OF_SPACE})


class LightningError(Exception):
    """Base class. ``reason`` is the stable ErrorInfo reason; ``metadata`` repeats the ids."""

    code_name: ClassVar[str] = "UNKNOWN"
    default_reason: ClassVar[str] = "UNKNOWN"
    #: Whether an error of this class is worth retrying as such (the same request may succeed later).
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, reason: str | None = None, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = str(reason or self.default_reason)
        self.metadata = {k: str(v) for k, v in metadata.items()}

    @property
    def transient(self) -> bool:
        """Whether sending the same request again may succeed: the one retry-or-give-up decision.

        Every sender (span stream, OTLP receiver, proxy recorder, runner) asks this and nothing else.
        """
        return self.retryable or self.reason in TRANSIENT_REASONS

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason}: {self.message})"


class NotFoundError(LightningError):
    """An id names nothing the store has."""

    code_name = "NOT_FOUND"
    default_reason = "NOT_FOUND"


class InvalidArgumentError(LightningError):
    """A request field is malformed. ``field`` names it, for example ``rollouts[2].config.max_attempts``."""

    code_name = "INVALID_ARGUMENT"
    default_reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str, *, reason: str | None = None, **metadata: str) -> None:
        if len(field) > 150:  # a field path built from a huge key; message and metadata name the same text
            field = field[:149] + "…"
        super().__init__(f"{field}: {message}", reason=reason, field=field, **metadata)
        self.field = field


class FailedPreconditionError(LightningError):
    """The request is well formed but the state does not allow it (an illegal transition)."""

    code_name = "FAILED_PRECONDITION"
    default_reason = "FAILED_PRECONDITION"


class AlreadyExistsError(LightningError):
    """A caller-supplied id is taken by something different."""

    code_name = "ALREADY_EXISTS"
    default_reason = "ALREADY_EXISTS"


class AbortedError(LightningError):
    """A concurrent change won (for example an expected version did not match)."""

    code_name = "ABORTED"
    default_reason = "ABORTED"


class ResourceExhaustedError(LightningError):
    """A size or memory limit was reached."""

    code_name = "RESOURCE_EXHAUSTED"
    default_reason = "RESOURCE_EXHAUSTED"


class OutOfRangeError(LightningError):
    """A token or position lies outside what the store keeps."""

    code_name = "OUT_OF_RANGE"
    default_reason = "OUT_OF_RANGE"


class UnauthenticatedError(LightningError):
    """The bearer token is missing or wrong."""

    code_name = "UNAUTHENTICATED"
    default_reason = "UNAUTHENTICATED"


class PermissionDeniedError(LightningError):
    """The credential is valid but does not allow this call (another role's RPC, another worker or attempt)."""

    code_name = "PERMISSION_DENIED"
    default_reason = "PERMISSION_DENIED"


class UnavailableError(LightningError):
    """The service cannot answer now (shutting down, storage busy); retrying may succeed."""

    code_name = "UNAVAILABLE"
    default_reason = "UNAVAILABLE"
    retryable = True


class DeadlineExceededError(LightningError):
    """The call's deadline passed before it finished."""

    code_name = "DEADLINE_EXCEEDED"
    default_reason = "DEADLINE_EXCEEDED"
    retryable = True


class InternalError(LightningError):
    """A bug in the server. Never used for a client's mistake."""

    code_name = "INTERNAL"
    default_reason = "INTERNAL"


ERROR_CLASSES: tuple[type[LightningError], ...] = (
    NotFoundError,
    InvalidArgumentError,
    FailedPreconditionError,
    AlreadyExistsError,
    AbortedError,
    ResourceExhaustedError,
    OutOfRangeError,
    UnauthenticatedError,
    PermissionDeniedError,
    UnavailableError,
    DeadlineExceededError,
    InternalError,
)

#: gRPC status code name of each error class: the one table both sides use.
STATUS_OF: dict[type[LightningError], str] = {cls: cls.code_name for cls in ERROR_CLASSES}

#: The reverse, for clients: status code name -> class (reasons refine the message, not the class).
CLASS_OF_STATUS: dict[str, type[LightningError]] = {cls.code_name: cls for cls in ERROR_CLASSES}

#: Status codes a gRPC client may retry on its own (service-config retry policy): only a server
#: that could not take the call at all. A deadline is the caller's budget, so not retried by gRPC.
#: They apply only to the rpcs the contract marks NO_SIDE_EFFECTS or IDEMPOTENT (client/config.py).
TRANSPARENT_RETRY_CODES: tuple[str, ...] = (UnavailableError.code_name,)


def error_from_status(code_name: str, message: str, reason: str, metadata: dict[str, str]) -> LightningError:
    """Rebuild the typed error a server raised, from its status code and ErrorInfo."""
    cls = CLASS_OF_STATUS.get(code_name, LightningError)
    if cls is InvalidArgumentError:
        field = metadata.get("field", "")
        err: LightningError = InvalidArgumentError.__new__(InvalidArgumentError)
        LightningError.__init__(err, message, reason=reason, **metadata)
        err.field = field  # type: ignore[attr-defined]
        return err
    other = metadata.copy()
    return cls(message, reason=reason, **other)
