"""The training loop: rollouts through the whole system, whole-group batches, an update, new weights served.

Each step (sync mode): submit ``batch_size`` GRPO groups of training tasks; the runners play them, their
agents calling the model through the proxy; take the batch of those whole groups from TrainerService;
update the model (:class:`~.learner.Learner`); pause and drain the proxy, load the new weights into the
engine (``/admin/load_weights``, so every later call records the new policy version), resume; report
the step. In async mode groups keep running across the update (carry-over), the proxy is not paused,
and calls older than ``max_staleness`` policy versions are dropped from batches and counted.

Every ``validation.every`` steps the validation tasks run (mode val, never trained) and the run stops
once the validation reward reaches ``validation.target``. Metrics go to ``metrics.csv``, TensorBoard
(when installed) and ``reward.png``; checkpoints (weights, optimiser, step, random states) to
``checkpoints/step-N`` and the final model to ``final/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning_grpc._extras import extra_imports, import_extra

with extra_imports("train"):
    import aiohttp
    import psutil
    import torch

from lightning_grpc import environment, logs, processes, semconv
from lightning_grpc.algorithm import final_reward
from lightning_grpc.batching.options import Aggregation
from lightning_grpc.client import ClientConfig, StoreClient, TrainerClient
from lightning_grpc.client.proxy import ProxyClient
from lightning_grpc.errors import AlreadyExistsError, LightningError
from lightning_grpc.proxy import Backend
from lightning_grpc.triplets.conversation import json_object, response_message, tool_calls_of
from lightning_grpc.types import AttemptStatus, ProxyLLM, RolloutConfig, Span

from . import recovery
from .distributed import DistributedLearner, RankLost
from .dynamic_sampling import GenerationRounds
from .engines import EmbeddedEngine, VllmEngine
from .experiment import ExperimentConfig, read_tasks
from .learner import (
    Learner,
    UpdateInput,
    read_tokenizer_files,
    reward_metrics,
    rollout_rewards_and_groups,
    write_files,
)
from .metrics import MetricsLog, summary_line
from .plan import TaskPlan
from .recovery import Interruption, Journal
from .sampling import TemperatureCheck
from .services import Services, start_runners, start_services
from .signal import SignalWatcher, Stall, truncated_share
from .supervision import ChildLost, Supervisor, again

if TYPE_CHECKING:
    from lightning_grpc.client.trainer import TrainingBatch

log = logs.get_logger(__name__)

#: Batch drop reasons of rollouts that failed (a step with only these trained nothing: an error).
FAILURE_DROPS = frozenset(
    {
        "rollout_failed",
        "rollout_timed_out",
        "rollout_unresponsive",
        "rollout_cancelled",
        "group_dropped_for_failed_sibling",
        "rollout_dropped",  # what failure_policy = "drop_rollout" did with each of them
    }
)

#: Seconds after a SIGINT/SIGTERM during which another one is taken as the same request.
SIGNAL_GRACE_S = 3.0

#: How far the run got, in its output directory (read by a resumed run).
RUN_STATE = recovery.RUN_STATE

PRINTED = (
    "reward_mean",
    "solved",
    "val_reward",
    "zero_variance_groups",
    "filtered_groups",
    "pg_clipfrac",
    "entropy",
    "step_seconds",
)


@dataclass
class RunResult:
    steps: int
    stopped_because: str
    val_before: float | None
    val_after: float | None
    checkpoint: Path
    history: list[dict[str, float]] = field(default_factory=list)
    transcripts: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    time_split: dict[str, float] = field(default_factory=dict)
    #: The step this invocation resumed after (None: it started the run); seconds and time_split are this
    #: invocation's alone.
    resumed_from: int | None = None
    #: Every interruption of the run so far (``interruptions.jsonl``), earlier invocations' included.
    interruptions: list[Interruption] = field(default_factory=list)


class RunInterrupted(Exception):
    """The run was stopped by SIGINT (Ctrl-C) or SIGTERM after saving a checkpoint of its last step."""

    def __init__(self, signum: int, checkpoint: Path | None, step: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}")
        self.signum, self.checkpoint, self.step = signum, checkpoint, step

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process that a signal stopped (130 for Ctrl-C)."""
        return 128 + self.signum


class RunFailed(RuntimeError):
    """The run cannot go on (a step where every rollout failed, a child that keeps dying): its message says
    what happened, in the words of the part that failed."""


