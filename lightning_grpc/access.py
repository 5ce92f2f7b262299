"""Who may call what: the three roles, their credentials, and the one table of every RPC and proxy route.

With a token configured (``lightning-grpc serve --token``), every call names a credential:

- **admin**: the server's token itself. Algorithms, trainers, operators, the proxy: every RPC.
- **runner**: a credential bound to one worker id (:meth:`Credentials.runner`, or
  ``lightning-grpc credentials runner``). It dequeues and claims rollouts under that worker id, beats
  that worker, and reports the attempts that worker holds (heartbeats, spans, outcome). Nothing else.
- **attempt**: a credential bound to one attempt, minted by the Store when the attempt starts and sent
  back with it (``Attempt.credential`` in the answers of DequeueRollouts, StartAttempt and StartRollout).
  It writes that attempt's spans (OTLP included), heartbeats it, reports its outcome, and is the API key
  of its LLM calls on the proxy. It stops working when the attempt ends.

Credentials are signed, not stored: ``lgc1.<claims>.<signature>``, the claims base64url JSON, the
signature HMAC-SHA256 under a key derived from the admin token. Any process that holds the admin token
(the Store, a proxy started with the same token) checks a credential with no Store round trip, and a
new admin token revokes every credential minted under the old one.

:data:`RULES` is the table: for each RPC, the roles allowed and what the call is scoped by. The server
enforces it in one place (:mod:`lightning_grpc.server.auth`), the proxy's HTTP side by
:data:`PROXY_ROUTES`. Health and (when enabled) reflection are open on purpose.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from lightning_grpc.errors import PermissionDeniedError, Reason, UnauthenticatedError


class Role(StrEnum):
    ADMIN = "admin"
    RUNNER = "runner"
    ATTEMPT = "attempt"


CREDENTIAL_PREFIX = "lgc1"
#: An attempt credential outlives its rollout's timeout by this much; it stops earlier, when the attempt ends.
ATTEMPT_CREDENTIAL_SLACK = 3600.0
#: ... and lasts at least this long when the rollout has no timeout.
ATTEMPT_CREDENTIAL_TTL = 24 * 3600.0
_KEY_LABEL = b"lightning-grpc credential signing key v1"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the role, and the worker or attempt its credential is bound to."""

    role: Role
    worker_id: str = ""
    rollout_id: str = ""
    attempt_id: str = ""
    #: Unix time after which the credential is refused; 0: never.
    expires: float = 0.0

    def describe(self) -> str:
        if self.role == Role.RUNNER:
            return f"the runner credential of worker {self.worker_id}"
        if self.role == Role.ATTEMPT:
            return f"the credential of attempt {self.attempt_id} (rollout {self.rollout_id})"
        return "the admin token"


ADMIN = Principal(Role.ADMIN)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def credential_claims(credential: str) -> dict[str, Any] | None:
    """The claims of a credential, read without checking its signature (None when it is not one).

    For a client's convenience only (a runner learns its worker id from its credential); the server
    trusts nothing it has not verified.
    """
    parts = credential.split(".")
    if len(parts) != 3 or parts[0] != CREDENTIAL_PREFIX:
        return None
    try:
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, binascii.Error):
        return None
    return claims if isinstance(claims, dict) else None


