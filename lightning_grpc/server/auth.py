"""Access control on the server: who is calling (the interceptor), and whether the call is theirs (the adapter).

The table is :data:`lightning_grpc.access.RULES`; this module enforces it, and nothing else does.

- :class:`AuthInterceptor` reads the ``authorization`` metadata of every call but health and reflection,
  refuses a missing, wrong or expired credential with UNAUTHENTICATED and a method that has no rule or
  does not allow the caller's role with PERMISSION_DENIED, and runs the call's handler with the caller in
  :data:`~.caller.CALLER`.
- The adapter (:mod:`.adapter`) then asks :meth:`AccessControl.authorize` about the request, before the
  servicer sees it, and :meth:`AccessControl.answer` about the response: attempt credentials are attached,
  secrets blanked for every role but admin.
- A runner credential owns the attempts its worker holds; an attempt credential owns one attempt while it
  runs. Both are read from the store's state in memory (no I/O).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from lightning_grpc.access import (
    CLAIM_RULE,
    OPEN_PREFIXES,
    STORE_SERVICE,
    Credentials,
    Principal,
    Role,
    Scope,
    attempt_credential_ttl,
    refuse_attempt,
    refuse_role,
    rule_for,
)
from lightning_grpc.errors import LightningError, PermissionDeniedError, Reason, UnauthenticatedError
from lightning_grpc.store import Store

from .caller import CALLER, Call
from .status import status_for


class AccessControl:
    """Enforces :data:`~lightning_grpc.access.RULES` for one server.

    ``store`` is the Store the server hosts (None for a server hosting only the proxy): runner
    credentials are checked against the workers its attempts belong to, attempt credentials against
    whether the attempt still runs.
    """

    def __init__(self, credentials: Credentials, store: Store | None = None) -> None:
        self.credentials = credentials
        self.store = store

    # ------------------------------------------------------------------ who, and which RPC
    def admit(self, method: str, authorization: str | bytes | None) -> Call:
        principal = self.credentials.principal(authorization)
        return self._admitted(principal, method, method.rsplit("/", 1)[-1])

    def stand_in(self, call: Call, method: str) -> Call:
        """The call of ``method`` (a StoreService RPC's name) that one message of ``call``'s stream stands for
        (a RunnerSession's), admitted as that call would be; its request is then checked by :meth:`authorize`."""
        return self._admitted(
            call.principal, f"/{STORE_SERVICE}/{method}", f"{method} (in {call.method.rsplit('/', 1)[-1]})"
        )

    def _admitted(self, principal: Principal, method: str, what: str) -> Call:
        """``principal``'s call of ``method`` (its path), if its rule allows the role; ``what`` names it in a refusal."""
        rule = rule_for(method)
        if rule is None:
            raise PermissionDeniedError(f"{method} is not a method this server serves to anyone")
        if not rule.allows(principal.role):
            raise refuse_role(principal, what)
        if principal.role == Role.ATTEMPT:  # an ended attempt's credential no longer works, for any call
            self._check_still_running(
                principal
            )  # (a stream's message: it may have ended since the stream opened)
        return Call(self, principal, method, rule)

    # ------------------------------------------------------------------ whose
    def authorize(self, call: Call, request: Any) -> None:
        """Refuse a request that names a worker, rollout or attempt the caller does not own."""
        principal, scope = call.principal, call.rule.scope
        if principal.role == Role.ADMIN:
            return
        if call.rule.claims_by and request.HasField(call.rule.claims_by):
            self.check_claim(principal, getattr(request, call.rule.claims_by), call.rule.claims_by)
        if scope in (Scope.NONE, Scope.SPANS):
            return
        if scope == Scope.WORKER:
            self.check_worker(principal, request.worker_id)
        elif scope == Scope.ATTEMPT:
            self.check_attempt(principal, request.rollout_id, request.attempt_id)
        elif scope == Scope.ROLLOUT:
            self.check_rollout(principal, request.rollout_id)

    def check_worker(self, principal: Principal, worker_id: str) -> None:
        if principal.role == Role.RUNNER and worker_id == principal.worker_id:
            return
        raise PermissionDeniedError(
            f"{principal.describe()} may act only as worker {principal.worker_id or '(none)'}, "
            f"not as worker {worker_id or '(empty)'}; set worker_id to the credential's worker",
            reason=Reason.WRONG_WORKER,
            workerId=worker_id,
        )

    def check_claim(self, principal: Principal, claim: Any, field: str) -> None:
        """A dequeue made inside another call (``field``) is checked as DequeueRollouts itself is."""
        if not CLAIM_RULE.allows(principal.role):
            raise refuse_role(principal, f"DequeueRollouts (through {field})")
        self.check_worker(principal, claim.worker_id)

    def check_attempt(self, principal: Principal, rollout_id: str, attempt_id: str) -> None:
        if principal.role == Role.ADMIN:
            return
        if principal.role == Role.ATTEMPT:
            if (rollout_id, attempt_id) != (principal.rollout_id, principal.attempt_id):
                raise refuse_attempt(principal, rollout_id, attempt_id)
            return  # whether it still runs was checked when the call was admitted
        attempt = self.store.find_attempt(rollout_id, attempt_id) if self.store is not None else None
        if attempt is None and self.store is not None:
            return  # the store answers NOT_FOUND, as it would to the admin
        if attempt is None or attempt.worker_id != principal.worker_id:
            raise refuse_attempt(principal, rollout_id, attempt_id)

    def check_rollout(self, principal: Principal, rollout_id: str) -> None:
        if principal.role == Role.ATTEMPT:
            if rollout_id != principal.rollout_id:
                raise refuse_attempt(principal, rollout_id, "(any)")
            return
        if principal.role == Role.RUNNER and self.store is not None:
            latest = self.store.find_latest_attempt(rollout_id)
            if latest is None and self.store.rollout_status(rollout_id) is None:
                return  # unknown: NOT_FOUND from the store
            if latest is not None and latest.worker_id == principal.worker_id:
                return
        raise refuse_attempt(principal, rollout_id, "(latest)")

    def check_spans(self, call: Call, attempts: Iterable[tuple[str, str]]) -> None:
        """Every (rollout id, attempt id) a span write names must be the caller's (before anything is stored)."""
        if call.principal.role == Role.ADMIN:
            return
        for rollout_id, attempt_id in set(attempts):
            self.check_attempt(call.principal, rollout_id, attempt_id)

    def _check_still_running(self, principal: Principal) -> None:
        if self.store is None:
            return
        attempt = self.store.find_attempt(principal.rollout_id, principal.attempt_id)
        if attempt is not None and not attempt.status.is_active:
            raise UnauthenticatedError(
                f"the credential of attempt {principal.attempt_id} expired when the attempt ended "
                f"({attempt.status.name.lower()})",
                reason=Reason.CREDENTIAL_EXPIRED,
                attemptId=principal.attempt_id,
            )

    # ------------------------------------------------------------------ answers
    def answer(self, call: Call, response: Any) -> None:
        """Attach attempt credentials to a dequeue or start answer; blank secrets for non-admins."""
        rule = call.rule
        if rule.credentials_in:
            for rollout in _rollouts_in(response, rule.credentials_in):
                self._attach_credential(rollout)
        if rule.redacts_secrets and call.principal.role != Role.ADMIN:
            redact_secrets(response)

    def _attach_credential(self, rollout: Any) -> None:
        attempt = rollout.latest_attempt
        if not attempt.attempt_id or attempt.status not in _ACTIVE_PB:
            return
        timeout = rollout.config.timeout.seconds if rollout.config.HasField("timeout") else None
        attempt.credential = self.credentials.attempt(
            rollout.rollout_id, attempt.attempt_id, ttl=attempt_credential_ttl(timeout)
        )


_ACTIVE_PB = (1, 2)  # ATTEMPT_STATUS_PREPARING, ATTEMPT_STATUS_RUNNING


def _rollouts_in(response: Any, field: str) -> Iterable[Any]:
    """The rollouts a response holds in ``field`` (one, or a repeated field)."""
    held = getattr(response, field)
    return held if response.DESCRIPTOR.fields_by_name[field].is_repeated else (held,)


def redact_secrets(response: Any) -> None:
    """Blank every ``api_key`` of the resources in a GetResources/GetLatestResources/ListResources answer."""
    updates = response.resources
    for update in (
        updates if hasattr(updates, "__len__") and not hasattr(updates, "resources") else (updates,)
    ):
        for resource in update.resources.values():
            kind = resource.WhichOneof("kind")
            if kind in ("llm", "proxy_llm"):
                getattr(resource, kind).api_key = ""


# ---------------------------------------------------------------------- the interceptor


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call but health and reflection, and checks its method's role."""

    def __init__(self, control: AccessControl) -> None:
        self.control = control

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        method = details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        supplied: str | bytes | None = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                supplied = value
                break
        try:
            call = self.control.admit(method, supplied)
        except LightningError as exc:
            return _refusing(await continuation(details), exc)
        handler = await continuation(details)
        return _as_caller(handler, call) if handler is not None else None


def _as_caller(handler: grpc.RpcMethodHandler[Any, Any], call: Call) -> grpc.RpcMethodHandler[Any, Any]:
    """The handler, run with :data:`CALLER` set to ``call`` inside the handler itself."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary or handler.stream_unary:
        behaviour: Any = handler.unary_unary or handler.stream_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            CALLER.set(call)
            return await behaviour(request, context)

        make = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary
            else grpc.stream_unary_rpc_method_handler
        )
        return make(unary, **kw)
    streaming: Any = handler.unary_stream or handler.stream_stream

    async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        CALLER.set(call)
        async for message in streaming(request, context):
            yield message

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.unary_stream
        else grpc.stream_stream_rpc_method_handler
    )
    return make(stream, **kw)


def _refusing(
    handler: grpc.RpcMethodHandler[Any, Any] | None, error: LightningError
) -> grpc.RpcMethodHandler[Any, Any]:
    status = status_for(error)

    async def refuse_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(status)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(status)
        yield  # pragma: no cover

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse_unary)
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse_unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse_unary, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)


def interceptors_for(token: str | None, store: Store | None) -> list[grpc.aio.ServerInterceptor]:
    """The server's interceptors: none without a token (local use), else access control."""
    if not token:
        return []
    return [AuthInterceptor(AccessControl(Credentials(token), store))]


__all__ = ["AccessControl", "AuthInterceptor", "interceptors_for", "redact_secrets"]
