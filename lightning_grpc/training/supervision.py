"""The run's children kept alive: a store server, engine or runner that dies is started again where it was,
with back-off, and the run goes on; each interruption goes to the run's journal (:mod:`.recovery`).

What makes a restart safe is elsewhere: the store keeps every rollout, attempt and batch on file
(``services.store_path``), so a restarted server answers as before; rollouts whose runner died end
UNRESPONSIVE at their deadline and are tried again (``agent.max_attempts``), their calls kept apart by
attempt; the engine comes back at the policy version last published; the run's own calls that failed
meanwhile are made again with the same request ids (:func:`again`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from lightning_grpc import logs
from lightning_grpc.errors import DeadlineExceededError, UnavailableError

from .recovery import Interruption, Journal, describe_exit
from .services import Child, Services, child_died_message

log = logs.get_logger(__name__)

T = TypeVar("T")

#: Longest wait between two restarts of one child.
MAX_BACKOFF_S = 30.0
#: A dead child's last lines of output, logged before it is started again.
LAST_LINES = 5
#: How often the children are looked at.
POLL_S = 0.25


class ChildLost(RuntimeError):
    """A child died more often than ``services.restarts`` allows, or cannot be restarted alone."""


class Supervisor:
    """Watches the run's children; :meth:`watch` returns only by raising :class:`ChildLost`."""

    def __init__(
        self,
        services: Services,
        journal: Journal,
        *,
        restarts: int,
        backoff: float,
        step: Callable[[], int],
    ) -> None:
        self.services = services
        self.journal = journal
        self.limit = restarts
        self.backoff = backoff
        self.step = step

    async def watch(self) -> None:
        while True:
            for child in self.services.dead():
                await self._recover(child)
            await asyncio.sleep(POLL_S)

    async def _recover(self, child: Child) -> None:
        died_at = time.time()
        cause = describe_exit(child.process.proc.returncode)
        await asyncio.to_thread(child.process.read_to_end)
        for line in child.process.last_lines(LAST_LINES):  # what it said last: why, when it died by itself
            log.warning("event=child_died process=%s output=%s", child.name, line)
        if child.restart is None:
            raise ChildLost(
                f"{child_died_message(child)}\n(it cannot be restarted alone: run the command again)"
            )
        while True:
            if child.restarts >= self.limit:
                raise ChildLost(
                    f"{child_died_message(child)}\n(restarted {child.restarts} times already: "
                    f"services.restarts = {self.limit})"
                )
            delay = min(MAX_BACKOFF_S, self.backoff * 2**child.restarts)
            child.restarts += 1
            log.warning(
                "event=child_restarting process=%s cause=%r delay=%.1f restart=%d",
                child.name,
                cause,
                delay,
                child.restarts,
            )
            await asyncio.sleep(delay)
            try:
                async with child.hold() if child.hold is not None else contextlib.nullcontext():
                    child.process = await asyncio.to_thread(child.restart)
                break
            except RuntimeError as exc:  # it died again while starting: back off longer
                cause = f"{cause}; restart {child.restarts} failed: {exc}"
        self.journal.record(
            Interruption(
                time=died_at,
                step=self.step(),
                process=child.name,
                cause=cause,
                recovery=f"restarted{' on the same ports' if child.ports else ''} after {delay:g} s back-off "
                f"(restart {child.restarts} of {self.limit})",
                recovery_seconds=round(time.time() - died_at, 3),
            )
        )


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is a service that is down or restarting (not a refusal): the clients raise
    UNAVAILABLE as :class:`UnavailableError`, the engine's HTTP side a connection error."""
    if isinstance(error, UnavailableError | DeadlineExceededError | ConnectionError):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - the train extra brings it
        return False
    return isinstance(error, aiohttp.ClientConnectionError | aiohttp.ServerDisconnectedError)


async def again(
    what: str, call: Callable[[], Awaitable[T]], *, patience: float = 300.0, first_delay: float = 0.5
) -> T:
    """``call()``, made again while it fails because a service is down (a child being restarted), for up to
    ``patience`` seconds. Only for calls that are safe to repeat: idempotent by request id, or reads."""
    deadline = time.monotonic() + patience
    delay = first_delay
    while True:
        try:
            return await call()
        except Exception as error:
            if not is_transient(error) or time.monotonic() + delay > deadline:
                raise
            log.info("event=call_retried what=%s error=%s delay=%.1f", what, type(error).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(5.0, delay * 2)