class Credentials:
    """Mints and checks credentials under the key derived from the admin token."""

    def __init__(self, admin_token: str, *, clock: Callable[[], float] = time.time) -> None:
        if not admin_token:
            raise ValueError("credentials need the admin token")
        self._admin = f"Bearer {admin_token}".encode()
        self._key = hmac.new(admin_token.encode(), _KEY_LABEL, hashlib.sha256).digest()
        self._clock = clock
        self._verified: dict[str, Principal] = {}

    # ------------------------------------------------------------------ minting
    def runner(self, worker_id: str, ttl: float | None = None) -> str:
        """A runner credential for ``worker_id``, valid for ``ttl`` seconds (None: until the admin token changes)."""
        if not worker_id:
            raise ValueError("a runner credential needs a worker id")
        return self._mint({"role": Role.RUNNER.value, "worker_id": worker_id}, ttl)

    def attempt(self, rollout_id: str, attempt_id: str, ttl: float = ATTEMPT_CREDENTIAL_TTL) -> str:
        """An attempt credential (the Store mints one when the attempt starts)."""
        if not rollout_id or not attempt_id:
            raise ValueError("an attempt credential needs a rollout id and an attempt id")
        claims = {"role": Role.ATTEMPT.value, "rollout_id": rollout_id, "attempt_id": attempt_id}
        return self._mint(claims, ttl)

    def _mint(self, claims: dict[str, Any], ttl: float | None) -> str:
        if ttl is not None:
            claims["exp"] = int(self._clock() + ttl) + 1
        body = f"{CREDENTIAL_PREFIX}.{_b64(json.dumps(claims, separators=(',', ':')).encode())}"
        return f"{body}.{_b64(self._sign(body))}"

    def _sign(self, body: str) -> bytes:
        return hmac.new(self._key, body.encode(), hashlib.sha256).digest()

    # ------------------------------------------------------------------ checking
    def principal(self, authorization: str | bytes | None) -> Principal:
        """Who an ``authorization`` value (``Bearer <token or credential>``) names.

        Raises :class:`UnauthenticatedError` (reason BAD_TOKEN or CREDENTIAL_EXPIRED).
        """
        if isinstance(authorization, bytes):
            authorization = authorization.decode("utf-8", "replace")
        if not authorization:
            raise UnauthenticatedError(
                "missing bearer token; send 'authorization: Bearer <admin token or credential>'",
                reason=Reason.BAD_TOKEN,
            )
        if hmac.compare_digest(authorization.encode(), self._admin):
            return ADMIN
        found = self._verified.get(authorization)
        if found is None:
            found = self._verify(authorization)
            if len(self._verified) >= 10_000:
                self._verified.clear()
            self._verified[authorization] = found
        if found.expires and self._clock() > found.expires:
            raise UnauthenticatedError("the credential has expired", reason=Reason.CREDENTIAL_EXPIRED)
        return found

    def _verify(self, authorization: str) -> Principal:
        scheme, _, credential = authorization.partition(" ")
        wrong = UnauthenticatedError(
            "wrong bearer token: neither the admin token nor a credential signed under it",
            reason=Reason.BAD_TOKEN,
        )
        body, _, signature = credential.rpartition(".")
        if scheme.lower() != "bearer" or not body.startswith(CREDENTIAL_PREFIX + "."):
            raise wrong
        try:
            if not hmac.compare_digest(_unb64(signature), self._sign(body)):
                raise wrong
        except (ValueError, binascii.Error):
            raise wrong from None
        claims = credential_claims(credential) or {}
        try:
            role = Role(str(claims.get("role")))
            principal = Principal(
                role,
                worker_id=str(claims.get("worker_id", "")),
                rollout_id=str(claims.get("rollout_id", "")),
                attempt_id=str(claims.get("attempt_id", "")),
                expires=float(claims.get("exp", 0)),
            )
        except (ValueError, TypeError):
            raise wrong from None
        if role == Role.ADMIN:  # the admin role is the token itself, never a signed credential
            raise wrong
        return principal


# ---------------------------------------------------------------------- the table


class Scope(Enum):
    """What a call is about, which a runner or attempt credential must own."""

    #: Nothing beyond the role.
    NONE = "none"
    #: The request's ``worker_id``: a runner's own.
    WORKER = "worker"
    #: The request's ``rollout_id`` and ``attempt_id``: the attempt's own, or an attempt of the runner's worker;
    #: so are the ids each span of the request names (checked by the servicer once it has read them).
    ATTEMPT = "attempt"
    #: The request's ``rollout_id``: the attempt's rollout, or one whose latest attempt is the runner's worker's.
    ROLLOUT = "rollout"
    #: The spans' attribution, checked by the receiver once it has read it (OTLP Export).
    SPANS = "spans"


@dataclass(frozen=True)
class Rule:
    roles: frozenset[Role]
    scope: Scope = Scope.NONE
    #: Secrets (``api_key``) in the answer are blanked for every role but admin.
    redacts_secrets: bool = False
    #: The field of the answer holding the rollouts whose active attempts get their attempt credentials
    #: (``rollout`` or ``rollouts``, a repeated field); empty: none.
    credentials_in: str = ""
    #: A field of the request that, when set, claims rollouts as a DequeueRollouts request does (checked
    #: by DequeueRollouts' rule: its roles, and the worker id it names).
    claims_by: str = ""

    def allows(self, role: Role) -> bool:
        return role in self.roles


def _rule(*roles: Role, **options: Any) -> Rule:
    return Rule(frozenset(roles), **options)


_A, _R, _T = Role.ADMIN, Role.RUNNER, Role.ATTEMPT
ADMIN_ONLY = _rule(_A)

STORE_SERVICE = "lightning.v1.StoreService"
TRAINER_SERVICE = "lightning.v1.TrainerService"
PROXY_SERVICE = "lightning.v1.ProxyService"
OTLP_TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"

