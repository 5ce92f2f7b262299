"""ProxyClient: the ProxyService stubs, returning plain Python objects (for trainers and operators)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from lightning_grpc import convert
from lightning_grpc.convert.proxy import backend_from_pb, backend_to_pb
from lightning_grpc.types import LLM, Backend, BackendStats, ProxyStatus
from lightning_grpc.v1 import proxy_service_pb2 as pb
from lightning_grpc.v1 import proxy_service_pb2_grpc as pb_grpc

from .channel import call_metadata, make_channel
from .config import ClientConfig, RetryConfig, TlsConfig
from .errors import from_rpc_error
from .store import _DEFAULTS, client_config


class ProxyClient:
    """Async client of a ProxyService. Raises :class:`lightning_grpc.errors.LightningError` subclasses.

    Create it inside the event loop that uses it. The ProxyService's methods are all marked safe to
    repeat, so each is retried on UNAVAILABLE.

    Args:
        target: The proxy's gRPC address (``host:port``), or a whole :class:`ClientConfig` (then the
            other arguments are ignored).
        token: The bearer token sent with every call.
        tls: TLS settings; None for a plaintext channel.
        retry: The retry policy of the idempotent methods; None turns retries off.
        timeout: The default deadline of a call, in seconds.
        gzip: Compress messages with gzip.
        keepalive_seconds: The interval of the channel's keepalive pings.
    """

    def __init__(
        self,
        target: str | ClientConfig = _DEFAULTS.target,
        *,
        token: str | None = _DEFAULTS.token,
        tls: TlsConfig | None = _DEFAULTS.tls,
        retry: RetryConfig | None = _DEFAULTS.retry,
        timeout: float = _DEFAULTS.timeout,
        gzip: bool = _DEFAULTS.gzip,
        keepalive_seconds: float = _DEFAULTS.keepalive_seconds,
    ) -> None:
        self.config = client_config(
            target,
            token=token,
            tls=tls,
            retry=retry,
            timeout=timeout,
            gzip=gzip,
            keepalive_seconds=keepalive_seconds,
        )
        self._channel = make_channel(self.config)
        self.stub = pb_grpc.ProxyServiceStub(self._channel)
        self._metadata = call_metadata(self.config)

    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> ProxyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return await getattr(self.stub, method)(
                request, timeout=timeout or self.config.timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def set_backends(self, backends: Sequence[Backend]) -> list[Backend]:
        """Replace the proxy's backends (the model servers it routes calls to). Retried on UNAVAILABLE.

        Args:
            backends: The new backends, API keys included.

        Returns:
            The backends as the proxy now has them (API keys left out).

        Raises:
            InvalidArgumentError: A refused backend.
            PermissionDeniedError: The token is not an admin's.
        """
        request = pb.SetBackendsRequest()
        for b in backends:
            backend_to_pb(b, request.backends.add(), api_key=True)
        resp = await self._call("SetBackends", request)
        return [backend_from_pb(b) for b in resp.backends]

    async def list_backends(self) -> list[Backend]:
        """The proxy's backends (API keys left out). Retried on UNAVAILABLE.

        Returns:
            The backends.
        """
        resp = await self._call("ListBackends", pb.ListBackendsRequest())
        return [backend_from_pb(b) for b in resp.backends]

    async def attempt_endpoint(self, rollout_id: str, attempt_id: str, model_name: str = "") -> LLM:
        """The OpenAI-compatible endpoint an attempt's agent calls. Retried on UNAVAILABLE.

        Args:
            rollout_id: The rollout.
            attempt_id: The attempt.
            model_name: The model the agent asks for ("": the default one).

        Returns:
            The endpoint (its URL names the attempt) and model.

        Raises:
            NotFoundError: No such rollout or attempt, or no backend serves the model.
        """
        resp = await self._call(
            "GetAttemptEndpoint",
            pb.GetAttemptEndpointRequest(rollout_id=rollout_id, attempt_id=attempt_id, model_name=model_name),
        )
        return LLM(endpoint=resp.endpoint.endpoint, model=resp.endpoint.model)

    async def pause(self, reason: str = "", retry_after: float | None = None) -> int:
        """Stop taking LLM calls: new ones are refused with a hint to come back later.

        Retried on UNAVAILABLE.

        Args:
            reason: Why, shown to the refused callers.
            retry_after: When callers should come back, in seconds (None: the proxy's default).

        Returns:
            The calls still in flight.
        """
        request = pb.PauseRequest(reason=reason)
        if retry_after is not None:
            convert.float_to_duration(retry_after, request.retry_after)
        return int((await self._call("Pause", request)).in_flight)

    async def resume(self) -> None:
        """Take LLM calls again after :meth:`pause`. Retried on UNAVAILABLE.

        Raises:
            PermissionDeniedError: The token is not an admin's.
        """
        await self._call("Resume", pb.ResumeRequest())

    async def drain(self, timeout: float = 60.0) -> int:
        """Wait until no call is in flight. Retried on UNAVAILABLE.

        Args:
            timeout: How long to wait, in seconds.

        Returns:
            The calls still in flight when it gave up (0: drained).
        """
        request = pb.DrainRequest()
        convert.float_to_duration(timeout, request.timeout)
        return int((await self._call("Drain", request, timeout=timeout + self.config.timeout)).in_flight)

    async def status(self) -> ProxyStatus:
        """The proxy's state: paused or not, calls and errors, per backend. Retried on UNAVAILABLE.

        Returns:
            The status.
        """
        resp = await self._call("GetProxyStatus", pb.GetProxyStatusRequest())
        return ProxyStatus(
            paused=resp.paused,
            pause_reason="",
            in_flight=resp.in_flight,
            total_calls=resp.total_calls,
            total_errors=resp.total_errors,
            refused_calls=resp.refused_calls,
            backends={
                k: BackendStats(calls=v.calls, errors=v.errors, in_flight=v.in_flight)
                for k, v in resp.backends.items()
            },
            http_address=resp.http_address,
            spans_stored=0,
            spans_dropped=0,
        )
