"""Run the proxy: on its own (HTTP side + a gRPC server with ProxyService, health and reflection),
or inside ``lightning-grpc serve`` next to the Store (ProxyService on the Store's port)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from lightning_grpc import logs
from lightning_grpc.client.local import LocalStoreClient
from lightning_grpc.processes import freeze_startup_heap
from lightning_grpc.proxy.app import LLMProxy
from lightning_grpc.proxy.core import ProxyConfig

from .app import (
    RunningServer,
    ServerConfig,
    StopSignals,
    add_health_and_reflection,
    listen,
    raise_if_taken_over,
    start_server,
)
from .auth import interceptors_for
from .proxy_servicer import PROXY_SERVICE, ProxyServicer, add_proxy_service, service_hook

log = logs.get_logger(__name__)


@dataclass
class RunningProxy:
    """A started proxy with its own gRPC server."""

    proxy: LLMProxy
    server: grpc.aio.Server
    health: HealthServicer
    grpc_port: int
    grpc_host: str
    servicer: ProxyServicer

    @property
    def grpc_address(self) -> str:
        return f"{self.grpc_host}:{self.grpc_port}"

    async def stop(self, grace: float = 10.0) -> None:
        await self.health.enter_graceful_shutdown()
        self.servicer.drain()  # new ProxyService calls are refused with UNAVAILABLE
        await self.proxy.stop(grace)
        await self.server.stop(grace)


async def start_proxy_server(
    config: ProxyConfig, *, grpc_host: str = "127.0.0.1", grpc_port: int = 0, token: str | None = None
) -> RunningProxy:
    """Start the proxy's HTTP side, then its gRPC server; returns once both listen."""
    proxy = await LLMProxy(config).start()
    server = grpc.aio.server(interceptors=interceptors_for(token, None))
    servicer = ProxyServicer(proxy)
    add_proxy_service(servicer, server)
    health = add_health_and_reflection(server, [PROXY_SERVICE])
    try:
        port = listen(server, grpc_host, grpc_port)
    except OSError:
        await proxy.stop(0)
        raise
    await server.start()
    for name in ("", PROXY_SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("event=proxy_grpc_started grpc_address=%s:%d http_address=%s", grpc_host, port, proxy.base_url)
    return RunningProxy(proxy, server, health, port, grpc_host, servicer)


async def start_with_store(
    server_config: ServerConfig, proxy_config: ProxyConfig
) -> tuple[RunningServer, LLMProxy]:
    """The Store server with ProxyService on its port, and the proxy's HTTP side recording into it."""
    # the proxy checks credentials under the Store's token, which it shares in this process
    proxy = LLMProxy(dataclasses.replace(proxy_config, token=proxy_config.token or server_config.token))
    config = dataclasses.replace(
        server_config, extra_services=(*server_config.extra_services, service_hook(proxy))
    )
    running = await start_server(config)
    try:
        await proxy.start(LocalStoreClient(running.store))  # the Store is in this process: no gRPC hop
    except BaseException:
        await running.stop()
        raise
    return running, proxy


async def serve_proxy(
    config: ProxyConfig,
    *,
    grpc_host: str = "127.0.0.1",
    grpc_port: int = 0,
    token: str | None = None,
    grace: float = 10.0,
    ready: Callable[[RunningProxy], None] | None = None,
) -> None:
    """``lightning-grpc proxy``: run until SIGTERM or SIGINT, then drain and exit."""
    running = await start_proxy_server(config, grpc_host=grpc_host, grpc_port=grpc_port, token=token)
    freeze_startup_heap()
    if ready is not None:
        ready(running)
    await StopSignals().wait()
    await running.stop(grace)


async def serve_with_store(server_config: ServerConfig, proxy_config: ProxyConfig) -> None:
    """``lightning-grpc serve --proxy-backend ...``: the Store and the proxy in one process."""
    signals = StopSignals()
    try:
        running, proxy = await start_with_store(server_config, proxy_config)
    except asyncio.CancelledError:
        if signals.stopped_while_starting():
            return
        raise
    freeze_startup_heap()
    await signals.wait(running)
    await proxy.stop(server_config.grace)
    await running.stop()
    raise_if_taken_over(running)
