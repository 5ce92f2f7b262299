"""The LLM proxy's core: its state (backends, pause, counts), its control operations, its store.

It knows nothing of HTTP or gRPC. :mod:`.http` answers the OpenAI-compatible routes over it,
:mod:`.app` listens for HTTP (``LLMProxy``), and the gRPC ProxyService in
:mod:`lightning_grpc.server` controls it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_grpc import logs
from lightning_grpc.access import Credentials, credential_claims
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.client.local import LocalStoreClient
from lightning_grpc.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, Reason
from lightning_grpc.types import LLM, Attempt, ProxyLLM, ProxyStatus

from .attempts import AttemptGate
from .backends import Backend, BackendDialect, BackendTable
from .litellm_client import LiteLLMClient
from .recorder import SpanRecorder
from .upstream import DirectClient, RetryPolicy

log = logs.get_logger(__name__)


@dataclass(frozen=True)
class ProxyConfig:
    #: Where the OpenAI-compatible HTTP side listens (port 0: any free port).
    host: str = "127.0.0.1"
    port: int = 0
    #: The Store the calls are recorded in: an address or a full client configuration.
    store: str | ClientConfig = "127.0.0.1:4747"
    backends: Sequence[Backend] = field(default_factory=tuple)
    #: The base URL agents reach this proxy at (default: http://host:port).
    public_url: str = ""
    #: Tries after the first, towards a backend, before anything reached the agent.
    retries: int = 2
    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    #: How long the end of a response (its body, a stream's [DONE]) waits for the call's span to be
    #: stored, so that an agent holding its answer never races its span; 0: do not wait. A span not
    #: stored in time stays queued and is retried.
    record_wait: float = 10.0
    #: Heartbeat of an attempt while one of its calls runs longer than this (seconds).
    heartbeat_interval: float = 10.0
    #: Calls that name no attempt (no /rollout/{id}/attempt/{id}, no attempt headers, no attempt
    #: credential): "forward" (not recorded) or "refuse"; "" (the default): refuse them when the proxy
    #: checks credentials, forward them otherwise.
    unattributed: str = ""
    #: The Store's admin token. With one (or with a token in ``store``'s ClientConfig), the HTTP side
    #: takes only credentials: an attempt's own credential as its API key, or the admin token.
    token: str | None = field(default=None, repr=False)


class ProxyCore:
    """What the proxy knows and decides, with no HTTP listener: :class:`~.app.LLMProxy` adds that."""

    def __init__(self, config: ProxyConfig) -> None:
        if config.unattributed not in ("", "forward", "refuse"):
            raise ValueError("unattributed must be 'forward' or 'refuse'")
        self.config = config
        self.table = BackendTable(config.backends)
        self.paused = False
        self.pause_reason = ""
        self.retry_after = 1.0
        self.in_flight = 0
        self.total_calls = 0
        self.total_errors = 0
        self.refused_calls = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.store: StoreClient | LocalStoreClient | None = None
        self.recorder: SpanRecorder | None = None
        self.gate: AttemptGate | None = None
        retry = RetryPolicy(retries=config.retries)
        self.direct = DirectClient(
            retry, connect_timeout=config.connect_timeout, read_timeout=config.read_timeout
        )
        self.litellm = LiteLLMClient(retries=config.retries, timeout=config.read_timeout)
        self.port = 0  # the bound HTTP port, once listening
        #: Checks the credentials of HTTP calls; None: the HTTP side is open (local use, no token).
        self.credentials: Credentials | None = None

    # ------------------------------------------------------------ store connection
    def connect(self, store: str | ClientConfig | LocalStoreClient | None = None) -> str:
        """Open the Store client, the span recorder and the attempt gate; returns where the store is.

        ``store`` overrides the configured store; a :class:`LocalStoreClient` is a Store in this process.
        """
        target = store if store is not None else self.config.store
        token = self.config.token or getattr(target, "token", None)
        if token and credential_claims(token) is not None:
            raise ValueError("the proxy needs the Store's admin token, not a runner or attempt credential")
        self.credentials = Credentials(token) if token else None
        self.store = target if isinstance(target, LocalStoreClient) else StoreClient(target)
        self.recorder = SpanRecorder(self.store).start()
        self.gate = AttemptGate(self.store)
        return target if isinstance(target, str) else getattr(target, "target", "in-process")

    @property
    def refuses_unattributed(self) -> bool:
        """Whether calls that name no attempt are refused (403) rather than forwarded unrecorded."""
        if self.config.unattributed:
            return self.config.unattributed == "refuse"
        return self.credentials is not None

    async def close_clients(self, grace: float = 10.0) -> None:
        """Write the queued spans (up to ``grace`` s) and close every outgoing client."""
        if self.recorder is not None:
            await self.recorder.close(grace)
        await self.direct.close()
        await self.litellm.close()
        if self.store is not None:
            await self.store.close()

    # ------------------------------------------------------------ addresses
    @property
    def base_url(self) -> str:
        """The URL agents use, without /v1."""
        if self.config.public_url:
            return self.config.public_url.rstrip("/").removesuffix("/v1")
        host = self.config.host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def proxy_llm(self, model_name: str) -> ProxyLLM:
        """A ProxyLLM resource for a model behind this proxy (one URL per attempt)."""
        return ProxyLLM(endpoint=f"{self.base_url}/v1", model=model_name)

    # ------------------------------------------------------------ backends
    def set_backends(self, backends: Sequence[Backend]) -> list[Backend]:
        """Replace the backends at once; calls already routed finish where they are."""
        out = self.table.replace(backends)
        log.info(
            "event=proxy_backends_set count=%d models=%s",
            len(out),
            ",".join(self.table.model_names()),
        )
        return out

    def list_backends(self) -> list[Backend]:
        return self.table.backends

    def client_for(self, backend: Backend) -> DirectClient | LiteLLMClient:
        return self.direct if backend.dialect == BackendDialect.VLLM else self.litellm

    # ------------------------------------------------------------ pause / drain
    def pause(self, reason: str = "", retry_after: float | None = None) -> int:
        """New calls get 429 until :meth:`resume`; returns the calls in flight."""
        self.paused = True
        self.pause_reason = reason
        if retry_after is not None:
            if retry_after < 0:
                raise InvalidArgumentError("retry_after", "must not be negative")
            self.retry_after = retry_after
        else:
            self.retry_after = 1.0
        log.info("event=proxy_paused reason=%r in_flight=%d", reason, self.in_flight)
        return self.in_flight

    def resume(self) -> None:
        self.paused = False
        self.pause_reason = ""
        log.info("event=proxy_resumed")

    async def drain(self, timeout: float = 60.0) -> int:
        """Wait until no call is in flight (or ``timeout`` passes); returns the calls still in flight."""
        if timeout < 0:
            raise InvalidArgumentError("timeout", "must not be negative")
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            pass
        return self.in_flight

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    # ------------------------------------------------------------ status and endpoints
    def status(self) -> ProxyStatus:
        known = {b.api_base for b in self.table.backends}
        return ProxyStatus(
            paused=self.paused,
            pause_reason=self.pause_reason,
            in_flight=self.in_flight,
            total_calls=self.total_calls,
            total_errors=self.total_errors,
            refused_calls=self.refused_calls,
            backends={k: v for k, v in self.table.stats.items() if k in known or v.in_flight},
            http_address=self.base_url,
            spans_stored=self.recorder.stored if self.recorder else 0,
            spans_dropped=self.recorder.dropped if self.recorder else 0,
        )

    async def attempt_endpoint(self, rollout_id: str, attempt_id: str, model_name: str = "") -> LLM:
        """The routed endpoint of a running attempt."""
        if not rollout_id:
            raise InvalidArgumentError("rollout_id", "is required")
        if not attempt_id:
            raise InvalidArgumentError("attempt_id", "is required")
        model = self._model_for_endpoint(model_name)
        attempt = await self._find_attempt(rollout_id, attempt_id)
        if not attempt.status.is_active:
            raise FailedPreconditionError(
                f"attempt {attempt_id} of rollout {rollout_id} already ended as {attempt.status}",
                reason=Reason.ATTEMPT_FINISHED,
            )
        return self.proxy_llm(model).for_attempt(rollout_id, attempt_id)

    def _model_for_endpoint(self, model_name: str) -> str:
        names = self.table.model_names()
        if not model_name and len(names) > 1:
            raise InvalidArgumentError("model_name", f"is required: the proxy serves {', '.join(names)}")
        return self.table.resolve_model(model_name)

    async def _find_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        assert self.store is not None, "start() the proxy first"
        rollout = await self.store.get_rollout(rollout_id)
        latest = rollout.latest_attempt
        if latest is not None and latest.attempt_id == attempt_id:
            return latest
        for attempt in await self.store.query_attempts(rollout_id):
            if attempt.attempt_id == attempt_id:
                return attempt
        raise NotFoundError(
            f"rollout {rollout_id} has no attempt {attempt_id}",
            reason=Reason.ATTEMPT_NOT_FOUND,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
        )
