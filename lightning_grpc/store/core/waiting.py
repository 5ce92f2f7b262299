"""Waiting: for rollouts to finish, and watching rollout changes with resume tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

from lightning_grpc.errors import InvalidArgumentError, OutOfRangeError, Reason
from lightning_grpc.types import Rollout, WatchEvent, copy_rollout

from .base import _FinishWaiter
from .limits import DEFAULT_PROGRESS_INTERVAL, MAX_WAIT_IDS, MIN_PROGRESS_INTERVAL
from .staging import SpanStaging
from .validation import check_wait, rollout_statuses


class WaitingSection(SpanStaging):
    """Calls that wait on the store."""

    def check_wait(self, seconds: float | None, field: str) -> float:
        """Validate a wait in seconds (None: no wait); returns it."""
        return check_wait(seconds, field)

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """Wait until all given rollouts are finished or ``timeout`` passes; return the finished ones."""
        if len(rollout_ids) > MAX_WAIT_IDS:
            raise InvalidArgumentError("rollout_ids", f"must hold at most {MAX_WAIT_IDS} ids")
        for i, rid in enumerate(rollout_ids):
            self._rollout(rid, f"rollout_ids[{i}]")
        wait = check_wait(timeout, "timeout")
        ids = list(dict.fromkeys(rollout_ids))
        await self._durable()
        pending = [rid for rid in ids if not self._rollouts[rid].rollout.status.is_terminal]
        if pending and wait > 0:
            waiter = _FinishWaiter(len(pending))
            for rid in pending:
                self._finish_waiters.setdefault(rid, []).append(waiter)
            try:
                await asyncio.wait_for(waiter.event.wait(), wait)
            except TimeoutError:
                pass
            finally:
                for rid in pending:
                    lst = self._finish_waiters.get(rid)
                    if lst is not None:
                        lst.remove(waiter)
                        if not lst:
                            del self._finish_waiters[rid]
            unfinished = [
                r for r in pending if r in self._rollouts and not self._rollouts[r].rollout.status.is_terminal
            ]
            if unfinished:
                self.check_not_draining()  # woken by the shutdown, not by the rollouts
            await self._durable()
        out = []
        for rid in ids:
            rs = self._rollouts.get(rid)
            if rs is not None and rs.rollout.status.is_terminal:
                out.append(self._snapshot(rs))
        return out

    def _token(self, revision: int) -> str:
        return f"{self.store_id}.{revision}"

    def _parse_token(self, token: str) -> int:
        store_id, _, rev = token.rpartition(".")
        if not store_id or not (rev.isascii() and rev.isdigit()) or len(rev) > 18:
            raise InvalidArgumentError("resume_token", "is not a resume token this store issued")
        if store_id != self.store_id:
            raise OutOfRangeError(
                "resume_token belongs to another store (or to an in-memory store that restarted)",
                reason=Reason.RESUME_TOKEN_EXPIRED,
            )
        revision = int(rev)
        first = self._first_retained()
        if revision > self._committed_revision or revision < first - 1:
            raise OutOfRangeError(
                f"resume_token revision {revision} is outside the retained history "
                f"({first - 1}..{self._committed_revision}); list the rollouts again and watch from now",
                reason=Reason.RESUME_TOKEN_EXPIRED,
                revision=str(revision),
            )
        return revision

    def _first_retained(self) -> int:
        """The first revision the change log still holds (the next one while it holds none)."""
        return self._changes[0].revision if self._changes else self._committed_revision + 1

    def _retained_after(self, cursor: int) -> int:
        """The first retained revision; refuses a watcher whose ``cursor`` fell behind the change log."""
        first = self._first_retained()
        if cursor < first - 1:
            raise OutOfRangeError(
                "this watcher fell behind the retained history; resume from a fresh list",
                reason=Reason.RESUME_TOKEN_EXPIRED,
                revision=str(cursor),
            )
        return first

    async def watch_rollouts(
        self,
        resume_token: str = "",
        rollout_ids: Iterable[str] = (),
        statuses: Iterable[int] = (),
        progress_interval: float | None = None,
        *,
        where: Callable[[Rollout], bool] | None = None,
    ) -> AsyncIterator[WatchEvent]:
        """Rollout changes after ``resume_token`` (or from now), with progress messages while idle.

        ``where`` keeps only the changes whose rollout it accepts. It reads the change log's snapshot, before
        the copy each event carries, and must not change it: a watcher in this process that wants a few
        rollouts skips the others without a copy each."""
        interval = check_wait(progress_interval, "progress_interval") or DEFAULT_PROGRESS_INTERVAL
        if interval < MIN_PROGRESS_INTERVAL:
            raise InvalidArgumentError(
                "progress_interval",
                f"must be at least {MIN_PROGRESS_INTERVAL:g} s, or unset for {DEFAULT_PROGRESS_INTERVAL:g} s "
                f"(got {interval:g} s)",
            )
        ids = set(rollout_ids)
        status_set = rollout_statuses(statuses)
        await self._durable()
        cursor = self._parse_token(resume_token) if resume_token else self._committed_revision
        yield WatchEvent(None, self._token(cursor), cursor)
        loop = asyncio.get_running_loop()
        while True:
            self._retained_after(cursor)
            sent = False
            while cursor < self._committed_revision:
                # the log may have been trimmed while this generator was suspended at a yield
                change = self._changes[cursor + 1 - self._retained_after(cursor)]
                cursor = change.revision
                r = change.rollout
                if (
                    (not ids or r.rollout_id in ids)
                    and (not status_set or r.status in status_set)
                    and (where is None or where(r))
                ):
                    sent = True
                    yield WatchEvent(copy_rollout(r), self._token(cursor), cursor)
            self.check_not_draining()
            if self._changes_committed is None or self._changes_committed.done():
                self._changes_committed = loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._changes_committed), interval)
            except TimeoutError:
                if not sent:
                    yield WatchEvent(None, self._token(cursor), cursor)
