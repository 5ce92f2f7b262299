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
from .config import ClientConfig
from .errors import from_rpc_error


class ProxyClient:
    """Async client of a ProxyService. Raises :class:`lightning_grpc.errors.LightningError` subclasses."""

    def __init__(self, target: str | ClientConfig = "127.0.0.1:4747", **options: Any) -> None:
        self.config = target if isinstance(target, ClientConfig) else ClientConfig(target=target, **options)
        self._channel = make_channel(self.config)
        self.stub = pb_grpc.ProxyServiceStub(self._channel)
        self._metadata = call_metadata(self.config)

    async def close(self) -> None:
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
        request = pb.SetBackendsRequest()
        for b in backends:
            backend_to_pb(b, request.backends.add(), api_key=True)
        resp = await self._call("SetBackends", request)
        return [backend_from_pb(b) for b in resp.backends]

    async def list_backends(self) -> list[Backend]:
        resp = await self._call("ListBackends", pb.ListBackendsRequest())
        return [backend_from_pb(b) for b in resp.backends]

    async def attempt_endpoint(self, rollout_id: str, attempt_id: str, model_name: str = "") -> LLM:
        resp = await self._call(
            "GetAttemptEndpoint",
            pb.GetAttemptEndpointRequest(rollout_id=rollout_id, attempt_id=attempt_id, model_name=model_name),
        )
        return LLM(endpoint=resp.endpoint.endpoint, model=resp.endpoint.model)

    async def pause(self, reason: str = "", retry_after: float | None = None) -> int:
        """Returns the calls in flight."""
        request = pb.PauseRequest(reason=reason)
        if retry_after is not None:
            convert.float_to_duration(retry_after, request.retry_after)
        return int((await self._call("Pause", request)).in_flight)

    async def resume(self) -> None:
        await self._call("Resume", pb.ResumeRequest())

    async def drain(self, timeout: float = 60.0) -> int:
        """Waits until no call is in flight; returns the calls still in flight when it gave up (0: drained)."""
        request = pb.DrainRequest()
        convert.float_to_duration(timeout, request.timeout)
        return int((await self._call("Drain", request, timeout=timeout + self.config.timeout)).in_flight)

    async def status(self) -> ProxyStatus:
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
