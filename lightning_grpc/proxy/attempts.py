"""Which calls the proxy takes: only those of an attempt that is still running.

Admission is one attempt heartbeat in the Store (so the call also counts as a sign of life) plus,
on a rollout's first call, a read of the rollout for its mode (train rollouts get log-probs). With the
Store in this process, a heartbeat that moves only the attempt's heartbeat time is not committed on its
own: the call's span, stored when the call ends, writes the attempt with it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from lightning_grpc import logs
from lightning_grpc.client import StoreClient
from lightning_grpc.client.local import LocalStoreClient
from lightning_grpc.errors import LightningError, NotFoundError, UnavailableError
from lightning_grpc.types import RolloutMode

log = logs.get_logger(__name__)


class Refused(Exception):
    """A call the proxy will not take, with the HTTP status and OpenAI-style error code to answer."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    @property
    def kind(self) -> str:
        """The OpenAI error type: the agent's request for a 4xx, the server's side for a 5xx."""
        return "api_error" if self.status >= 500 else "invalid_request_error"


class AttemptGate:
    def __init__(self, client: StoreClient | LocalStoreClient, *, mode_cache_size: int = 10_000) -> None:
        self.client = client
        # in this process, the call's span carries the heartbeat's time (LocalStoreClient.admit_call)
        self._beat = client.admit_call if isinstance(client, LocalStoreClient) else client.heartbeat_attempt
        self._modes: OrderedDict[str, RolloutMode] = OrderedDict()
        self._cache_size = mode_cache_size

    async def admit(self, rollout_id: str, attempt_id: str) -> RolloutMode:
        """The rollout's mode if the attempt may call; :class:`Refused` otherwise."""
        mode_task = None
        if rollout_id not in self._modes:
            mode_task = asyncio.create_task(self._read_mode(rollout_id))
        try:
            beat = await self._beat(rollout_id, attempt_id)
        except NotFoundError:
            raise Refused(
                404, "attempt_not_found", f"rollout {rollout_id!r} has no attempt {attempt_id!r}"
            ) from None
        except LightningError as exc:
            if isinstance(exc, UnavailableError) or exc.transient:  # the agent is told no address; the log is
                log.warning(
                    "event=proxy_store_unavailable rollout_id=%s attempt_id=%s reason=%s error=%s",
                    rollout_id,
                    attempt_id,
                    exc.reason,
                    exc.message,
                )
                raise Refused(
                    503,
                    "store_unavailable",
                    "the Store cannot take the call now; retry shortly",
                    retry_after=1,
                ) from None
            raise Refused(400, "invalid_attempt", f"{exc.reason}: {exc.message}") from None
        finally:
            if mode_task is not None:
                await asyncio.gather(mode_task, return_exceptions=True)
        if beat.should_stop:
            raise Refused(
                410,
                "attempt_finished",
                _why_stopped(beat.attempt.status, beat.rollout_status, beat.cancelled),
            )
        return self._modes.get(rollout_id, RolloutMode.UNSPECIFIED)

    async def _read_mode(self, rollout_id: str) -> None:
        rollout = await self.client.get_rollout(rollout_id)
        self._modes[rollout_id] = rollout.mode
        while len(self._modes) > self._cache_size:
            self._modes.popitem(last=False)

    def keep_alive(self, rollout_id: str, attempt_id: str, interval: float) -> KeepAlive:
        """Heartbeat the attempt every ``interval`` seconds while a call runs (``cancel()`` when it ends).

        Nothing runs for a call that ends within ``interval``: only a timer is set."""
        return KeepAlive(self.client, rollout_id, attempt_id, interval)


class KeepAlive:
    """Heartbeats of one attempt while a long call runs: a timer, then a heartbeat each time it fires."""

    def __init__(
        self, client: StoreClient | LocalStoreClient, rollout_id: str, attempt_id: str, interval: float
    ) -> None:
        self._client = client
        self._rollout_id = rollout_id
        self._attempt_id = attempt_id
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(interval, self._fire)
        self._beat: asyncio.Task[None] | None = None

    def _fire(self) -> None:
        self._timer = None
        self._beat = self._loop.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        try:
            await self._client.heartbeat_attempt(self._rollout_id, self._attempt_id)
        except LightningError as exc:
            log.info(
                "event=proxy_keepalive_failed rollout_id=%s attempt_id=%s error=%r",
                self._rollout_id,
                self._attempt_id,
                exc,
            )
        self._timer = self._loop.call_later(self._interval, self._fire)

    def cancel(self) -> None:
        """The call ended: no more heartbeats (one under way is cancelled)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None


def _why_stopped(attempt_status: object, rollout_status: object, cancelled: bool) -> str:
    if cancelled:
        return f"the rollout was cancelled (attempt {attempt_status}); calls of this attempt are refused"
    return (
        f"the attempt is no longer running (attempt {attempt_status}, rollout {rollout_status}); "
        "calls of a finished or superseded attempt are refused"
    )
