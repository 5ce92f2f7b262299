"""The dashboard's HTTP server: the Connect gateway to the server's services, and the dashboard's files.

``lightning-grpc serve`` starts it beside the gRPC server (``--dashboard-port``, ``--no-dashboard``), on
the same host, through :func:`companion`. Every POST (and a GET naming a served service) goes to the
:class:`~.connect.ConnectGateway`; every other GET is a file of the built frontend, ``index.html`` for
``/`` and for any path that names no file (the dashboard routes in the browser).
"""

from __future__ import annotations

import errno
import ipaddress
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_grpc._extras import extra_imports

with extra_imports("dashboard"):
    import yarl
    from aiohttp import web

from lightning_grpc import logs
from lightning_grpc.client.channel import make_channel
from lightning_grpc.client.config import ClientConfig, TlsConfig
from lightning_grpc.server.app import RunningServer

from .connect import MAX_REQUEST_BYTES, SERVICES, ConnectGateway

log = logs.get_logger(__name__)

#: The dashboard's port unless told otherwise: next to the Store's 4747 and the proxy's 4748 and 4749.
DEFAULT_PORT = 4750
#: Where the built frontend is looked for unless told otherwise.
DEFAULT_ASSETS = Path(__file__).resolve().parent / "static"

NOT_BUILT = (
    "lightning-grpc dashboard\n\n"
    "The dashboard's assets are not built (there is no index.html where serve looks for them).\n"
    "Its API is served here all the same: the Connect protocol at POST /<package.Service>/<Method>.\n"
)


@dataclass(frozen=True)
class DashboardConfig:
    host: str = "127.0.0.1"
    #: None: :data:`DEFAULT_PORT`, or any free port when another process has it; 0: any free port;
    #: another number: that port, or fail.
    port: int | None = None
    #: The built frontend (``index.html`` and its assets); None: :data:`DEFAULT_ASSETS`.
    assets: Path | None = None
    #: HTTPS with this certificate chain and key (PEM files), as the gRPC port has.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: With TLS: require client certificates signed by this CA, as the gRPC port does.
    tls_client_ca: Path | None = None


@dataclass
class RunningDashboard:
    runner: web.AppRunner
    gateway: ConnectGateway
    host: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.gateway.close()
        log.info("event=dashboard_stopped http_address=%s", self.url)


def _is_loopback(host: str) -> bool:
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _addressed_to_loopback(host_header: str) -> bool:
    try:
        return _is_loopback(yarl.URL(f"http://{host_header}").host or "")
    except ValueError:
        return False


def build_app(gateway: ConnectGateway, assets: Path | None, *, loopback: bool = False) -> web.Application:
    """The aiohttp application: the gateway, and the files under ``assets`` (a single-page app).

    ``loopback``: the server listens on a loopback address only, so every request must be addressed to
    this machine by name (``Host: localhost`` or a loopback address). A web page of another site cannot
    then reach the API by pointing its own name at 127.0.0.1 (DNS rebinding): without a token, the API is
    open to whoever reaches it, and a browser must not make every site one that does.
    """
    root = (assets or DEFAULT_ASSETS).resolve()

    async def dispatch(request: web.Request) -> web.StreamResponse:
        if loopback and not _addressed_to_loopback(request.host):
            return web.Response(
                status=403,
                text="this dashboard listens on a loopback address and answers only requests addressed to "
                "this machine (Host: localhost or 127.0.0.1)\n",
            )
        first = request.path.split("/", 2)[1]
        if request.method == "POST" or first in gateway.service_names:
            return await gateway.handle(request)
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="method not allowed\n", headers={"Allow": "GET, HEAD, POST"})
        return _static(root, request.path)

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_route("*", "/{tail:.*}", dispatch)
    return app


def _static(root: Path, path: str) -> web.StreamResponse:
    """A file of the built frontend; ``index.html`` for ``/`` and for paths that name no file."""
    index = root / "index.html"
    if not index.is_file():
        return web.Response(text=NOT_BUILT, content_type="text/plain")
    relative = path.lstrip("/")
    if relative:
        try:
            candidate = (root / relative).resolve()
            found = candidate.is_relative_to(root) and candidate.is_file()
        except (OSError, ValueError):  # a name no file can have
            found = False
        if found:
            return web.FileResponse(candidate)
        if "." in relative.rsplit("/", 1)[-1]:  # a missing file, not a route of the app
            return web.Response(status=404, text=f"no such file: /{relative}\n")
    return web.FileResponse(index, headers={"Cache-Control": "no-cache"})


