"""The proxy's OpenAI-compatible HTTP side.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (OpenAI's Responses API),
``/v1/messages`` (Anthropic's Messages API), ``/v1/models``, and the same under
``/rollout/{rollout_id}/attempt/{attempt_id}``. The Responses and Messages dialects are translated to
chat completions and back (:mod:`.dialects`); every error a route answers, the access check's included,
has its dialect's shape. Only calls of a running attempt are recorded;
calls of an unknown attempt get 404, of a finished (or superseded, or cancelled) one 410, and
neither is recorded. The ``x-lightning-rollout-id`` and ``x-lightning-attempt-id`` headers attribute
a call without the prefix like the prefix does.

With a token (the Store's admin token, see :class:`~.core.ProxyConfig`), every route but ``/health``
takes a credential as its bearer token (the OpenAI client's API key; Anthropic's client sends its key as
``x-api-key``, taken when there is no ``Authorization``), per
:data:`lightning_grpc.access.PROXY_ROUTES`: an attempt's own credential, for that attempt only (a call
that names another attempt gets 403 and is not recorded; a call that names none is that attempt's),
or the admin token. Then calls that name no attempt are refused (403) unless the proxy is configured
with ``unattributed="forward"``; without a token they are forwarded unrecorded unless configured
with ``unattributed="refuse"``.

The end of a response (the body, or a stream's ``[DONE]``) is held until the call's span is in
the Store, up to ``record_wait`` seconds: an agent that has its answer can end its attempt
without racing the span.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lightning_grpc._extras import extra_imports

with extra_imports("proxy"):
    from aiohttp import web

from lightning_grpc import logs, semconv
from lightning_grpc.access import PROXY_ROUTES, Principal, Role
from lightning_grpc.errors import LightningError, NotFoundError
from lightning_grpc.logs import clip
from lightning_grpc.types import RolloutMode

from . import sse
from .attempts import KeepAlive, Refused
from .backends import Backend, BackendDialect
from .capture import Kind
from .core import ProxyCore
from .dialects import CHAT, COMPLETIONS, Dialect, DialectError, StreamTranslator, dialect_for_path
from .spans import CallRecord, llm_call_span, trace_context
from .upstream import BackendUnreachable, UpstreamCall

log = logs.get_logger(__name__)

#: Error messages to agents echo what they sent (a model name, ids) at most this long.
MAX_MESSAGE_CHARS = 1000
PATHS: dict[Kind, str] = {"chat": "chat/completions", "completion": "completions"}
#: The dialect routes besides chat and completions, all served by a chat-completions backend.
DIALECT_ROUTES = ("responses", "messages")
LOGPROB_MODES = (RolloutMode.TRAIN, RolloutMode.UNSPECIFIED)
PROXY_KEY: web.AppKey[ProxyCore] = web.AppKey("proxy", ProxyCore)
#: Where the access check leaves the caller of a request (absent: the proxy checks no credentials).
PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("principal", Principal)


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
    dialect: Dialect = CHAT,
    param: str | None = None,
) -> web.Response:
    """An error answer in ``dialect``'s shape; ``kind`` is OpenAI's error type (other dialects derive
    theirs from the status)."""
    body = dialect.error_body(status, code, clip(message, MAX_MESSAGE_CHARS), kind, param)
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def check_access(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Refuse a request whose credential its route does not take (see :data:`PROXY_ROUTES`)."""
    proxy = request.app[PROXY_KEY]
    credentials = proxy.credentials
    route = request.match_info.route.resource
    allowed = PROXY_ROUTES.get((request.method, route.canonical)) if route is not None else None
    if credentials is None or allowed is None:
        return await handler(request)
    dialect = dialect_for_path(request.path)
    try:
        principal = credentials.principal(_authorization(request))
    except LightningError as exc:
        proxy.refused_calls += 1
        return error_response(
            401, "invalid_api_key", exc.message, kind="authentication_error", dialect=dialect
        )
    if principal.role not in allowed:
        proxy.refused_calls += 1
        return error_response(
            403,
            "role_not_allowed",
            f"{principal.describe()} may not call the proxy",
            kind="permission_error",
            dialect=dialect,
        )
    named = _named_attempt(request)
    if (
        principal.role == Role.ATTEMPT
        and any(named)
        and named != (principal.rollout_id, principal.attempt_id)
    ):
        proxy.refused_calls += 1
        return error_response(
            403,
            "wrong_attempt",
            f"{principal.describe()} may not call for attempt {named[1] or '(none)'} "
            f"of rollout {named[0] or '(none)'}",
            kind="permission_error",
            dialect=dialect,
        )
    request[PRINCIPAL] = principal
    return await handler(request)


