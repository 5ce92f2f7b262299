"""Many runners: several processes on this machine, or Ray actors across a cluster."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_grpc import environment, logs
from lightning_grpc._extras import import_extra
from lightning_grpc.access import Credentials, credential_claims
from lightning_grpc.errors import LightningError
from lightning_grpc.processes import freeze_startup_heap, start_ray

from .agent import LitAgent, rollout
from .runner import Runner, default_worker_id, run_forever

log = logs.get_logger(__name__)


def load_agent(ref: str) -> LitAgent:
    """``package.module:name`` or ``path/to/file.py:name`` -> an agent (instance, class or function)."""
    module_ref, sep, name = ref.partition(":")
    if not sep or not name:
        raise ValueError(f"agent reference {ref!r} must look like module:name or path/file.py:name")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to where the command runs
    if module_ref.endswith(".py"):
        path = Path(module_ref).resolve()
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_ref)
    try:
        obj = getattr(module, name)
    except AttributeError:
        raise ImportError(f"{module_ref} has no attribute {name!r}") from None
    if isinstance(obj, LitAgent):
        return obj
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        return obj()
    if callable(obj):
        return rollout(obj)
    raise TypeError(f"{ref} is neither an agent, an agent class, nor a function")


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a runner process (or actor) needs to build its Runner."""

    agent: str
    store: str
    concurrency: int = 1
    token: str | None = None
    max_rollouts: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def for_runner(self, index: int) -> RunnerSpec:
        """What runner ``index`` of a fleet gets: given the admin token, a runner credential of its own
        worker id instead, so that no runner process holds more than its own rights."""
        if not self.token or credential_claims(self.token) is not None or "worker_id" in self.options:
            return self
        worker_id = f"{default_worker_id()}-{index}"
        return replace(
            self,
            token=Credentials(self.token).runner(worker_id),
            options={**self.options, "worker_id": worker_id},
        )

    def build(self, worker_suffix: str = "") -> Runner:
        return Runner(
            load_agent(self.agent),
            self.store,
            concurrency=self.concurrency,
            token=self.token,
            max_rollouts=self.max_rollouts,
            **self.options,
        )


def _process_main(spec: RunnerSpec) -> None:
    stopped = threading.Event()  # a SIGTERM that arrives while this process is still starting
    signal.signal(signal.SIGTERM, lambda _s, _f: stopped.set())
    signal.signal(signal.SIGINT, lambda _s, _f: stopped.set())
    logs.configure_logging(os.environ.get(environment.LOG_LEVEL, "INFO"))
    runner = spec.build()
    freeze_startup_heap()
    if not stopped.is_set():
        try:
            run_forever(runner, stopped)
        except LightningError as exc:  # e.g. the store cannot be reached: one line, no traceback
            log.error("event=runner_failed error=%s: %s", exc.reason, exc.message)
            sys.exit(2)


def run_processes(spec: RunnerSpec, processes: int) -> int:
    """Run ``processes`` runner processes until SIGTERM/SIGINT; returns 0 when all exited cleanly."""
    if processes == 1:
        runner = spec.for_runner(0).build()
        freeze_startup_heap()
        run_forever(runner)
        return 0
    ctx = multiprocessing.get_context("spawn")  # gRPC is not fork-safe: children start fresh
    children = [
        ctx.Process(target=_process_main, args=(spec.for_runner(i),), name=f"lightning-runner-{i}")
        for i in range(processes)
    ]

    stopping: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        for child in children:
            if child.pid and child.is_alive():
                os.kill(child.pid, signum)

    signal.signal(signal.SIGTERM, forward)  # before any child exists, so none is ever left behind
    signal.signal(signal.SIGINT, forward)
    for child in children:
        child.start()
        if stopping and child.pid:  # the signal came while the fleet was starting: this child stops too
            os.kill(child.pid, stopping[0])
    for child in children:
        child.join()
    codes = [c.exitcode for c in children]
    log.info("event=fleet_exit processes=%d exit_codes=%s", processes, codes)
    # A child the forwarded signal reached before it could handle it had started nothing: a clean stop.
    clean = {0} | {-s for s in stopping}
    return 0 if all(code in clean for code in codes) else 1


