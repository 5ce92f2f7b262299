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
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning_grpc._extras import extra_imports, import_extra

with extra_imports("train"):
    import aiohttp
    import psutil
    import torch

from lightning_grpc import environment, logs, semconv
from lightning_grpc.algorithm import final_reward
from lightning_grpc.batching.options import Aggregation
from lightning_grpc.client import ClientConfig, StoreClient, TrainerClient
from lightning_grpc.client.proxy import ProxyClient
from lightning_grpc.proxy import Backend
from lightning_grpc.triplets.conversation import json_object, response_message, tool_calls_of
from lightning_grpc.types import ProxyLLM, RolloutConfig, Span

from .distributed import DistributedLearner
from .experiment import ExperimentConfig, read_tasks
from .learner import Learner, UpdateInput, reward_metrics, rollout_rewards_and_groups
from .metrics import MetricsLog, summary_line
from .services import Services, start_runners, start_services
from .signal import SignalWatcher, Stall, truncated_share

if TYPE_CHECKING:
    from lightning_grpc.client.trainer import TrainingBatch

log = logs.get_logger(__name__)

PRINTED = (
    "reward_mean",
    "solved",
    "val_reward",
    "zero_variance_groups",
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


@dataclass
class Validation:
    reward: float
    solved: float
    failed: int
    transcript: str


class CpuClock:
    """CPU seconds each process spent since the last reading (where the time of a step goes)."""

    def __init__(self, processes: Mapping[str, int]) -> None:
        self._procs = {}
        for name, pid in processes.items():
            try:
                self._procs[name] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
        self._last = self._read()

    def _read(self) -> dict[str, float]:
        out = {}
        for name, proc in self._procs.items():
            try:
                times = proc.cpu_times()
                out[name] = times.user + times.system
                if name != "trainer":  # the trainer's children are the other services, counted apart
                    out[name] += sum(
                        c.cpu_times().user + c.cpu_times().system for c in proc.children(recursive=True)
                    )
            except psutil.Error:
                out[name] = self._last.get(name, 0.0) if hasattr(self, "_last") else 0.0
        return out

    def lap(self) -> dict[str, float]:
        now = self._read()
        lap = {f"cpu_{name}_seconds": now[name] - self._last.get(name, 0.0) for name in now}
        self._last = now
        return lap


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
        self.metrics = MetricsLog(self._prepared_output())
        #: Says when the run has had no learning signal for experiment.stall_window steps (and can stop it).
        self.signal = SignalWatcher(
            config.experiment.stall_window,
            zero_variance_fraction=config.experiment.stall_zero_variance_fraction,
            conditions=config.experiment.stall_conditions,
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
                return ranked, int(extra.get("policy_version", ranked.step))
            return DistributedLearner(model_path=model_dir, **options), 0
        if self.resume is not None:
            learner, extra = Learner.resume(self.resume, **options)
            return learner, int(extra.get("policy_version", learner.step))
        return Learner(model_path=model_dir, **options), 0

    # ------------------------------------------------------------ the run
    async def run(self) -> RunResult:
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
        self.metrics.truncate(first_step - 1)
        self.say(f"starting the services (model {model_dir}, policy version {self.policy_version})")
        self.services = start_services(
            self.config, model_dir, policy_version=self.policy_version, start_engine=self.backend is None
        )
        if self.services.dashboard_url:
            self.say(f"dashboard (rollouts, traces, training curves, live): {self.services.dashboard_url}")
        try:
            return await self._run_with_services(first_step, started)
        finally:
            self.services.stop()
            self.metrics.close()
            if isinstance(self.learner, DistributedLearner):
                self.learner.close()  # its ranks, and the Ray it started

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
            resources = await store.add_resources(
                {
                    "llm": ProxyLLM(
                        endpoint=f"{svc.proxy_url}/v1",
                        model=cfg.model.served_name,
                        sampling_parameters={
                            "temperature": cfg.sampling.temperature,
                            "top_p": cfg.sampling.top_p,
                            "max_tokens": cfg.sampling.max_tokens,
                        },
                    )
                }
            )
            self.resources_id = resources.resources_id
            start_runners(cfg, svc)
            clock = CpuClock(self._pids())
            before = await self.validate(first_step - 1) if self.val_tasks else None
            if before is not None:
                self.say(
                    f"validation before training: reward {before.reward:.3f} (solved {before.solved:.2f})"
                )
            val_after = before
            reason = "step limit"
            step = first_step - 1
            bar = self._bar(first_step)
            in_flight: list[str] = []
            for step in range(first_step, cfg.experiment.steps + 1):
                svc.check_alive()
                metrics = await self.train_step(step, in_flight)
                metrics.update(clock.lap())
                if self.val_tasks and cfg.validation.every and step % cfg.validation.every == 0:
                    val = await self.validate(step)
                    metrics.update(
                        {"val_reward": val.reward, "val_solved": val.solved, "val_failed": val.failed}
                    )
                    val_after = val
                stalls = self._watch_signal(step, metrics)
                self.metrics.add(step, metrics)
                await self.trainer.report_step(step, self.policy_version, metrics, run_id=cfg.experiment.name)
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
                time_split=self._time_split(),
            )

    def _pids(self) -> dict[str, int]:
        assert self.services is not None
        pids = {"trainer": psutil.Process().pid}
        for process in self.services.started:
            pids[process.name] = process.proc.pid
        return pids

    # ------------------------------------------------------------ one step
    async def train_step(self, step: int, in_flight: list[str]) -> dict[str, float]:
        cfg = self.config
        t0 = time.perf_counter()
        sync = cfg.experiment.mode == "sync"
        wanted = cfg.data.batch_size if sync else cfg.experiment.async_groups - len(in_flight)
        groups = await self.submit(
            self.train_tasks, step, max(0, wanted), cfg.data.group_size, "train", f"s{step}"
        )
        in_flight.extend(groups)
        min_version = None if sync else max(0, self.policy_version - cfg.experiment.max_staleness)
        t1 = time.perf_counter()
        if sync:  # generation apart from the data path: wait for every rollout of the step first
            ids = [f"{gid}-r{i}" for gid in groups for i in range(cfg.data.group_size)]
            await self.store.wait_for_rollouts(ids, timeout=3600)
        t_generated = time.perf_counter()
        batch = await self.trainer.get_batch(
            min_groups=cfg.data.batch_size,
            max_groups=cfg.data.batch_size,
            wait=60 if sync else 3600,
            request_id=f"{cfg.experiment.name}-b{step}",
            pad_token_id=self._pad_id(),
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.data.max_response_length,
            aggregation=cfg.data.aggregation,
            failure_policy=cfg.data.failure_policy,
            fill_reward=cfg.data.fill_reward,
            min_policy_version=min_version,
        )
        for gid in batch.group_ids:
            in_flight.remove(gid)
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
        metrics.update(self._truncated_responses(batch))
        metrics.update({f"drop_{reason}": float(count) for reason, count in batch.drops.items()})
        metrics.update({f"trajectory_fallback_{reason}": float(n) for reason, n in batch.fallbacks.items()})
        metrics.update(
            {
                "policy_version": float(self.policy_version),
                "carried_over_groups": float(batch.carried_over_groups),
                "batch_rows": float(len(batch)),
                "step_seconds": t4 - t0,
                # sync: rollouts until every group ended; async: waiting for the batch (data path included)
                "generation_seconds": t_generated - t1 if sync else t2 - t1,
                "data_path_seconds": t2 - t_generated if sync else 0.0,
                "update_seconds": t3 - t2,
                "weight_sync_seconds": t4 - t3,
            }
        )
        return metrics

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
        rng = random.Random(f"{self.config.experiment.seed}-{tag}")
        chosen = [tasks[i % len(tasks)] for i in rng.sample(range(max(groups, len(tasks))), groups)]
        from lightning_grpc.batching import GroupSample

        samples = [
            GroupSample(task, f"{self.config.experiment.name}-{tag}-g{i}") for i, task in enumerate(chosen)
        ]
        submitted = await self.trainer.submit_groups(
            samples,
            group_size,
            mode=mode,
            resources_id=self.resources_id,
            config=RolloutConfig(timeout=300, unresponsive_timeout=120),
            step=step,
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
        if pause:
            await self.proxy.pause("weight update")
            await self.proxy.drain(timeout=120)
            await engine.pause()
        try:
            served = await engine.load_weights(path, self.policy_version)
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
                await engine.resume()
                await self.proxy.resume()

    # ------------------------------------------------------------ validation
    async def validate(self, step: int) -> Validation:
        """The validation tasks at the current weights (mode val: never trained)."""
        cfg = self.config
        groups = await self.submit(
            self.val_tasks, step, len(self.val_tasks), cfg.validation.samples, "val", f"v{step}"
        )
        ids = [f"{gid}-r{i}" for gid in groups for i in range(cfg.validation.samples)]
        await self.store.wait_for_rollouts(ids, timeout=600)
        rewards: list[float] = []
        failed = 0
        transcript = ""
        for rid in ids:
            spans = await self.store.query_spans(rid, "latest")
            reward = final_reward(spans)
            rollout = await self.store.get_rollout(rid)
            if reward is None or rollout.status.name != "SUCCEEDED":
                failed += 1
                reward = 0.0  # evaluation counts a failure as no reward; training never does
            rewards.append(reward)
            if not transcript:
                transcript = transcript_of(spans, reward)
        await self.trainer.get_batch(
            min_groups=len(groups), max_groups=len(groups), mode="val", wait=60, failure_policy="fill"
        )  # hands the val groups out of the book; nothing trains on them
        solved = sum(r >= cfg.validation.solved_at for r in rewards) / max(1, len(rewards))
        return Validation(sum(rewards) / max(1, len(rewards)), solved, failed, transcript)

    # ------------------------------------------------------------ checkpoints and output
    def checkpoint(self, step: int, *, final: bool = False) -> Path:
        if self.learner is None:  # the backend checkpoints itself
            assert self.backend is not None
            return self.backend.checkpoint_dir
        extra = {"policy_version": self.policy_version, "experiment": self.config.experiment.name}
        if final:
            path = self.out / "final"
            if path.exists():
                shutil.rmtree(path)
            return self.learner.save_checkpoint(path, extra)
        path = self.learner.save_checkpoint(self.out / "checkpoints" / f"step-{step:06d}", extra)
        kept = sorted((self.out / "checkpoints").glob("step-*"))
        for old in kept[: max(0, len(kept) - max(1, self.config.checkpoint.keep))]:
            shutil.rmtree(old)
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
        line = summary_line(step, metrics, PRINTED)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(
                " ".join(f"{k}={metrics[k]:.2f}" for k in ("reward_mean", "val_reward") if k in metrics)
            )
            bar.write(line)
        else:
            self.say(line)

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

    def _time_split(self) -> dict[str, float]:
        """Seconds spent per part over the run (sums of the per-step figures)."""
        names = [k for k in self.metrics.rows[-1] if k.endswith("_seconds")] if self.metrics.rows else []
        return {
            name: sum(float(r.get(name, 0.0)) for r in self.metrics.rows if isinstance(r.get(name), float))
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