def _authorization(request: web.Request) -> str | None:
    """The credential of a request: its ``Authorization`` header, else Anthropic's ``x-api-key`` (as a bearer
    token), since the Anthropic SDK sends its API key only there."""
    authorization = request.headers.get("Authorization")
    key = request.headers.get("x-api-key")
    if authorization is None and key:
        return f"Bearer {key}"
    return authorization


def _named_attempt(request: web.Request) -> tuple[str, str]:
    """The (rollout id, attempt id) a request names by its path or its headers."""
    info, headers = request.match_info, request.headers
    return (
        info.get("rollout_id") or headers.get(semconv.ROLLOUT_ID_HEADER) or "",
        info.get("attempt_id") or headers.get(semconv.ATTEMPT_ID_HEADER) or "",
    )


def build_app(proxy: ProxyCore) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[check_access])
    app[PROXY_KEY] = proxy
    for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt_id}"):
        app.router.add_post(f"{prefix}/v1/chat/completions", _chat)
        app.router.add_post(f"{prefix}/v1/completions", _completion)
        for route in DIALECT_ROUTES:
            app.router.add_post(f"{prefix}/v1/{route}", _dialect_call)
        app.router.add_get(f"{prefix}/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


async def _health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY_KEY]
    return web.json_response(
        {"status": "paused" if proxy.paused else "serving", "in_flight": proxy.in_flight}
    )


async def _models(request: web.Request) -> web.Response:
    proxy = request.app[PROXY_KEY]
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "lightning-grpc"}
        for name in proxy.table.model_names()
    ]
    return web.json_response({"object": "list", "data": data})


async def _chat(request: web.Request) -> web.StreamResponse:
    return await Call(request.app[PROXY_KEY], request, "chat").run()


async def _completion(request: web.Request) -> web.StreamResponse:
    return await Call(request.app[PROXY_KEY], request, "completion", COMPLETIONS).run()


async def _dialect_call(request: web.Request) -> web.StreamResponse:
    """A call in a translated dialect (Responses, Messages): a chat call to the backend."""
    return await Call(request.app[PROXY_KEY], request, "chat", dialect_for_path(request.path)).run()


def rewrite(body: dict[str, Any], backend: Backend, kind: Kind, mode: RolloutMode) -> dict[str, Any]:
    """The body sent to the backend: its model name; for vLLM-dialect backends token ids, and
    log-probs for train rollouts (mode unset counts as train). Nothing the agent asked for is removed."""
    out = dict(body)
    out["model"] = backend.target_model
    if backend.dialect != BackendDialect.VLLM:
        return out
    out["return_token_ids"] = True
    if mode in LOGPROB_MODES:
        if kind == "chat" and not out.get("logprobs"):
            out["logprobs"] = True
        elif kind == "completion" and out.get("logprobs") is None:
            out["logprobs"] = 0
    return out


def _error_message(body: Any, fallback: str) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
        if isinstance(err, str):
            return err
    return fallback