def _ssl_context(config: DashboardConfig) -> ssl.SSLContext | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca is not None:
        context.load_verify_locations(cafile=str(config.tls_client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


async def start_dashboard(
    config: DashboardConfig, target: ClientConfig, services: Sequence[str]
) -> RunningDashboard:
    """Listen for HTTP; the gateway calls the ``services`` it knows (of :data:`~.connect.SERVICES`) at
    ``target`` (without a token of its own: each call carries its caller's)."""
    gateway = ConnectGateway(make_channel(target), [s for s in SERVICES if s.full_name in services])
    loopback = _is_loopback(config.host)
    runner = web.AppRunner(
        build_app(gateway, config.assets, loopback=loopback),
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,  # a browser that leaves ends its call (a watch, say)
        shutdown_timeout=2.0,
    )
    await runner.setup()
    context = _ssl_context(config)
    try:
        port = await _listen(runner, config, context)
    except BaseException:
        await runner.cleanup()
        await gateway.close()
        raise
    running = RunningDashboard(runner, gateway, config.host, port, tls=context is not None)
    assets = config.assets or DEFAULT_ASSETS
    log.info(
        "event=dashboard_started http_address=%s grpc_target=%s services=%d assets=%s built=%s",
        running.url,
        target.target,
        len(gateway.services),
        assets,
        (assets / "index.html").is_file(),
    )
    return running


async def _listen(runner: web.AppRunner, config: DashboardConfig, context: ssl.SSLContext | None) -> int:
    port = DEFAULT_PORT if config.port is None else config.port
    site = web.TCPSite(runner, config.host, port, ssl_context=context)
    try:
        await site.start()
    except OSError as exc:
        await site.stop()
        if config.port is not None or exc.errno != errno.EADDRINUSE:
            raise OSError(
                f"the dashboard cannot listen on {config.host}:{port}: {exc.strerror or exc}"
            ) from None
        log.warning("event=dashboard_port_taken port=%d action=any_free_port", port)
        site = web.TCPSite(runner, config.host, 0, ssl_context=context)
        await site.start()
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise OSError("the dashboard's HTTP site has no address")


def grpc_target(server: RunningServer) -> ClientConfig:
    """How the gateway reaches ``server``: its own port, on a loopback address when it listens on all."""
    host = server.config.host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    address = f"[{host}]:{server.port}" if ":" in host else f"{host}:{server.port}"
    tls = server.config.tls
    return ClientConfig(
        target=address,
        token=None,
        retry=None,  # the browser decides whether to call again
        tls=TlsConfig(root_certificates=tls.cert_chain.read_bytes()) if tls is not None else None,
    )


def companion(config: DashboardConfig) -> Callable[[RunningServer], Awaitable[Callable[[], Awaitable[None]]]]:
    """The dashboard as a companion of the gRPC server (``ServerConfig.companions``): started once the
    server listens, on its host, in front of the services it hosts; stopped when it drains."""

    async def start(server: RunningServer) -> Callable[[], Awaitable[None]]:
        tls = server.config.tls
        if tls is not None and tls.client_ca is not None:
            # the gateway would need a client certificate of its own to call the server: none is given
            log.warning(
                "event=dashboard_disabled reason=mutual_tls detail=%s",
                "the gateway holds no client certificate to call a server that requires one",
            )
            return _nothing
        own = DashboardConfig(
            host=server.config.host,
            port=config.port,
            assets=config.assets,
            tls_cert=tls.cert_chain if tls else None,
            tls_key=tls.private_key if tls else None,
            tls_client_ca=tls.client_ca if tls else None,
        )
        dashboard = await start_dashboard(own, grpc_target(server), server.service_names)
        return dashboard.stop

    return start


async def _nothing() -> None:
    return None
