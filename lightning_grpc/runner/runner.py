"""The Runner: long-polls the Store for rollouts and runs up to N of them at once in this process."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import os
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Status, StatusCode

from lightning_grpc import logs, semconv
from lightning_grpc.access import Role, credential_claims
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.client.session import RunnerSession
from lightning_grpc.errors import FailedPreconditionError, LightningError, NotFoundError, UnavailableError
from lightning_grpc.tracing import (
    AttemptContext,
    LightningSpanProcessor,
    SpanStreamer,
    attempt_context,
    emit_reward,
    install_tracing,
    rollout_span,
)
from lightning_grpc.types import Resource, Rollout, RolloutMode

from .agent import FunctionAgent, Hook, LitAgent, routed_resources
from .agent import rollout as make_agent
from .llm import close_shared_http_client
from .stats import system_snapshot

log = logs.get_logger(__name__)


def _worker_of(token: str | None) -> str:
    """The worker id a runner credential is bound to ("" for the admin token or none)."""
    claims = credential_claims(token or "") or {}
    return str(claims.get("worker_id", "")) if claims.get("role") == Role.RUNNER else ""


def default_worker_id() -> str:
    """Unique across machines and processes: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SpansNotAcknowledged(UnavailableError):
    """An attempt whose agent finished but whose spans the store did not acknowledge in time: the runner
    reports it failed (the agent did not fail), and logs ``event=spans_not_acknowledged``."""


@dataclass
class RolloutOutcome:
    rollout: Rollout
    result: Any
    error: BaseException | None
    stopped_by_store: bool


