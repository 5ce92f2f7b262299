"""Small synchronous wrappers of the async clients, for scripts and notebooks."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

from .channel import close_loop
from .config import ClientConfig
from .store import StoreClient
from .trainer import TrainerClient


class _SyncClient:
    """Runs an async client on a private event loop thread; every method blocks.

    Streaming methods return lists: the items seen until the stream ends (use ``follow=False``),
    so prefer the async client for those.
    """

    _client_class: Any = StoreClient

    def __init__(self, target: str | ClientConfig = "127.0.0.1:4747", **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lightning-sync-client", daemon=True
        )
        self._thread.start()
        self._client = self._run(self._make(target, options))

    @classmethod
    async def _make(cls, target: str | ClientConfig, options: dict[str, Any]) -> Any:
        return cls._client_class(target, **options)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        attr = getattr(self._client, name)
        if inspect.isasyncgenfunction(attr):

            async def collect(*args: Any, **kwargs: Any) -> list[Any]:
                return [item async for item in attr(*args, **kwargs)]

            return lambda *a, **kw: self._run(collect(*a, **kw))
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **kw: self._run(attr(*a, **kw))
        return attr  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            close_loop(self._loop)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncStoreClient(_SyncClient):
    """A blocking :class:`StoreClient`."""

    _client_class = StoreClient


class SyncTrainerClient(_SyncClient):
    """A blocking :class:`TrainerClient`."""

    _client_class = TrainerClient
