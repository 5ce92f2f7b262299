"""``LLMProxy``: the proxy core listening for HTTP, started and stopped inside one event loop."""

from __future__ import annotations

from lightning_grpc._extras import extra_imports

with extra_imports("proxy"):
    from aiohttp import web

from lightning_grpc import logs
from lightning_grpc.client import ClientConfig
from lightning_grpc.client.local import LocalStoreClient

from .core import ProxyCore
from .http import build_app

log = logs.get_logger(__name__)


class LLMProxy(ProxyCore):
    """Create it, then ``await start()`` inside the event loop that serves it."""

    _runner: web.AppRunner | None = None

    async def start(self, store: str | ClientConfig | LocalStoreClient | None = None) -> LLMProxy:
        """Connect to the Store (``store`` overrides the configured one; a :class:`LocalStoreClient` for a
        Store in this process) and listen for HTTP."""
        where = self.connect(store)
        self._runner = web.AppRunner(
            build_app(self), access_log=None, handle_signals=False, shutdown_timeout=5.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as exc:
            await self.close_clients()
            raise OSError(f"cannot listen on {self.config.host}:{self.config.port}: {exc}") from None
        self.port = _bound_port(self._runner)
        log.info(
            "event=proxy_started http_address=%s backends=%d store=%s",
            self.base_url,
            len(self.table.backends),
            where,
        )
        return self

    async def stop(self, grace: float = 10.0) -> None:
        """Pause, let calls in flight finish (up to ``grace`` s), write the queued spans, close."""
        self.pause("shutting down")
        left = await self.drain(grace)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.close_clients(grace)
        log.info("event=proxy_stopped in_flight_abandoned=%d", left)


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise OSError("the proxy's HTTP site has no address")