class Call:
    """One request to a completion route, from admission to its recorded span."""

    def __init__(self, proxy: ProxyCore, request: web.Request, kind: Kind, dialect: Dialect = CHAT) -> None:
        self.proxy = proxy
        self.request = request
        self.kind = kind
        self.dialect = dialect
        #: The request as the agent sent it, when its dialect is translated.
        self.dialect_request: dict[str, Any] | None = None
        self.rollout_id, self.attempt_id = _named_attempt(request)
        principal: Principal | None = request.get(PRINCIPAL)
        if principal is not None and principal.role == Role.ATTEMPT and not self.attempt_id:
            # an attempt credential on a bare route: the call is that attempt's
            self.rollout_id, self.attempt_id = principal.rollout_id, principal.attempt_id

    async def run(self) -> web.StreamResponse:
        proxy = self.proxy
        if proxy.paused:
            proxy.refused_calls += 1
            return self._paused()
        proxy.enter()  # before any await, so that a Drain after Pause sees this call
        try:
            return await self._admitted()
        finally:
            proxy.leave()

    def _paused(self) -> web.Response:
        wait = self.proxy.retry_after
        headers = {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(int(wait * 1000))}
        reason = f" ({self.proxy.pause_reason})" if self.proxy.pause_reason else ""
        return self._error(
            429,
            "proxy_paused",
            f"the proxy is paused{reason}; retry later",
            "rate_limit_error",
            headers=headers,
        )

    def _error(
        self,
        status: int,
        code: str,
        message: str,
        kind: str = "invalid_request_error",
        *,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> web.Response:
        """An error answer in this call's dialect."""
        return error_response(
            status, code, message, kind=kind, headers=headers, dialect=self.dialect, param=param
        )

    async def _admitted(self) -> web.StreamResponse:
        try:
            body = await self.request.json()
        except (ValueError, UnicodeDecodeError):
            return self._error(400, "invalid_json", "the request body is not JSON")
        if not isinstance(body, dict):
            return self._error(400, "invalid_json", "the request body must be a JSON object")
        if self.dialect.translates:
            try:
                body, self.dialect_request = self.dialect.to_chat(body), body
            except DialectError as exc:
                return self._error(exc.status, exc.code, exc.message, param=exc.param)
            except Exception as exc:  # LiteLLM's translation choking on a shape the checks let through
                log.info("event=proxy_dialect_untranslatable dialect=%s error=%r", self.dialect.name, exc)
                return self._error(400, "invalid_request", f"the request could not be translated: {exc}")
        try:
            model_name = self.proxy.table.resolve_model(str(body.get("model") or ""))
        except NotFoundError as exc:
            return self._error(404, "model_not_found", exc.message, param="model")
        if not (self.rollout_id and self.attempt_id):
            if self.rollout_id or self.attempt_id:
                return self._refuse(
                    Refused(400, "invalid_attempt", "a call needs both a rollout id and an attempt id")
                )
            if self.proxy.refuses_unattributed:
                return self._refuse(
                    Refused(403, "attempt_required", "call through /rollout/{id}/attempt/{id}/v1")
                )
            return await self._forward(body, model_name, RolloutMode.UNSPECIFIED)
        assert self.proxy.gate is not None
        try:
            mode = await self.proxy.gate.admit(self.rollout_id, self.attempt_id)
        except Refused as refusal:
            return self._refuse(refusal)
        return await self._forward(body, model_name, mode)

    def _refuse(self, refusal: Refused) -> web.Response:
        self.proxy.refused_calls += 1
        headers = {"Retry-After": str(math.ceil(refusal.retry_after))} if refusal.retry_after else None
        log.info(
            "event=proxy_call_refused rollout_id=%s attempt_id=%s status=%d code=%s",
            self.rollout_id,
            self.attempt_id,
            refusal.status,
            refusal.code,
        )
        return self._error(refusal.status, refusal.code, refusal.message, refusal.kind, headers=headers)

    # ------------------------------------------------------------ forwarding
    async def _forward(self, body: dict[str, Any], model_name: str, mode: RolloutMode) -> web.StreamResponse:
        proxy = self.proxy
        try:
            backend = proxy.table.pick(model_name, self.rollout_id)
        except NotFoundError as exc:  # the backends changed while the call was being admitted
            return self._error(404, "model_not_found", exc.message, param="model")
        streamed = bool(body.get("stream"))
        trace_id, parent = trace_context(self.request.headers.get("traceparent"))
        rec = CallRecord(
            kind=self.kind,
            model_name=model_name,
            backend=backend,
            request=rewrite(body, backend, self.kind, mode),
            streamed=streamed,
            start_time_unix_nano=time.time_ns(),
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            trace_id=trace_id,
            parent_span_id=parent,
            dialect=self.dialect.name,
            dialect_request=self.dialect_request,
        )
        stats = proxy.table.stats[backend.api_base]
        stats.calls += 1
        stats.in_flight += 1
        proxy.total_calls += 1
        keepalive = self._keepalive()
        started = time.monotonic()
        try:
            return await self._exchange(rec, started)
        except asyncio.CancelledError:
            rec.error = rec.error or "the call was cancelled (the proxy is shutting down)"
            self._account(rec, started)
            if rec.recorded and proxy.recorder is not None:
                proxy.recorder.submit(llm_call_span(rec))
            raise
        finally:
            stats.in_flight -= 1
            if keepalive is not None:
                keepalive.cancel()

    def _keepalive(self) -> KeepAlive | None:
        if not (self.rollout_id and self.attempt_id) or self.proxy.gate is None:
            return None
        interval = self.proxy.config.heartbeat_interval
        return self.proxy.gate.keep_alive(self.rollout_id, self.attempt_id, interval)

    async def _exchange(self, rec: CallRecord, started: float) -> web.StreamResponse:
        client = self.proxy.client_for(rec.backend)
        try:
            upstream = await client.open(
                rec.backend, PATHS[self.kind], rec.request, rec.streamed, encoded=rec.request_json()
            )
        except BackendUnreachable as exc:
            status = 504 if exc.timed_out else 502
            rec.http_status = status
            rec.error = f"backend unreachable: {exc}"
            wait = " in time" if exc.timed_out else ""
            rec.agent_error = f"{rec.backend.public_name} could not be reached{wait}"
            await self._finish(rec, started)
            return self._error(status, "backend_unreachable", rec.agent_error, "api_error")
        rec.http_status = upstream.status
        rec.header_policy_version = upstream.policy_version()
        if upstream.stream is not None:
            return await self._relay_stream(rec, upstream, started)
        return await self._relay_body(rec, upstream, started)

    async def _relay_body(self, rec: CallRecord, upstream: UpstreamCall, started: float) -> web.Response:
        payload = upstream.json()
        assert rec.capture is not None
        if upstream.ok and isinstance(payload, dict):
            rec.capture.add_body(payload, upstream.text())
        else:
            rec.error_body = payload if payload is not None else upstream.body.decode("utf-8", "replace")
            message = _error_message(payload, upstream.body[:2000].decode("utf-8", "replace"))
            rec.error = (
                f"HTTP {upstream.status}: {message}" if not upstream.ok else "the backend answered no JSON"
            )
        await self._finish(rec, started)
        if self.dialect.translates and self.dialect_request is not None:
            return self._translated_body(upstream, payload)
        return web.Response(
            body=upstream.body,
            status=upstream.status,
            headers={"Content-Type": upstream.content_type, **upstream.headers},
        )

    def _translated_body(self, upstream: UpstreamCall, payload: Any) -> web.Response:
        """The backend's chat answer in this call's dialect (its errors too, with the backend's status)."""
        assert self.dialect_request is not None
        if upstream.ok and isinstance(payload, dict):
            body = self.dialect.from_chat(payload, self.dialect_request)
            return web.json_response(body, status=upstream.status, headers=upstream.headers)
        status = upstream.status if not upstream.ok else 502
        message = _error_message(payload, "the backend answered no JSON")
        kind = "api_error" if status >= 500 else "invalid_request_error"
        return self._error(status, "backend_error", message, kind, headers=upstream.headers)

    async def _relay_stream(
        self, rec: CallRecord, upstream: UpstreamCall, started: float
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **upstream.headers},
        )
        await response.prepare(self.request)
        agent_gone = False
        done: bytes | None = None
        translator = self._translator()
        try:
            done, agent_gone = await self._pump(rec, upstream, response, translator)
        finally:
            await upstream.close()
        await self._finish(rec, started)
        if agent_gone:
            return response
        try:
            if done is None and translator is not None:
                await response.write(b"".join(translator.fail(rec.agent_error or rec.error)))
            elif done is None:
                await response.write(
                    sse.encode(
                        {
                            "error": {
                                "message": rec.agent_error or rec.error,
                                "type": "api_error",
                                "code": "stream_failed",
                            }
                        }
                    )
                )
            else:
                await response.write(done)
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response

    def _translator(self) -> StreamTranslator | None:
        if not self.dialect.translates or self.dialect_request is None:
            return None
        return self.dialect.translator(self.dialect_request)

    async def _pump(
        self,
        rec: CallRecord,
        upstream: UpstreamCall,
        response: web.StreamResponse,
        translator: StreamTranslator | None = None,
    ) -> tuple[bytes | None, bool]:
        """Pass events through as they come (or each chunk's events in the dialect, through ``translator``);
        returns (the held end of the stream, or None, agent gone)."""
        assert upstream.stream is not None and rec.capture is not None
        try:
            async for event in upstream.stream:
                if event.done:
                    return (event.raw if translator is None else b"".join(translator.finish())), False
                payload = event.json()
                out = event.raw if translator is None else b""
                if isinstance(payload, dict):
                    if "error" in payload and not payload.get("choices"):
                        rec.error = f"stream error: {_error_message(payload, 'unknown')}"
                    else:
                        rec.capture.add_chunk(payload)
                        if translator is not None:
                            out = b"".join(translator.feed(payload))
                if not out:
                    continue
                try:
                    await response.write(out)
                except ConnectionResetError:
                    rec.error = "the agent disconnected before the end of the stream"
                    return None, True
        except Exception as exc:  # a cut connection, a timeout, LiteLLM's errors mid-stream
            rec.error = f"the backend stream broke off: {type(exc).__name__}: {exc}"
            rec.agent_error = f"the stream from {rec.backend.public_name} broke off"
            return None, False
        rec.error = rec.error or "the backend stream ended without [DONE]"
        return None, False

    # ------------------------------------------------------------ recording
    def _account(self, rec: CallRecord, started: float) -> None:
        if rec.end_time_unix_nano:
            return
        rec.end_time_unix_nano = time.time_ns()
        rec.latency_ms = (time.monotonic() - started) * 1000.0
        if rec.error:
            self.proxy.total_errors += 1
            self.proxy.table.stats[rec.backend.api_base].errors += 1

    async def _finish(self, rec: CallRecord, started: float) -> None:
        self._account(rec, started)
        if rec.error:
            log.info(
                "event=proxy_call_failed rollout_id=%s attempt_id=%s backend=%s error=%s",
                rec.rollout_id,
                rec.attempt_id,
                rec.backend.api_base,
                rec.error,
            )
        if not rec.recorded or self.proxy.recorder is None:
            return
        await self.proxy.recorder.record(llm_call_span(rec), self.proxy.config.record_wait)
