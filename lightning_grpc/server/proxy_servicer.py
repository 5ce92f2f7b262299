"""ProxyService over gRPC: translate Protobuf <-> the proxy's objects (:mod:`lightning_grpc.convert.proxy`)
and call the proxy. Nothing else."""

from __future__ import annotations

from typing import Any

import grpc

from lightning_grpc import convert
from lightning_grpc.convert.proxy import backend_from_pb, backend_to_pb
from lightning_grpc.proxy.core import ProxyCore
from lightning_grpc.v1 import proxy_service_pb2 as pb
from lightning_grpc.v1 import proxy_service_pb2_grpc as pb_grpc

from .app import ServiceHook
from .handlers import ServicerState, register_service, unary

PROXY_SERVICE = pb.DESCRIPTOR.services_by_name["ProxyService"].full_name
Ctx = grpc.aio.ServicerContext[Any, Any]
DEFAULT_DRAIN_TIMEOUT = 60.0


class ProxyServicer(ServicerState, pb_grpc.ProxyServiceServicer):
    def __init__(self, proxy: ProxyCore) -> None:
        self.proxy = proxy

    @unary
    async def SetBackends(self, request: pb.SetBackendsRequest, context: Ctx) -> pb.SetBackendsResponse:
        backends = self.proxy.set_backends([backend_from_pb(b) for b in request.backends])
        resp = pb.SetBackendsResponse()
        for b in backends:
            backend_to_pb(b, resp.backends.add())
        return resp

    @unary
    async def ListBackends(self, request: pb.ListBackendsRequest, context: Ctx) -> pb.ListBackendsResponse:
        resp = pb.ListBackendsResponse()
        for b in self.proxy.list_backends():
            backend_to_pb(b, resp.backends.add())
        return resp

    @unary
    async def GetAttemptEndpoint(
        self, request: pb.GetAttemptEndpointRequest, context: Ctx
    ) -> pb.GetAttemptEndpointResponse:
        llm = await self.proxy.attempt_endpoint(request.rollout_id, request.attempt_id, request.model_name)
        resp = pb.GetAttemptEndpointResponse()
        resp.endpoint.endpoint = llm.endpoint
        resp.endpoint.model = llm.model
        return resp

    @unary
    async def Pause(self, request: pb.PauseRequest, context: Ctx) -> pb.PauseResponse:
        retry_after = convert.duration_to_float(request.retry_after, request.HasField("retry_after"))
        return pb.PauseResponse(in_flight=self.proxy.pause(request.reason, retry_after))

    @unary
    async def Resume(self, request: pb.ResumeRequest, context: Ctx) -> pb.ResumeResponse:
        self.proxy.resume()
        return pb.ResumeResponse()

    @unary
    async def Drain(self, request: pb.DrainRequest, context: Ctx) -> pb.DrainResponse:
        timeout = convert.duration_to_float(request.timeout, request.HasField("timeout"))
        left = await self.proxy.drain(DEFAULT_DRAIN_TIMEOUT if timeout is None else timeout)
        return pb.DrainResponse(in_flight=left)

    @unary
    async def GetProxyStatus(
        self, request: pb.GetProxyStatusRequest, context: Ctx
    ) -> pb.GetProxyStatusResponse:
        status = self.proxy.status()
        resp = pb.GetProxyStatusResponse(
            paused=status.paused,
            in_flight=status.in_flight,
            total_calls=status.total_calls,
            total_errors=status.total_errors,
            refused_calls=status.refused_calls,
            http_address=status.http_address,
        )
        for api_base, stats in status.backends.items():
            entry = resp.backends[api_base]
            entry.calls = stats.calls
            entry.errors = stats.errors
            entry.in_flight = stats.in_flight
        return resp


def add_proxy_service(servicer: ProxyServicer, server: grpc.aio.Server) -> None:
    """Register ProxyService with the tolerant parsing of every service: bad bytes are INVALID_ARGUMENT."""
    register_service(pb.DESCRIPTOR.services_by_name["ProxyService"], pb, servicer, server)


def service_hook(proxy: ProxyCore) -> ServiceHook:
    """``(name, add)`` for ``ServerConfig.extra_services``: host ProxyService on the Store's server."""
    servicer = ProxyServicer(proxy)

    def add(server: grpc.aio.Server) -> ProxyServicer:
        add_proxy_service(servicer, server)
        return servicer

    return PROXY_SERVICE, add


__all__ = ["PROXY_SERVICE", "ProxyServicer", "add_proxy_service", "service_hook"]