class Runner:
    """Runs an agent on rollouts from the Store.

    ``await runner.run()`` loops until :meth:`stop` (or SIGTERM with :meth:`install_signal_handlers`,
    or ``max_rollouts``); ``async for outcome in runner.iter()`` yields each finished rollout;
    ``await runner.step(input)`` runs one rollout right here. Each attempt is heartbeated; when the
    Store says it must stop (cancelled, timed out), the agent is cancelled (async agents) or
    told through :func:`lightning_grpc.tracing.should_stop` (sync agents, which run in threads).
    """

    def __init__(
        self,
        agent: LitAgent | Callable[..., Any],
        store: str | ClientConfig = "127.0.0.1:4747",
        *,
        concurrency: int = 1,
        worker_id: str | None = None,
        heartbeat_interval: float = 5.0,
        worker_heartbeat_interval: float = 10.0,
        poll_wait: float = 2.0,
        hooks: Sequence[Hook] = (),
        max_rollouts: int | None = None,
        drain_timeout: float = 30.0,
        token: str | None = None,
        include_gpu_stats: bool = True,
        connect_timeout: float = 30.0,
        spans_timeout: float = 30.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.agent: LitAgent = agent if isinstance(agent, LitAgent) else make_agent(agent)
        self.config = store if isinstance(store, ClientConfig) else ClientConfig(target=store, token=token)
        self.concurrency = concurrency
        self.worker_id = worker_id or _worker_of(self.config.token) or default_worker_id()
        self.heartbeat_interval = heartbeat_interval
        self.worker_heartbeat_interval = worker_heartbeat_interval
        self.poll_wait = poll_wait
        self.hooks = list(hooks)
        self.max_rollouts = max_rollouts
        self.drain_timeout = drain_timeout
        self.include_gpu_stats = include_gpu_stats
        #: At start-up, how long to wait for the store before giving up (later, it reconnects for ever).
        self.connect_timeout = connect_timeout
        #: How long an attempt that ended waits for the store to acknowledge its spans before it is reported;
        #: when they are still not stored, the attempt fails (a success without its spans, its reward among
        #: them, would be a rollout that training cannot use) and its retry policy decides.
        self.spans_timeout = spans_timeout
        self.completed = 0
        #: Of the completed rollouts: how many the agent finished, failed (an exception), or stopped.
        self.succeeded = 0
        self.failed = 0
        self.stopped = 0
        self._stop = asyncio.Event() if _loop_running() else None
        self._stop_requested = False
        self._active: dict[str, asyncio.Task[RolloutOutcome]] = {}
        self._outcomes: asyncio.Queue[RolloutOutcome] | None = None
        self._client: StoreClient | None = None
        self._session: RunnerSession | None = None
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="lightning-agent")
        self._resources: dict[str, Mapping[str, Resource]] = {}
        self._processor: LightningSpanProcessor | None = None
        self._streamer: SpanStreamer | None = None
        self._started = False

    # ---------------------------------------------------------------- lifecycle
    @property
    def client(self) -> StoreClient:
        assert self._client is not None, "the runner is not started"
        return self._client

    @property
    def session(self) -> RunnerSession:
        """The stream the runner claims, heartbeats and reports its rollouts over (one, for all of them)."""
        assert self._session is not None, "the runner is not started"
        return self._session

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._stop = self._stop or asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        self._outcomes = asyncio.Queue()
        self._client = StoreClient(self.config)
        self._session = self._client.runner_session()
        try:
            await self._client.wait_until_reachable(self.connect_timeout)
        except LightningError:
            self._started = False
            await self._client.close()
            raise
        self._processor = install_tracing()
        self._streamer = self._processor.streamer_for(self.config)
        await _maybe_await(self.agent.setup())
        await self._beat_worker()  # the worker is known, with its stats, before it takes work
        self._worker_task = asyncio.create_task(self._worker_heartbeats(), name="lightning-worker-heartbeat")
        log.info(
            "event=runner_started worker_id=%s concurrency=%d store=%s",
            self.worker_id,
            self.concurrency,
            self.config.target,
        )

    def stop(self) -> None:
        """Stop taking new rollouts; running ones finish (up to ``drain_timeout``). Before :meth:`start` (a
        signal while the process starts), the runner stops as soon as it starts."""
        self._stop_requested = True
        if self._stop is not None:
            self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)

    async def close(self) -> None:
        if not self._started:
            return
        self._started = False
        self._worker_task.cancel()
        await _maybe_await(self.agent.teardown())
        if self._streamer is not None:
            await self._streamer.aflush(timeout=10)
        if self._session is not None:
            await self._session.close()
        if self._client is not None:
            await self._client.close()
        await close_shared_http_client()  # the agents' OpenAI connections
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info(
            "event=runner_stopped worker_id=%s completed=%d succeeded=%d failed=%d stopped=%d",
            self.worker_id,
            self.completed,
            self.succeeded,
            self.failed,
            self.stopped,
        )

    # ---------------------------------------------------------------- loop mode
    async def run(self) -> int:
        """Take and run rollouts until stopped; returns how many this runner finished."""
        await self.start()
        assert self._stop is not None
        try:
            while not self._stop.is_set() and not self._reached_max():
                free = self.concurrency - len(self._active)
                if self.max_rollouts is not None:
                    free = min(free, self.max_rollouts - self.completed - len(self._active))
                if free <= 0:
                    await asyncio.wait(
                        [*self._active.values(), asyncio.ensure_future(self._stop.wait())],
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    continue
                try:
                    claimed = await self.session.dequeue_rollouts(
                        free, worker_id=self.worker_id, wait=self.poll_wait
                    )
                except LightningError as exc:
                    log.warning("event=dequeue_failed worker_id=%s error=%s", self.worker_id, exc)
                    await asyncio.sleep(min(self.poll_wait, 1.0))
                    continue
                for r in claimed:
                    self._launch(r)
            await self._drain()
        finally:
            await self.close()
        return self.completed

    async def iter(self) -> AsyncIterator[RolloutOutcome]:
        """Loop mode yielding each finished rollout."""
        await self.start()
        assert self._outcomes is not None
        loop_task = asyncio.create_task(self.run())
        try:
            while not (loop_task.done() and self._outcomes.empty()):
                getter = asyncio.ensure_future(self._outcomes.get())
                done, _ = await asyncio.wait([getter, loop_task], return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
            await loop_task
        finally:
            if not loop_task.done():
                self.stop()
                await loop_task

    # ---------------------------------------------------------------- step mode
    async def step(
        self,
        input: Any,
        *,
        resources: Mapping[str, Resource] | None = None,
        mode: RolloutMode | str | None = None,
        **spec: Any,
    ) -> RolloutOutcome:
        """Run one rollout in this process now (created with start_rollout); returns its outcome."""
        await self.start()
        if resources is not None:
            spec["resources_id"] = (await self.client.add_resources(resources)).resources_id
        r = await self.client.start_rollout(input, worker_id=self.worker_id, mode=mode, **spec)
        return await self._run_one(r)

    # ---------------------------------------------------------------- one rollout
    def _reached_max(self) -> bool:
        return self.max_rollouts is not None and self.completed >= self.max_rollouts

    def _launch(self, r: Rollout) -> None:
        task = asyncio.create_task(self._run_one(r), name=f"rollout-{r.rollout_id}")
        self._active[r.rollout_id] = task
        task.add_done_callback(functools.partial(self._forget, r.rollout_id))

    def _forget(self, rollout_id: str, _task: asyncio.Task[RolloutOutcome]) -> None:
        self._active.pop(rollout_id, None)

    async def _run_one(self, r: Rollout) -> RolloutOutcome:
        attempt = r.latest_attempt
        assert attempt is not None, "a claimed rollout has an attempt"
        ctx = AttemptContext(r.rollout_id, attempt.attempt_id)
        result: Any = None
        error: BaseException | None = None
        try:
            resources = routed_resources(await self._resources_of(r), r)
        except LightningError as exc:
            error = exc
            resources = {}
        await self._call_hooks("on_rollout_start", r)
        agent_task: asyncio.Task[Any] | None = None
        heartbeat: asyncio.Task[None] | None = None
        if self._processor is not None and self._streamer is not None:
            self._processor.route(ctx.attempt_id, self._streamer)
        with (
            attempt_context(ctx),
            rollout_span(r.rollout_id, attempt.attempt_id, attempt.sequence_number) as root,
        ):
            await self._call_hooks("on_trace_start", r)
            if error is None:
                agent_task = asyncio.create_task(self._invoke(r, resources))
                heartbeat = asyncio.create_task(self._heartbeat(ctx, agent_task))
                try:
                    result = await agent_task
                except asyncio.CancelledError:
                    if not ctx.stop.is_set():
                        raise
                except Exception as exc:
                    error = exc
                finally:
                    heartbeat.cancel()
                if error is None and result is not None and not ctx.stop.is_set():
                    try:
                        _record_result(result)
                    except (TypeError, ValueError) as exc:
                        error = exc
            if error is not None:
                root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:1000]))
            await self._call_hooks("on_trace_end", r)
        # The attempt's spans not sent yet go with its outcome, in the same commit: no batch of their own.
        last_spans = self._streamer.take(r.rollout_id, ctx.attempt_id) if self._streamer else []
        error = await self._flush_spans(r, ctx, error)
        final, error = await self._report(r, ctx, error, last_spans)
        if self._processor is not None:
            self._processor.unroute(ctx.attempt_id)
        outcome = RolloutOutcome(final, result, error, ctx.stop.is_set())
        await self._call_hooks("on_rollout_end", final, result, error)
        self.completed += 1
        if ctx.stop.is_set():
            self.stopped += 1
        elif error is None:
            self.succeeded += 1
        else:
            self.failed += 1
        if self._outcomes is not None:
            self._outcomes.put_nowait(outcome)
        return outcome

    async def _invoke(self, r: Rollout, resources: Mapping[str, Resource]) -> Any:
        method = self.agent.training_rollout if r.mode == RolloutMode.TRAIN else self.agent.validation_rollout
        # A function agent's rollout() returns the coroutine of an async function: no thread needed.
        if inspect.iscoroutinefunction(method) or (
            isinstance(self.agent, FunctionAgent) and self.agent.is_async
        ):
            return await _maybe_await(method(r.input, resources, r))
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, method, r.input, resources, r)
        return await _maybe_await(await loop.run_in_executor(self._executor, call))

    async def _resources_of(self, r: Rollout) -> Mapping[str, Resource]:
        if not r.resources_id:
            return {}
        cached = self._resources.get(r.resources_id)
        if cached is None:
            cached = (await self.client.get_resources(r.resources_id)).resources
            self._resources[r.resources_id] = cached
        return cached

    async def _heartbeat(self, ctx: AttemptContext, agent_task: asyncio.Task[Any]) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                beat = await self.session.heartbeat_attempt(ctx.rollout_id, ctx.attempt_id)
            except LightningError as exc:
                log.warning("event=heartbeat_failed attempt_id=%s error=%s", ctx.attempt_id, exc)
                continue
            if beat.should_stop:
                why = "cancelled" if beat.cancelled else f"attempt {beat.attempt.status}"
                log.info(
                    "event=attempt_stopping rollout_id=%s attempt_id=%s why=%s",
                    ctx.rollout_id,
                    ctx.attempt_id,
                    why,
                )
                ctx.stop.set()
                agent_task.cancel()
                return

    async def _flush_spans(
        self, r: Rollout, ctx: AttemptContext, error: BaseException | None
    ) -> BaseException | None:
        """Wait until the attempt's spans sent so far are stored: the error to report if they are not."""
        if self._streamer is None:
            return error
        stored = await self._streamer.aflush(r.rollout_id, ctx.attempt_id, timeout=self.spans_timeout)
        if stored:
            return error
        log.warning("event=spans_not_flushed rollout_id=%s attempt_id=%s", r.rollout_id, ctx.attempt_id)
        if error is None and not ctx.stop.is_set():
            return SpansNotAcknowledged(
                f"the store did not acknowledge this attempt's spans within {self.spans_timeout:g} s "
                "(Runner spans_timeout): it is reported failed rather than succeeded without them"
            )
        return error

    async def _report(
        self, r: Rollout, ctx: AttemptContext, error: BaseException | None, spans: list[bytes]
    ) -> tuple[Rollout, BaseException | None]:
        """Report the outcome with ``spans``, the attempt's last ones: the rollout after it, and the error
        reported. Spans it cannot store go back to the streamer; refused with the outcome, they are sent and
        flushed on their own, then the outcome follows without them, as it would have been reported had they
        never been taken (failed, if they are not acknowledged in time)."""
        attempt_id = ctx.attempt_id
        try:
            if ctx.stop.is_set():
                self._give_back(r, ctx, spans)
                return await self.client.get_rollout(r.rollout_id), error
            self._log_failure(r, attempt_id, error)
            try:
                return await self._complete(r, attempt_id, error, spans), error
            except (FailedPreconditionError, NotFoundError):
                self._give_back(r, ctx, spans)
                raise
            except LightningError as exc:
                if not spans:
                    raise
                log.warning(
                    "event=last_spans_refused rollout_id=%s attempt_id=%s spans=%d error=%s",
                    r.rollout_id,
                    attempt_id,
                    len(spans),
                    exc,
                )
                self._give_back(r, ctx, spans)
                flushed = await self._flush_spans(r, ctx, error)
                if flushed is not error:
                    self._log_failure(r, attempt_id, flushed)
                return await self._complete(r, attempt_id, flushed, []), flushed
        except (FailedPreconditionError, NotFoundError) as exc:
            log.info(
                "event=report_refused rollout_id=%s attempt_id=%s reason=%s",
                r.rollout_id,
                attempt_id,
                exc.reason,
            )
            try:
                return await self.client.get_rollout(r.rollout_id), error
            except LightningError:
                return r, error

    async def _complete(
        self, r: Rollout, attempt_id: str, error: BaseException | None, spans: list[bytes]
    ) -> Rollout:
        if error is None:
            _, final = await self.session.complete_attempt(r.rollout_id, attempt_id, "succeeded", spans=spans)
            return final
        _, final = await self.session.complete_attempt(
            r.rollout_id,
            attempt_id,
            "failed",
            _failure_message(error),
            {semconv.ATTEMPT_ERROR: error_record(error)},
            spans=spans,
        )
        return final

    @staticmethod
    def _log_failure(r: Rollout, attempt_id: str, error: BaseException | None) -> None:
        if error is None:
            return
        by_agent = not isinstance(error, SpansNotAcknowledged)
        log.warning(
            "event=%s rollout_id=%s attempt_id=%s error=%s",
            "agent_failed" if by_agent else "spans_not_acknowledged",
            r.rollout_id,
            attempt_id,
            _failure_message(error),
            exc_info=error if by_agent else None,
        )

    def _give_back(self, r: Rollout, ctx: AttemptContext, spans: list[bytes]) -> None:
        if spans and self._streamer is not None:
            self._streamer.give_back(r.rollout_id, ctx.attempt_id, spans)

    async def _drain(self) -> None:
        if not self._active:
            return
        log.info("event=runner_draining worker_id=%s active=%d", self.worker_id, len(self._active))
        _, pending = await asyncio.wait(list(self._active.values()), timeout=self.drain_timeout)
        for task in pending:
            task.cancel()
        for task in pending:
            rid = task.get_name().removeprefix("rollout-")
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            await self._release(rid)

    async def _release(self, rollout_id: str) -> None:
        """Give back an attempt the runner could not finish: it fails, and is retried per its policy."""
        try:
            r = await self.client.get_rollout(rollout_id)
            if r.latest_attempt is not None and r.latest_attempt.status.is_active:
                await self.session.complete_attempt(
                    rollout_id,
                    r.latest_attempt.attempt_id,
                    "failed",
                    "released: the runner stopped before it finished",
                )
        except LightningError as exc:
            log.warning("event=release_failed rollout_id=%s error=%s", rollout_id, exc)

    async def _worker_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.worker_heartbeat_interval)
            await self._beat_worker()

    async def _beat_worker(self) -> None:
        try:
            stats = await asyncio.to_thread(system_snapshot, self.include_gpu_stats)
            stats["active_rollouts"] = len(self._active)
            stats["completed_rollouts"] = self.completed
            await self.client.update_worker(self.worker_id, stats)
        except LightningError as exc:
            log.warning("event=worker_heartbeat_failed worker_id=%s error=%s", self.worker_id, exc)
        except Exception as exc:  # stats must never stop the runner
            log.warning("event=worker_stats_failed error=%r", exc)

    async def _call_hooks(self, name: str, *args: Any) -> None:
        for hook in self.hooks:
            try:
                await _maybe_await(getattr(hook, name)(*args))
            except Exception as exc:
                log.warning("event=hook_failed hook=%s method=%s error=%r", type(hook).__name__, name, exc)