_STORE: dict[str, Rule] = {
    "StartRollout": _rule(_A, credentials_in="rollout"),
    "EnqueueRollouts": ADMIN_ONLY,
    "DequeueRollouts": _rule(_A, _R, scope=Scope.WORKER, credentials_in="rollouts"),
    "StartAttempt": _rule(_A, _R, scope=Scope.WORKER, credentials_in="rollout"),
    "UpdateRollout": ADMIN_ONLY,
    "CancelRollout": ADMIN_ONLY,
    "RetryRollout": ADMIN_ONLY,
    "GetRollout": _rule(_A, _R, _T, scope=Scope.ROLLOUT),
    "ListRollouts": ADMIN_ONLY,
    "GetLatestAttempt": _rule(_A, _R, _T, scope=Scope.ROLLOUT),
    "ListAttempts": ADMIN_ONLY,
    "HeartbeatAttempt": _rule(_A, _R, _T, scope=Scope.ATTEMPT),
    # ``dequeue_next`` claims the next rollouts as DequeueRollouts does: runners for their own worker only
    "CompleteAttempt": _rule(
        _A, _R, _T, scope=Scope.ATTEMPT, claims_by="dequeue_next", credentials_in="next_rollouts"
    ),
    # every message is checked by the rule of the RPC it stands for (SESSION_CALLS), and answered as it is
    "RunnerSession": _rule(_A, _R, _T),
    "AddSpans": _rule(_A, _R, _T, scope=Scope.ATTEMPT),
    "AddSpansStream": _rule(_A, _R, _T, scope=Scope.ATTEMPT),
    "ListSpans": ADMIN_ONLY,
    "TailSpans": ADMIN_ONLY,
    "GetNextSpanSequenceId": _rule(_A, _R, _T, scope=Scope.ATTEMPT),
    "AddResources": ADMIN_ONLY,
    "UpdateResources": ADMIN_ONLY,
    "GetResources": _rule(_A, _R, _T, redacts_secrets=True),
    "GetLatestResources": _rule(_A, _R, _T, redacts_secrets=True),
    "ListResources": ADMIN_ONLY,
    "HeartbeatWorker": _rule(_A, _R, scope=Scope.WORKER),
    "GetWorker": ADMIN_ONLY,
    "ListWorkers": ADMIN_ONLY,
    "WaitForRollouts": ADMIN_ONLY,
    "WatchRollouts": ADMIN_ONLY,
    "GetStatistics": ADMIN_ONLY,
    "DeleteRollouts": ADMIN_ONLY,
}
_TRAINER = dict.fromkeys(
    ("SubmitGroups", "GetBatch", "ReportStep", "WatchTraining", "GetTrainerStatus", "GetTriplets"), ADMIN_ONLY
)
_PROXY: dict[str, Rule] = {
    **dict.fromkeys(
        ("SetBackends", "ListBackends", "Pause", "Resume", "Drain", "GetProxyStatus"), ADMIN_ONLY
    ),
    "GetAttemptEndpoint": _rule(_A, _T, scope=Scope.ATTEMPT),
}
_OTLP = {"Export": _rule(_A, _R, _T, scope=Scope.SPANS)}

#: Every RPC of every service the server hosts, by its full method path (``/package.Service/Method``).
RULES: dict[str, Rule] = {
    f"/{service}/{method}": rule
    for service, table in (
        (STORE_SERVICE, _STORE),
        (TRAINER_SERVICE, _TRAINER),
        (PROXY_SERVICE, _PROXY),
        (OTLP_TRACE_SERVICE, _OTLP),
    )
    for method, rule in table.items()
}

#: Methods anyone may call, credential or not.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

#: The proxy's HTTP routes (method, path pattern): who may call them. ``None``: open.
#: A completion route is scoped by its attempt: an attempt credential only for its own attempt (on a bare
#: route, the credential names the attempt); the admin token for any.
PROXY_ROUTES: dict[tuple[str, str], frozenset[Role] | None] = {
    ("GET", "/health"): None,
    **{
        (verb, f"{prefix}/v1/{path}"): frozenset({_A, _T})
        for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt_id}")
        for verb, path in (
            ("POST", "chat/completions"),
            ("POST", "completions"),
            ("POST", "responses"),
            ("POST", "messages"),
            ("GET", "models"),
        )
    },
}


def rule_for(method: str) -> Rule | None:
    return RULES.get(method)


#: The RPCs a RunnerSession message can stand for: the message's ``call`` field -> the RPC's name. Each message
#: is checked by its RPC's rule, as a call of that RPC would be.
SESSION_CALLS: dict[str, str] = {
    "dequeue_rollouts": "DequeueRollouts",
    "heartbeat_attempt": "HeartbeatAttempt",
    "complete_attempt": "CompleteAttempt",
}

#: The rule a request that claims rollouts inside another call (:attr:`Rule.claims_by`) is checked by.
CLAIM_RULE = RULES[f"/{STORE_SERVICE}/DequeueRollouts"]


def refuse_role(principal: Principal, what: str) -> PermissionDeniedError:
    return PermissionDeniedError(
        f"{principal.describe()} may not call {what}", reason=Reason.ROLE_NOT_ALLOWED, role=principal.role
    )


def refuse_attempt(principal: Principal, rollout_id: str, attempt_id: str) -> PermissionDeniedError:
    return PermissionDeniedError(
        f"{principal.describe()} may not act on attempt {attempt_id} of rollout {rollout_id}",
        reason=Reason.WRONG_ATTEMPT if principal.role == Role.ATTEMPT else Reason.WRONG_WORKER,
        rolloutId=rollout_id,
        attemptId=attempt_id,
    )


def attempt_credential_ttl(timeout: float | None) -> float:
    """How long an attempt credential is minted for, given its rollout's timeout."""
    return max(ATTEMPT_CREDENTIAL_TTL, (timeout or 0.0) + ATTEMPT_CREDENTIAL_SLACK)


__all__ = [
    "ADMIN",
    "CLAIM_RULE",
    "OPEN_PREFIXES",
    "PROXY_ROUTES",
    "RULES",
    "SESSION_CALLS",
    "Credentials",
    "Principal",
    "Role",
    "Rule",
    "Scope",
    "credential_claims",
]