@dataclass(frozen=True)
class RayPlacement:
    """Where one actor of a :class:`RayFleet` runs: its runner's worker id (the one the store records on
    every attempt it runs) and its Ray node."""

    worker_id: str
    node_id: str
    node_ip: str


class RayFleet:
    """Runners as Ray actors (one Runner per actor, each running ``concurrency`` rollouts at once).

    ``scheduling_strategy`` is handed to Ray for every actor: ``"SPREAD"`` places them over the cluster's
    nodes as evenly as their resources allow (runners on every machine of the cluster); None, the default,
    leaves it to Ray's default policy, which favours the node the fleet is started from.
    """

    def __init__(
        self,
        spec: RunnerSpec,
        actors: int,
        *,
        address: str | None = None,
        num_cpus: float = 0.5,
        scheduling_strategy: Any = None,
    ) -> None:
        ray = import_extra("ray", "ray")
        self.ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            root = str(Path.cwd())
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
            start_ray(
                ray,
                address=address,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
                include_dashboard=False,
                log_to_driver=True,
                ignore_reinit_error=True,
            )
        options: dict[str, Any] = {"num_cpus": num_cpus}
        if scheduling_strategy is not None:
            options["scheduling_strategy"] = scheduling_strategy
        actor_class: Any = ray.remote(**options)(_RunnerActor)
        self.actors: list[Any] = [actor_class.remote(spec.for_runner(i)) for i in range(actors)]
        self._runs = [actor.run.remote() for actor in self.actors]

    def stop(self) -> None:
        self.ray.get([actor.stop.remote() for actor in self.actors])

    def placements(self, timeout: float | None = 60.0) -> list[RayPlacement]:
        """Where each actor runs (in the order of :attr:`actors`), once its runner is built."""
        found = self.ray.get([actor.placement.remote() for actor in self.actors], timeout=timeout)
        return [RayPlacement(*where) for where in found]

    def wait(self, timeout: float | None = None) -> list[int]:
        """Completed rollouts per actor once every actor has stopped."""
        return list(self.ray.get(self._runs, timeout=timeout))

    def shutdown(self) -> None:
        """Kill the actors, and the local Ray session if this fleet started it."""
        for actor in self.actors:
            self.ray.kill(actor)
        if self._owns_ray:
            self.ray.shutdown()


class _RunnerActor:
    """The body of a Ray actor; methods are async so ``stop`` can reach a running ``run``."""

    def __init__(self, spec: RunnerSpec) -> None:
        self.spec = spec
        self.runner: Runner | None = None
        self._stopped = False
        self._failed: BaseException | None = None

    async def run(self) -> int:
        try:
            self.runner = self.spec.build()
        except BaseException as exc:
            self._failed = exc
            raise
        if self._stopped:
            return 0
        return await self.runner.run()

    async def placement(self) -> tuple[str, str, str]:
        """This actor's runner's worker id, its Ray node id and that node's IP address."""
        import ray

        while self.runner is None:  # ``run`` builds it: it was sent first, so this is a moment at most
            if self._failed is not None:
                raise RuntimeError(f"the runner could not be built: {self._failed!r}")
            await asyncio.sleep(0.01)
        context = ray.get_runtime_context()
        return self.runner.worker_id, context.get_node_id(), ray.util.get_node_ip_address()

    async def stop(self) -> None:
        self._stopped = True
        if self.runner is not None:
            self.runner.stop()


def run_ray(spec: RunnerSpec, actors: int, address: str | None) -> int:
    fleet = RayFleet(spec, actors, address=address)

    def stop(signum: int, _frame: Any) -> None:
        fleet.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    counts = fleet.wait()
    log.info("event=ray_fleet_exit actors=%d completed=%s", actors, counts)
    return 0