def _failure_message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:4000]


def _record_result(result: Any) -> None:
    """A returned reward becomes a reward span of the attempt."""
    if isinstance(result, bool):
        raise TypeError("an agent returned a bool; return a float reward, a mapping of rewards, or None")
    if isinstance(result, int | float):
        emit_reward(float(result))
    elif isinstance(result, Mapping):
        emit_reward(result, primary=next(iter(result)) if len(result) > 1 else None)
    else:
        raise TypeError(
            f"an agent returned {type(result).__name__}; return a float reward, a mapping, or None"
        )


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_forever(runner: Runner, stopped: threading.Event | None = None) -> int:
    """Run a runner in this process until SIGTERM/SIGINT (or its max_rollouts).

    ``stopped`` is set by a signal that arrived before the runner was up: the runner then stops at once.
    """

    async def main() -> int:
        runner.install_signal_handlers()
        if stopped is not None and stopped.is_set():
            runner.stop()
        return await runner.run()

    started = time.monotonic()
    count = asyncio.run(main())
    log.info(
        "event=runner_exit worker_id=%s completed=%d succeeded=%d failed=%d stopped=%d seconds=%.1f",
        runner.worker_id,
        count,
        runner.succeeded,
        runner.failed,
        runner.stopped,
        time.monotonic() - started,
    )
    return count


def error_record(error: BaseException, limit: int = 8000) -> dict[str, str]:
    """What an attempt keeps of its agent's exception: type, message, and the traceback's last lines."""
    text = "".join(traceback.format_exception(error))
    if len(text) > limit:
        text = "…" + text[-(limit - 1) :]
    return {
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": str(error)[:2000],
        "traceback": text,
    }