class StepFailed(RunFailed):
    """Every rollout of a step failed."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class Validation:
    reward: float
    solved: float
    failed: int
    transcript: str


class CpuClock:
    """CPU seconds each process spent since the last reading (where the time of a step goes)."""

    def __init__(self, processes: Mapping[str, Sequence[int]]) -> None:
        self._procs: dict[str, list[psutil.Process]] = {}
        for name, pids in processes.items():
            for pid in pids:
                try:
                    self._procs.setdefault(name, []).append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    continue
        self._last: dict[str, float] = {}
        self._last = self._read()

    def _read(self) -> dict[str, float]:
        out = {}
        for name, procs in self._procs.items():
            try:
                out[name] = sum(_cpu_seconds(proc, children=name != "trainer") for proc in procs)
            except psutil.Error:  # a process that died (and was restarted): its share is not counted
                out[name] = self._last.get(name, 0.0)
        return out

    def lap(self) -> dict[str, float]:
        now = self._read()
        lap = {f"cpu_{name}_seconds": now[name] - self._last.get(name, 0.0) for name in now}
        self._last = now
        return lap


def _cpu_seconds(proc: psutil.Process, *, children: bool) -> float:
    """CPU seconds of ``proc`` (and its children: a trainer's children are the other services, counted apart)."""
    times = proc.cpu_times()
    seconds = times.user + times.system
    if children:
        seconds += sum(c.cpu_times().user + c.cpu_times().system for c in proc.children(recursive=True))
    return float(seconds)


class TrainingRun:
    """One experiment, from set-up to the final checkpoint."""

    def __init__(
        self,
        config: ExperimentConfig,
        *,
        resume: Path | None = None,
        progress: bool = True,
        say: Callable[[str], None] = print,
        backend: UpdateBackend | None = None,
    ) -> None:
        self.config = config
        #: Where the update and the weights go instead of the learner and the engine (the verl backend).
        self.backend = backend
        self.resume = resume
        self.progress = progress
        self.say = say
        self.out = config.output_dir
        self.train_tasks = read_tasks(config.path(config.agent.train_tasks))
        self.val_tasks = read_tasks(config.path(config.agent.val_tasks)) if config.agent.val_tasks else []
        self.services: Services | None = None
        self.learner: Learner | DistributedLearner | None = None
        self.pad_id = 0
        #: The model's end-of-turn tokens: a response that ends with one at max_tokens was not cut.
        self.stop_ids: frozenset[int] = frozenset()
        self.policy_version = 0
        #: The store's file in the output directory (None: a store in memory, or one the run does not start).
        self.db = config.store_file
        if resume is None:  # a fresh start: an earlier run's store there would answer with its batches
            recovery.clear_for_fresh_start(self.out, self.db, checkpoints=False)
            if config.services.store_postgres and not config.services.store:
                recovery.check_database_is_empty(config.services.store_postgres)
        self.journal = Journal(self._prepared_output())
        self.metrics = MetricsLog(self.out)
        #: Groups submitted and not yet in a batch (async mode carries them over steps; kept in checkpoints).
        self.in_flight: list[str] = []
        #: The order training tasks are drawn in (how far it got is kept in checkpoints).
        self.plan = TaskPlan(len(self.train_tasks), config.experiment.seed)
        #: The plan's draws and the groups in flight when the last whole step ended (what a checkpoint keeps).
        self._step_end: tuple[int, list[str]] = (0, [])
        #: Set by SIGINT or SIGTERM: the signal's number, and when it came (monotonic seconds).
        self.interrupted = 0
        self._interrupted_at = 0.0
        self.supervisor: Supervisor | None = None
        #: Whether this invocation has published weights to the engine (what a restarted engine serves).
        self.published = False
        #: A step where every rollout failed in an earlier invocation, and how often: its groups are drawn anew
        #: (new ids, the same places in the task plan) instead of its failed batch being taken again.
        self.redraw_step, self.redraw = 0, 0
        #: Says when the run has had no learning signal for experiment.stall_window steps (and can stop it).
        self.signal = SignalWatcher(
            config.experiment.stall_window,
            zero_variance_fraction=config.experiment.stall_zero_variance_fraction,
            conditions=config.experiment.stall_conditions,
        )
        #: Warns once when calls were sampled at another temperature than sampling.temperature.
        self.temperatures = TemperatureCheck(
            config.sampling.temperature, say, learner_uses_recorded=backend is None
        )

    def _prepared_output(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2, default=str))
        return self.out

    # ------------------------------------------------------------ set-up
    def model_dir(self) -> Path:
        """The model the run starts from: the checkpoint resumed, or the configured one (built if asked)."""
        if self.resume is not None:
            return self.resume
        path = self.config.path(self.config.model.path)
        if not (path / "config.json").exists():
            if not self.config.model.init:
                raise FileNotFoundError(
                    f"model.path: no model in {path} (set model.init = true to build one)"
                )
            self.say(f"building the tiny model in {path}")
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "lightning_grpc.cli.main",
                    "init-model",
                    str(path),
                    "--seed",
                    str(self.config.experiment.seed),
                    "--hidden-size",
                    str(self.config.model.init_hidden_size),
                    "--heads",
                    str(self.config.model.init_heads),
                ],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"init-model failed:\n{done.stdout}{done.stderr}")
        return path

    def _learner(self, model_dir: Path) -> tuple[Learner | DistributedLearner, int]:
        """The learner: in this process, or with ``[learner] ranks > 1`` FSDP ranks placed by Ray."""
        torch.set_num_threads(self.config.services.trainer_threads)
        options: dict[str, Any] = {
            "ppo_config": self.config.ppo,
            "optim": self.config.optim,
            "seed": self.config.experiment.seed,
        }
        section = self.config.learner
        if section.ranks > 1:
            self.say(f"starting the learner's {section.ranks} ranks (Ray actors, FSDP)")
            options.update(
                ranks=section.ranks,
                dist_backend=section.dist_backend,
                ray_address=section.ray_address,
                threads=self.config.services.trainer_threads,
            )
            if self.resume is not None:
                ranked, extra = DistributedLearner.resume(self.resume, **options)
                self._restore(extra)
                return ranked, int(extra.get("policy_version", ranked.step))
            return DistributedLearner(model_path=model_dir, **options), 0
        if self.resume is not None:
            learner, extra = Learner.resume(self.resume, **options)
            self._restore(extra)
            return learner, int(extra.get("policy_version", learner.step))
        return Learner(model_path=model_dir, **options), 0

    def _restore(self, extra: Mapping[str, Any]) -> None:
        """What a checkpoint keeps of the loop: the groups in flight and how far the task plan got (a
        checkpoint written before the plan existed: as many draws as its steps took in sync mode)."""
        self.in_flight = list(extra.get("in_flight", []))
        step = int(extra.get("policy_version", 0))
        self.plan.drawn = int(extra.get("tasks_drawn", step * self.config.data.batch_size))
        self._step_end = (self.plan.drawn, list(self.in_flight))

    # ------------------------------------------------------------ the run
    async def run(self) -> RunResult:
        # what the run's children say (server, engine, runners), in files beside the run's other output
        processes.write_output_to(self.out / recovery.LOGS)
        try:
            return await self._run()
        finally:
            processes.write_output_to(None)

    async def _run(self) -> RunResult:
        started = time.monotonic()
        model_dir = self.model_dir()
        if self.backend is None:
            self.learner, self.policy_version = self._learner(model_dir)
            self.pad_id = _pad_id(self.learner.model.config)
            self.stop_ids = _stop_ids(self.learner.model.config)
        else:
            self.say("starting the update backend (its own checkpoints resume it)")
            self.backend.start()
            self.policy_version = self.backend.policy_version
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(model_dir)
            self.pad_id, self.stop_ids = _pad_id(model_config), _stop_ids(model_config)
        first_step = self.policy_version + 1 if self.learner is None else self.learner.step + 1
        self._note_resume(first_step)
        self.metrics.truncate(first_step - 1)
        self.say(f"starting the services (model {model_dir}, policy version {self.policy_version})")
        self.services = start_services(
            self.config,
            model_dir,
            policy_version=self.policy_version,
            db=self.db,
            start_engine=self.backend is None,
            current_version=lambda: self.policy_version,
        )
        self._restartable_engine(model_dir)
        self.say(f"the services' output: {self.out / recovery.LOGS}")
        if self.services.dashboard_url:
            self.say(f"dashboard (rollouts, traces, training curves, live): {self.services.dashboard_url}")
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert main is not None
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._interrupt, signum, main)
        try:
            return await self._supervised(first_step, started)
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            raise self._interrupted(first_step) from None
        except RankLost as lost:
            self._mark_failed(lost)
            raise self._rank_lost(lost) from None
        except Exception as error:
            self._mark_failed(error)
            raise
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            self.services.stop()
            self.metrics.close()
            if isinstance(self.learner, DistributedLearner):
                self.learner.close()  # its ranks, and the Ray it started

    async def _supervised(self, first_step: int, started: float) -> RunResult:
        """The run beside the supervisor of its children: a child that dies is restarted while the run goes
        on; one that cannot be (or died ``services.restarts`` times) ends the run with its own last lines."""
        assert self.services is not None
        svc = self.config.services
        self.supervisor = Supervisor(
            self.services,
            self.journal,
            restarts=svc.restarts,
            backoff=svc.restart_backoff,
            # the step in progress: the one after the last reported
            step=lambda: int(self.metrics.rows[-1]["step"]) + 1 if self.metrics.rows else first_step,
        )
        watch = asyncio.create_task(self.supervisor.watch(), name="supervisor")
        work = asyncio.create_task(self._run_with_services(first_step, started), name="training")
        try:
            done, _ = await asyncio.wait({watch, work}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            work.cancel()
            try:
                watch.result()
            except ChildLost as lost:
                raise RunFailed(str(lost)) from None
            raise RunFailed("the supervisor of the run's processes stopped")  # pragma: no cover
        finally:
            for task in (watch, work):
                task.cancel()
            await asyncio.gather(watch, work, return_exceptions=True)

    def _interrupt(self, signum: int, main: asyncio.Task[Any]) -> None:
        """SIGINT or SIGTERM: stop the step in progress and end with a checkpoint of the last finished step.

        A second signal within :data:`SIGNAL_GRACE_S` is the same request (a terminal and a wrapper such as
        ``timeout`` may both deliver it); a later one stops at once, without the checkpoint (the previous
        whole one stays the latest: checkpoints are replaced atomically, and children stop with their parent).
        """
        now = time.monotonic()
        if self.interrupted:
            if now - self._interrupted_at < SIGNAL_GRACE_S:
                return
            self.say(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint")
            os._exit(128 + signum)
        self.interrupted, self._interrupted_at = signum, now
        self.say(f"\n{signal.Signals(signum).name}: stopping; saving a checkpoint of the last finished step")
        main.cancel()

    def _interrupted(self, first_step: int) -> RunInterrupted:
        """The checkpoint of an interrupted run (its last whole step), and the line that says how to go on."""
        step = self.learner.step if self.learner is not None else self.policy_version
        path: Path | None = None
        if self.learner is not None and step >= first_step:
            path = self.checkpoint(step)
        else:
            path = self.resume or recovery.latest_checkpoint(self.out)
        self._mark_state("interrupted", step)
        where = f"checkpoint {path}" if path is not None else "no checkpoint (no step finished)"
        self.say(f"interrupted after step {step}: {where}")
        return RunInterrupted(self.interrupted, path, step)

    def _rank_lost(self, lost: RankLost) -> RunFailed:
        """A learner rank died: the run ends at its last whole checkpoint (named), which the same command
        resumes from. Why not go on: the rank's shards of the optimiser state since then are gone."""
        kept = recovery.latest_checkpoint(self.out) or self.resume
        where = (
            f"at its last whole checkpoint, {kept}"
            if kept is not None
            else "before its first checkpoint (the same command starts over)"
        )
        return RunFailed(
            f"{lost}; the run stops {where} (a rank is not restarted alone: its FSDP shards of the "
            "optimiser state since the last checkpoint died with it)"
        )

    def _restartable_engine(self, model_dir: Path) -> None:
        """The engine this run started comes back, after a crash, at the policy version last published; the
        proxy holds new calls while it starts (only the calls in flight when it died fail). vLLM comes back
        on its socket, and its gate on its port, so the proxy's upstream stays the same. An engine the user
        serves (``services.engine``) is theirs to restart."""
        assert self.services is not None
        engine = self.services.engine
        if not isinstance(engine, EmbeddedEngine | VllmEngine) or self.config.services.engine:
            return
        # read now: the checkpoint the run resumed from may be pruned before the engine next needs them
        tokenizer = read_tokenizer_files(model_dir)
        child = self.services.child("engine")
        child.restart = lambda: engine.restart(
            self._served_weights(model_dir, tokenizer), self.policy_version
        )
        child.hold = self._hold_calls
        if isinstance(engine, VllmEngine):
            # vLLM takes a minute or more to start: the agents' clients retry a held call six times
            # (runner.llm.openai_client), each after Retry-After, which then spans twice its first start
            wait = min(60.0, max(1.0, engine.start_seconds / 3))
            child.hold = functools.partial(self._hold_calls, retry_after=wait)
            gate = self.services.child("engine-gate")
            gate.restart, gate.hold = engine.restart_gate, self._hold_calls

    def _served_weights(self, model_dir: Path, tokenizer: Mapping[str, bytes]) -> Path:
        """What the engine serves now: the weights this invocation last published (with the tokenizer beside
        them), else the model it started from (a crashed invocation's weights there are not this run's)."""
        weights = self.out / "weights"
        if not self.published:
            return model_dir
        write_files(tokenizer, weights)
        return weights

    @contextlib.asynccontextmanager
    async def _hold_calls(self, retry_after: float | None = None) -> AsyncIterator[None]:
        """The proxy holds new calls (a paused proxy answers them once resumed) while a child restarts;
        ``retry_after``: when it tells the refused callers to come back (None: the proxy's default)."""
        proxy = getattr(self, "proxy", None)  # None: the run's clients are not connected yet
        try:
            if proxy is not None:
                await proxy.pause("the engine is restarting", retry_after=retry_after)
        except LightningError:  # the server is down too: nothing reaches the engine meanwhile
            pass
        try:
            yield
        finally:
            if proxy is not None:
                with contextlib.suppress(LightningError):
                    await again("resume", proxy.resume, patience=60)

    # ------------------------------------------------------------ resuming
    def _note_resume(self, first_step: int) -> None:
        """A resumed run: the interruption that ended the earlier invocation, in the journal (what is redone)."""
        state = self._read_state()
        self.resumed_from = first_step - 1 if self.resume is not None else None
        if self.resume is None or not state:
            self._mark_state("running", first_step - 1)
            return
        last = int(state.get("step", first_step - 1))
        redone = f"; steps {first_step}-{last} redone from their stored batches" if last >= first_step else ""
        how = state.get("status", "running")
        causes = {
            "interrupted": "stopped by a signal (a clean stop, with a checkpoint)",
            "failed": f"stopped on an error: {state.get('error', '?')}",
            "finished": "had finished",
        }
        cause = causes.get(how, "ended without stopping the run (killed, or its machine went down)")
        if how == "failed" and state.get("failed_step") == last + 1 and last + 1 >= first_step:
            self.redraw_step, self.redraw = last + 1, int(state.get("redraws", 1))
            redone += f"; step {last + 1}, where every rollout had failed, drawn anew"
        stopped_at = float(state.get("time", time.time()))
        self.journal.record(
            Interruption(
                time=stopped_at,
                step=last,
                process="trainer",
                cause=cause,
                recovery=f"resumed from checkpoint {self.resume.name}{redone}",
                recovery_seconds=round(time.time() - stopped_at, 3),
            )
        )
        self._mark_state("running", first_step - 1)

    def _mark_failed(self, error: Exception) -> None:
        """``run_state.json`` says the run stopped on an error (and, for a step where every rollout failed,
        which step: the same command draws that step's groups anew instead of taking its failed batch)."""
        done = int(self.metrics.rows[-1]["step"]) if self.metrics.rows else (self.resumed_from or 0)
        state: dict[str, Any] = {"error": str(error).splitlines()[0][:500]}
        if isinstance(error, StepFailed):
            state.update(
                failed_step=error.step, redraws=self.redraw + 1 if error.step == self.redraw_step else 1
            )
        self._mark_state("failed", done, **state)

    def _read_state(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.out / RUN_STATE).read_text()))
        except (OSError, ValueError):
            return {}

    def _mark_state(self, status: str, step: int, **more: Any) -> None:
        """``run_state.json``: how far the run got and whether it is running, was interrupted, failed or
        finished."""
        state = {"status": status, "step": step, "time": time.time(), "pid": psutil.Process().pid, **more}
        tmp = self.out / (RUN_STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.out / RUN_STATE)

    async def _run_with_services(self, first_step: int, started: float) -> RunResult:
        assert self.services is not None and (self.learner is not None or self.backend is not None)
        svc = self.services
        cfg = self.config
        # A store with auth on (its admin token in $LIGHTNING_GRPC_TOKEN, which the server and runners this run
        # starts take as well) is driven with that token: a training run is the admin role.
        token = environment.read(environment.TOKEN)
        client_config = ClientConfig(target=svc.store, timeout=120.0, token=token)
        async with (
            StoreClient(client_config) as store,
            TrainerClient(client_config) as trainer,
            ProxyClient(ClientConfig(target=svc.proxy_grpc, token=token)) as proxy,
            aiohttp.ClientSession() as http,
        ):
            self.store, self.trainer, self.proxy, self.http = store, trainer, proxy, http
            if self.backend is not None:  # the backend's inference servers behind the proxy
                await proxy.set_backends(await self.backend.proxy_backends(cfg.model.served_name, http))
            self.resources_id = await self._llm_resource(svc.proxy_url)
            start_runners(cfg, svc)
            clock = CpuClock(self._pids())
            before = await self.validate(first_step - 1) if self.val_tasks else None
            if before is not None:
                when = (
                    "before training"
                    if self.resumed_from is None
                    else f"at the resumed step {self.resumed_from} (before this invocation's steps)"
                )
                self.say(f"validation {when}: reward {before.reward:.3f} (solved {before.solved:.2f})")
            val_after = before
            reason = "step limit"
            step = first_step - 1
            bar = self._bar(first_step)
            in_flight = self.in_flight
            for step in range(first_step, cfg.experiment.steps + 1):
                metrics = await self.train_step(step, in_flight)
                self._step_end = (self.plan.drawn, list(in_flight))
                metrics.update(clock.lap())
                if self.val_tasks and cfg.validation.every and step % cfg.validation.every == 0:
                    val = await self.validate(step)
                    metrics.update(
                        {"val_reward": val.reward, "val_solved": val.solved, "val_failed": val.failed}
                    )
                    val_after = val
                stalls = self._watch_signal(step, metrics)
                metrics["interruptions"] = float(len(self.journal.read()))
                self.metrics.add(step, metrics)
                await self._report(step, metrics)
                self._mark_state("running", step)
                self._show(bar, step, metrics)
                self._warn(bar, stalls)
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                    self.checkpoint(step)
                target = cfg.validation.target
                if (
                    target is not None
                    and val_after is not None
                    and "val_reward" in metrics
                    and val_after.reward >= target
                ):
                    reason = f"validation reward {val_after.reward:.3f} reached the target {target:g}"
                    break
                if cfg.experiment.stop_when_stalled and self.signal.stalled():
                    reason = self._stalled_reason()
                    break
            if bar is not None:
                bar.close()
            if self.val_tasks and self.metrics.rows and "val_reward" not in self.metrics.rows[-1]:
                val_after = await self.validate(step)
                self.metrics.update(step, {"val_reward": val_after.reward, "val_solved": val_after.solved})
            final = self.checkpoint(step, final=True)
            self._mark_state("finished", step)
            plot = self.metrics.plot(self.out / "reward.png", cfg.validation.target)
            if plot is not None:
                self.say(f"reward curve: {plot}")
            self.say(f"metrics: {self.metrics.csv_path}")
            return RunResult(
                steps=step - first_step + 1,
                stopped_because=reason,
                val_before=None if before is None else before.reward,
                val_after=None if val_after is None else val_after.reward,
                checkpoint=final,
                history=[dict(r) for r in self.metrics.rows],
                transcripts={
                    "before": before.transcript if before else "",
                    "after": val_after.transcript if val_after else "",
                },
                seconds=time.monotonic() - started,
                time_split=self._time_split(first_step),
                resumed_from=self.resumed_from,
                interruptions=self.journal.read(),
            )

    async def _llm_resource(self, proxy_url: str) -> str:
        """The agents' LLM (the proxy), under one id for the whole run: a resumed run, whose proxy listens
        elsewhere, updates it, so the rollouts already queued with it reach the new proxy."""
        cfg = self.config
        resources = {
            "llm": ProxyLLM(
                endpoint=f"{proxy_url}/v1",
                model=cfg.model.served_name,
                sampling_parameters={
                    "temperature": cfg.sampling.temperature,
                    "top_p": cfg.sampling.top_p,
                    "max_tokens": cfg.sampling.max_tokens,
                },
            )
        }
        rid = f"{cfg.experiment.name}-llm"
        try:
            return (await self.store.add_resources(resources, rid)).resources_id
        except AlreadyExistsError:  # this run's, from an earlier invocation
            return (await self.store.update_resources(rid, resources)).resources_id

    async def _report(self, step: int, metrics: Mapping[str, float]) -> None:
        """The step, and the interruptions recovered since the last report, to TrainerService."""
        interruptions = self.journal.take_unreported()
        await again(
            "report_step",
            lambda: self.trainer.report_step(
                step,
                self.policy_version,
                metrics,
                run_id=self.config.experiment.name,
                interruptions=interruptions,
            ),
        )

    def _pids(self) -> dict[str, list[int]]:
        assert self.services is not None
        pids: dict[str, list[int]] = {"trainer": [psutil.Process().pid]}
        for child in self.services.children:  # runners-0, runners-1, ... as one: runners
            name = child.name.split("-", 1)[0] if child.name.startswith("runners") else child.name
            pids.setdefault(name, []).append(child.process.proc.pid)
        return pids

    # ------------------------------------------------------------ one step
    async def train_step(self, step: int, in_flight: list[str]) -> dict[str, float]:
        cfg = self.config
        t0 = time.perf_counter()
        sync = cfg.experiment.mode == "sync"
        wanted = cfg.data.batch_size if sync else cfg.experiment.async_groups - len(in_flight)
        groups = await self.submit(
            self.train_tasks, step, max(0, wanted), cfg.data.group_size, "train", f"s{self._step_tag(step)}"
        )
        in_flight.extend(groups)
        min_version = None if sync else max(0, self.policy_version - cfg.experiment.max_staleness)
        t1 = time.perf_counter()
        if sync:  # generation apart from the data path: wait for every rollout of the step first
            ids = [f"{gid}-r{i}" for gid in groups for i in range(cfg.data.group_size)]
            await again("wait_for_rollouts", lambda: self.store.wait_for_rollouts(ids, timeout=3600))
        t_generated = time.perf_counter()
        batch = await self._take_batch(
            f"{cfg.experiment.name}-b{self._step_tag(step)}", cfg.data.batch_size, sync, min_version
        )
        await self._check_not_all_failed(step, batch)
        for gid in batch.group_ids:
            if gid in in_flight:  # (a batch asked again after a resume holds the same groups)
                in_flight.remove(gid)
        sampled: dict[str, float] = {}
        rounds_seconds = 0.0  # sync: the extra generation rounds of dynamic sampling (counted as generation)
        if cfg.data.filter_groups:  # flat groups set aside, the missing ones drawn (sync: generated) again
            t_rounds = time.perf_counter()
            batch, sampled = await self._filter_groups(step, batch, in_flight, sync, min_version)
            rounds_seconds = time.perf_counter() - t_rounds
        t2 = time.perf_counter()
        if self.backend is not None:
            metrics, t3 = await self._backend_update(batch, step)
        else:
            assert self.learner is not None
            metrics = (
                self.learner.update(UpdateInput(batch.arrays, batch.uid, cfg.validation.solved_at))
                if len(batch)
                else {}
            )
            t3 = time.perf_counter()
            self.policy_version = self.learner.step
            await self.publish_weights(pause=sync)
        t4 = time.perf_counter()
        metrics.update(sampled)  # with filter_groups: the reward metrics of every group generated
        metrics.update(self._truncated_responses(batch))
        metrics.update(self.temperatures(batch.arrays))
        metrics.update({f"drop_{reason}": float(count) for reason, count in batch.drops.items()})
        metrics.update({f"trajectory_fallback_{reason}": float(n) for reason, n in batch.fallbacks.items()})
        metrics.update(
            {
                "policy_version": float(self.policy_version),
                "carried_over_groups": float(batch.carried_over_groups),
                "batch_rows": float(len(batch)),
                "step_seconds": t4 - t0,
                # sync: rollouts until every group ended; async: waiting for the batch (data path included)
                "generation_seconds": t_generated - t1 + rounds_seconds if sync else t2 - t1,
                "data_path_seconds": t2 - t_generated - rounds_seconds if sync else 0.0,
                "update_seconds": t3 - t2,
                "weight_sync_seconds": t4 - t3,
            }
        )
        return metrics

    def _step_tag(self, step: int) -> str:
        """What the step's group and batch ids carry: its number, and for a step drawn anew after every rollout
        of it failed, how often (``7-again1``)."""
        return f"{step}-again{self.redraw}" if step == self.redraw_step else str(step)

    async def _check_not_all_failed(self, step: int, batch: TrainingBatch) -> None:
        """A step where every rollout failed trains nothing, and no later step would do better: an error that
        says what the rollouts' last attempts reported."""
        failed = sum(n for reason, n in batch.drops.items() if reason in FAILURE_DROPS)
        if len(batch) or not failed or sum(batch.drops.values()) != failed:
            return
        failed = batch.drops.get("rollout_failed", 0) or failed
        said: list[str] = []
        for gid in batch.group_ids[:3]:
            attempt = await again(
                "get_latest_attempt", functools.partial(self.store.get_latest_attempt, gid + "-r0")
            )
            if attempt is not None:
                said.append(
                    f"  {attempt.rollout_id}: {attempt.status.name.lower()}: {attempt.status_message or '-'}"
                )
        raise StepFailed(
            step,
            f"step {step}: every rollout failed ({failed} dropped: "
            + ", ".join(f"{r} {n}" for r, n in sorted(batch.drops.items()))
            + "); nothing to train on. What their last attempts said:\n"
            + "\n".join(said or ["  (no attempt recorded)"])
            + "\n`lightning-grpc rollouts --status failed` lists them; the dashboard shows each attempt's spans.",
        )

    async def _take_batch(
        self, request_id: str, groups: int, sync: bool, min_version: int | None
    ) -> TrainingBatch:
        """``groups`` whole groups from TrainerService under ``request_id`` (asked again: the same groups)."""
        cfg = self.config
        return await again(
            "get_batch",
            lambda: self.trainer.get_batch(
                min_groups=groups,
                max_groups=groups,
                wait=60 if sync else 3600,
                request_id=request_id,
                pad_token_id=self._pad_id(),
                max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=cfg.data.max_response_length,
                aggregation=cfg.data.aggregation,
                failure_policy=cfg.data.failure_policy,
                fill_reward=cfg.data.fill_reward,
                min_policy_version=min_version,
            ),
        )

    #: The dynamic-sampling cap has been reported (once a run).
    _filter_groups_capped_said = False

    async def _filter_groups(
        self, step: int, batch: TrainingBatch, in_flight: list[str], sync: bool, min_version: int | None
    ) -> tuple[TrainingBatch, dict[str, float]]:
        """Dynamic sampling (``[data] filter_groups``; DAPO, verl's ``algorithm.filter_groups``): the step's
        batch without its groups of equal rewards, filled up over more generation rounds.

        Round ``r`` (1, 2, ...) draws the groups still missing from the seeded plan (tag ``s{step}-r{r}``;
        sync: submitted and played to the end; async: the groups in flight topped up to
        ``experiment.async_groups``) and takes them as batch ``{name}-b{step}-r{r}``, until
        ``data.batch_size`` groups with a reward spread are in or ``data.max_num_gen_batches`` rounds were
        played; then the step trains on what it has (said once a run). Every group set aside was taken by
        its round's batch, so none enters another; a repeated step asks the same ids and gets the same
        groups, so it makes the same choices. Returns the batch to train on and the step's metrics
        (:meth:`.GenerationRounds.metrics`).
        """
        cfg = self.config
        rounds = GenerationRounds(cfg.data.batch_size, cfg.data.max_num_gen_batches)
        rounds.add(batch)
        while rounds.more:
            tag = f"s{self._step_tag(step)}-r{rounds.rounds}"
            if sync:
                missing = rounds.missing
                groups = await self.submit(self.train_tasks, step, missing, cfg.data.group_size, "train", tag)
                in_flight.extend(groups)
                ids = [f"{gid}-r{i}" for gid in groups for i in range(cfg.data.group_size)]
                wait = functools.partial(self.store.wait_for_rollouts, ids, timeout=3600)
                await again("wait_for_rollouts", wait)
            else:
                topped = max(0, cfg.experiment.async_groups - len(in_flight))
                in_flight.extend(
                    await self.submit(self.train_tasks, step, topped, cfg.data.group_size, "train", tag)
                )
            more = await self._take_batch(
                f"{cfg.experiment.name}-b{self._step_tag(step)}-r{rounds.rounds}",
                rounds.missing,
                sync,
                min_version,
            )
            for gid in more.group_ids:
                if gid in in_flight:
                    in_flight.remove(gid)
            rounds.add(more)
        if rounds.capped and not self._filter_groups_capped_said:
            self._filter_groups_capped_said = True
            message = (
                f"dynamic sampling reached data.max_num_gen_batches = {rounds.limit} at step {step} with "
                f"{rounds.kept} of {rounds.wanted} groups with a reward spread ({rounds.filtered} groups of "
                "equal rewards set aside): the step trains on those it has (metric filter_groups_capped; said "
                "once a run). Raise data.max_num_gen_batches, or see the no-learning-signal remedies."
            )
            log.warning(
                "event=filter_groups_capped step=%d kept_groups=%d batch_size=%d gen_batches=%d "
                "filtered_groups=%d",
                step,
                rounds.kept,
                rounds.wanted,
                rounds.rounds,
                rounds.filtered,
            )
            self.say(f"warning: {message}")
        return rounds.batch(pad_token_id=self._pad_id()), rounds.metrics(cfg.validation.solved_at)

    def _truncated_responses(self, batch: TrainingBatch) -> dict[str, float]:
        """The share of rows cut at sampling.max_tokens (what the watcher's max_tokens condition reads).

        The batch carries no finish reason: a response as long as max_tokens whose last token is not one of
        the model's stop tokens counts as cut (an answer that ends with its stop token right at the limit is
        whole). Transition rows only (a trajectory row's response spans several calls), padded layout.
        """
        lengths = batch.arrays.get("response_lengths")
        responses = batch.arrays.get("responses")
        if (
            lengths is None
            or responses is None
            or getattr(responses, "ndim", 0) != 2
            or not len(lengths)
            or self.config.data.aggregation != Aggregation.TRANSITION
        ):
            return {}
        share = truncated_share(lengths, responses, self.config.sampling.max_tokens, self.stop_ids)
        return {"truncated_responses": share}

    async def _backend_update(self, batch: TrainingBatch, step: int) -> tuple[dict[str, float], float]:
        """The backend's update and weight sync; its inference servers pause meanwhile, so the proxy holds
        new calls and lets those in flight finish first. Returns (metrics, when the update ended)."""
        assert self.backend is not None
        await self.proxy.pause("weight update")
        await self.proxy.drain(timeout=120)
        try:
            metrics = await asyncio.to_thread(self.backend.update, batch, step) if len(batch) else {}
            ended = time.perf_counter()
            self.policy_version = self.backend.policy_version
            # later calls are recorded with the new version (the backend's servers do not report one)
            await self.proxy.set_backends(
                await self.backend.proxy_backends(self.config.model.served_name, self.http)
            )
        finally:
            await self.proxy.resume()
        rewards, groups = rollout_rewards_and_groups(batch.arrays, batch.uid)
        solved_at = self.config.validation.solved_at
        return {**metrics, **reward_metrics(rewards.numpy(), groups, solved_at)}, ended

    async def submit(
        self, tasks: Sequence[Any], step: int, groups: int, group_size: int, mode: str, tag: str
    ) -> list[str]:
        """``groups`` GRPO groups of tasks drawn for this step (seeded), with ids that name the step."""
        if groups <= 0:
            return []
        from lightning_grpc.batching import GroupSample

        name = self.config.experiment.name
        if mode == "train":  # the seeded epochs of the plan: every task once per epoch
            samples = [
                GroupSample(tasks[self.plan.at(p)], f"{name}-{tag}-g{i}", self.plan.metadata(p))
                for i, p in enumerate(self.plan.draw(groups))
            ]
        else:  # validation: its tasks in a seeded order of their own
            rng = random.Random(f"{self.config.experiment.seed}-{tag}")
            chosen = [tasks[i % len(tasks)] for i in rng.sample(range(max(groups, len(tasks))), groups)]
            samples = [GroupSample(task, f"{name}-{tag}-g{i}") for i, task in enumerate(chosen)]
        agent = self.config.agent
        # an attempt whose runner (or the engine under it) died is tried again, its calls kept apart
        retried = (AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE)
        rollout_config = RolloutConfig(
            timeout=agent.rollout_timeout,
            unresponsive_timeout=agent.unresponsive_timeout,
            max_attempts=agent.max_attempts,
            retry_on=retried if agent.max_attempts > 1 else (),
        )
        submitted = await again(  # idempotent: the group ids name the step
            "submit_groups",
            lambda: self.trainer.submit_groups(
                samples,
                group_size,
                mode=mode,
                resources_id=self.resources_id,
                config=rollout_config,
                step=step,
            ),
        )
        return [g.group_id for g in submitted]

    def _pad_id(self) -> int:
        return self.pad_id

    async def publish_weights(self, *, pause: bool) -> None:
        """The learner's weights into the engine (:mod:`.engines`), as policy version ``self.policy_version``.

        Sync mode (``pause``): the proxy holds new calls and drains those in flight, the engine pauses too
        (vLLM: ``/pause``), the weights swap, then both resume. An engine whose answers carry no policy
        version (vLLM) reports the one it now serves, and the proxy's backend entry is set to it, so every
        later call records what the engine said.
        """
        assert self.learner is not None and self.services is not None
        engine = self.services.engine
        if engine is None:
            raise RuntimeError("no engine serves the policy: nothing to publish the weights to")
        path = self.learner.export_weights(self.out / "weights")
        self.published = True
        if pause:
            await again("pause", lambda: self.proxy.pause("weight update"))
            await again("drain", lambda: self.proxy.drain(timeout=120))
            await again("engine_pause", engine.pause)  # (a vLLM being restarted: once it serves)
        try:
            # the engine may be coming back from a crash (the supervisor restarts it): wait and load again
            served = await again("load_weights", lambda: engine.load_weights(path, self.policy_version))
            if not engine.reports_version:
                await self.proxy.set_backends(
                    [
                        Backend(
                            model_name=self.config.model.served_name,
                            api_base=f"{engine.url}/v1",
                            policy_version=served,
                        )
                    ]
                )
        finally:
            if pause:
                await again("engine_resume", engine.resume)
                await again("resume", self.proxy.resume)

    # ------------------------------------------------------------ validation
    async def validate(self, step: int) -> Validation:
        """The validation tasks at the current weights (mode val: never trained)."""
        cfg = self.config
        groups = await self.submit(
            self.val_tasks, step, len(self.val_tasks), cfg.validation.samples, "val", f"v{step}"
        )
        ids = [f"{gid}-r{i}" for gid in groups for i in range(cfg.validation.samples)]
        await again("wait_for_rollouts", lambda: self.store.wait_for_rollouts(ids, timeout=600))
        rewards: list[float] = []
        failed = 0
        transcript = ""
        for rid in ids:
            spans = await again("query_spans", functools.partial(self.store.query_spans, rid, "latest"))
            reward = final_reward(spans)
            rollout = await again("get_rollout", functools.partial(self.store.get_rollout, rid))
            if reward is None or rollout.status.name != "SUCCEEDED":
                failed += 1
                reward = 0.0  # evaluation counts a failure as no reward; training never does
            rewards.append(reward)
            if not transcript:
                transcript = transcript_of(spans, reward)
        await again(  # hands the val groups out of the book; nothing trains on them
            "get_batch",
            lambda: self.trainer.get_batch(
                min_groups=len(groups),
                max_groups=len(groups),
                mode="val",
                wait=60,
                failure_policy="fill",
                request_id=f"{cfg.experiment.name}-v{step}",  # a resumed run asks again: the same answer
            ),
        )
        solved = sum(r >= cfg.validation.solved_at for r in rewards) / max(1, len(rewards))
        return Validation(sum(rewards) / max(1, len(rewards)), solved, failed, transcript)

    # ------------------------------------------------------------ checkpoints and output
    def checkpoint(self, step: int, *, final: bool = False) -> Path:
        """The learner's state after ``step``, written whole or not at all (:func:`.recovery.write_atomically`:
        a kill during the write leaves the previous checkpoint the latest)."""
        if self.learner is None:  # the backend checkpoints itself
            assert self.backend is not None
            return self.backend.checkpoint_dir
        learner = self.learner
        extra = {
            "policy_version": self.policy_version,
            "experiment": self.config.experiment.name,
            # as the last whole step left them (an interrupted step's draws are made again on resume):
            # async mode's groups submitted and not yet trained, and how far the task plan got
            "in_flight": list(self._step_end[1]),
            "tasks_drawn": self._step_end[0],
        }
        if final:
            return recovery.write_atomically(self.out / "final", lambda p: learner.save_checkpoint(p, extra))
        folder = self.out / recovery.CHECKPOINTS
        folder.mkdir(parents=True, exist_ok=True)
        path = recovery.write_atomically(
            folder / f"step-{step:06d}", lambda p: learner.save_checkpoint(p, extra)
        )
        recovery.prune(self.out, self.config.checkpoint.keep)
        return path

    def _bar(self, first_step: int) -> Any:
        if not self.progress:
            return None
        tqdm = import_extra("tqdm", "train").tqdm
        return tqdm(
            total=self.config.experiment.steps,
            initial=first_step - 1,
            desc="training",
            unit="step",
            leave=True,
        )

    def _show(self, bar: Any, step: int, metrics: Mapping[str, float]) -> None:
        line = summary_line(step, metrics, self._printed())
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(
                " ".join(f"{k}={metrics[k]:.2f}" for k in ("reward_mean", "val_reward") if k in metrics)
            )
            bar.write(line)
        else:
            self.say(line)

    def _printed(self) -> tuple[str, ...]:
        """The step line's metrics; pg_clipfrac only where it can be non-zero: more than one optimiser step per
        training step, or a ratio against the engine's log-probs (else the ratio is 1: see docs/metrics.md)."""
        optim = self.config.optim
        if optim.ppo_epochs > 1 or optim.mini_batch_rollouts > 0 or optim.old_log_probs == "rollout":
            return PRINTED
        return tuple(name for name in PRINTED if name != "pg_clipfrac")

    # ------------------------------------------------------------ no learning signal
    def _watch_signal(self, step: int, metrics: dict[str, float]) -> list[Stall]:
        """Feed the step to the watcher; its ``stalled_<condition>`` metrics join the step's."""
        stalls = self.signal.observe(step, metrics)
        metrics.update(self.signal.metrics())
        return stalls

    def _warn(self, bar: Any, stalls: Sequence[Stall]) -> None:
        """Each new stall on its own line (``warning: ...``) and in the log."""
        for stall in stalls:
            log.warning(
                "event=training_no_signal condition=%s first_step=%d last_step=%d message=%s",
                stall.condition,
                stall.first_step,
                stall.last_step,
                stall.message,
            )
            line = f"warning: {stall.message}"
            if bar is not None:
                bar.write(line)
            else:
                self.say(line)

    def _stalled_reason(self) -> str:
        """Why the run stops with experiment.stop_when_stalled (RunResult.stopped_because)."""
        names = ", ".join(self.signal.stalled())
        return f"no learning signal ({names}) for {self.signal.window} steps in a row (stop_when_stalled)"

    def _time_split(self, first_step: int) -> dict[str, float]:
        """Seconds spent per part over this invocation's steps (sums of the per-step figures)."""
        rows = [r for r in self.metrics.rows if float(r.get("step", 0)) >= first_step]
        names = [k for k in rows[-1] if k.endswith("_seconds")] if rows else []
        return {
            name: sum(float(r.get(name, 0.0)) for r in rows if isinstance(r.get(name), float))
            for name in names
        }


def transcript_of(spans: Sequence[Span], reward: float | None) -> str:
    """The conversation of a rollout, read from its LLM-call spans: each prompt's last message, each answer
    (its text, or the tool calls it made)."""
    lines = []
    calls = sorted(
        (s for s in spans if s.name == semconv.SPAN_LLM_CALL), key=lambda s: s.start_time_unix_nano
    )
    for span in calls:
        request = json_object(span.attributes.get(semconv.LLM_REQUEST))
        response = json_object(span.attributes.get(semconv.LLM_RESPONSE))
        messages = request.get("messages") or []
        if messages:
            last = messages[-1]
            lines.append(f"  {last.get('role', 'user')}: {last.get('content', '')}")
        answer = response_message(response)
        made = [call.text() for call in tool_calls_of(answer.get("tool_calls"))]
        lines += [f"  assistant: {call}" for call in made]
        if answer.get("content") or not made:
            lines.append(f"  assistant: {answer.get('content', '')!r}")
    lines.append(f"  reward: {reward if reward is not None else 'none'}")
    return "\n".join(lines)


def run_experiment(
    config: ExperimentConfig,
    *,
    resume: Path | None = None,
    progress: bool = True,
    backend: UpdateBackend | None = None,
) -> RunResult:
    return asyncio.run(TrainingRun(config, resume=resume, progress=progress, backend=backend).run())


class UpdateBackend(Protocol):
    """Where a run's updates happen instead of the in-process learner (``train --backend verl``).

    It owns the model's weights and the inference servers that sample from them: the proxy routes the
    agents' calls to :meth:`proxy_backends`; :meth:`update` trains on one batch and brings the servers
    the new weights; :attr:`policy_version` is the version they then serve.
    """

    def start(self) -> list[str]: ...

    async def proxy_backends(self, model_name: str, http: aiohttp.ClientSession) -> list[Backend]: ...

    def update(self, batch: TrainingBatch, step: int) -> dict[str, float]: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def checkpoint_dir(self) -> Path: ...


def _stop_ids(model_config: Any) -> frozenset[int]:
    eos = getattr(model_config, "eos_token_id", None)
    values = eos if isinstance(eos, list | tuple) else [eos]
    return frozenset(int(v) for v in values if isinstance(v, int))


def _pad_id(model_config: Any) -> int:
    pad = getattr(model_config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0
