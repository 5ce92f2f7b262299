"""What a training run talks to: the engine (:mod:`.engines`: the embedded one or vLLM), the server (Store,
Trainer and the hosted proxy) and a runner fleet. Each is started here as a child process unless the
experiment names a running one, and each child knows how to start again on the same ports (:class:`Child`,
what :mod:`.supervision` restarts when one dies)."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from lightning_grpc import environment, logs
from lightning_grpc.processes import CLI, Background, log_field, model_child_env

from .engines import Engine, VllmEngine, make_engine
from .experiment import ExperimentConfig

log = logs.get_logger(__name__)


@dataclass
class Child:
    """A process this run started, and how to start it again where it was (same ports, same arguments)."""

    #: What it is: "server", "engine", "runners-0", ...
    name: str
    process: Background
    #: Starts it again and returns the new process once it serves (None: it cannot be restarted alone).
    restart: Callable[[], Background] | None = None
    #: Restarts so far.
    restarts: int = 0
    #: Whether it listens where others reach it (a restart takes the same ports); runners listen nowhere.
    ports: bool = True
    #: Held around its restart (the engine's: the proxy holds new calls meanwhile); None: nothing held.
    hold: Callable[[], AbstractAsyncContextManager[None]] | None = None


@dataclass
class Services:
    """Addresses of the running services, and the processes this run started."""

    store: str
    proxy_url: str
    proxy_grpc: str
    children: list[Child] = field(default_factory=list)
    #: The web dashboard of the server this run started ("" when it uses a running one).
    dashboard_url: str = ""
    #: The engine behind the proxy (started here or running elsewhere); None when an update backend serves.
    engine: Engine | None = None

    @property
    def started(self) -> list[Background]:
        """The processes now running for this run, in the order they were started."""
        return [child.process for child in self.children]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def dead(self) -> list[Child]:
        """The children whose process has exited."""
        return [child for child in self.children if not child.process.alive()]

    def check_alive(self) -> None:
        """Raise, with its own last lines, when a process this run started has exited."""
        for child in self.dead():
            raise RuntimeError(child_died_message(child))

    def stop(self) -> None:
        """Stop the processes this run started, runners first."""
        for child in reversed(self.children):
            child.process.stop(timeout=20)
        if self.engine is not None:
            self.engine.stop()  # what it keeps besides its processes (vLLM's socket directory)


def child_died_message(child: Child) -> str:
    process = child.process
    process.read_to_end()
    return (
        f"the {child.name} process exited (code {process.proc.returncode}); its last lines:\n{process.tail()}"
    )


def start_services(
    config: ExperimentConfig,
    model_dir: Path,
    *,
    policy_version: int = 0,
    db: Path | None = None,
    start_engine: bool = True,
    current_version: Callable[[], int] | None = None,
) -> Services:
    """Start what the experiment does not name; returns once everything serves.

    The engine is the one ``[engine]`` chooses (:func:`~.engines.make_engine`: the embedded engine, or a
    vLLM server), started here unless ``services.engine`` names a running one. ``start_engine=False``: the
    model is served elsewhere (an update backend's inference servers, set as the proxy's backends once they
    run); the proxy starts without backends. ``current_version``: the policy version a restarted server's
    proxy records for an engine that reports none (the version the run last published).
    """
    svc = config.services
    children: list[Child] = []
    engine = make_engine(config) if start_engine or svc.engine else None
    try:
        engine_url = ""
        served_version = policy_version
        if engine is not None:
            engine_url = engine.start(model_dir, policy_version)
            children.extend(Child(p.name, p) for p in engine.processes)
            if isinstance(engine, VllmEngine):
                served_version = engine.served_version()
        store, proxy_url, proxy_grpc = svc.store, svc.proxy, svc.proxy_grpc or svc.store
        dashboard_url = ""
        if not store:
            server = ServerProcess(config, db, engine_url, engine)
            child = server.start(served_version, current_version)
            children.append(child)
            store, proxy_url, dashboard_url = server.address, server.proxy_url, server.dashboard_url
            proxy_grpc = store
        if not proxy_url:
            raise RuntimeError(
                "services.proxy must name the running proxy's HTTP address when services.store is set"
            )
        return Services(
            store,
            _http(proxy_url),
            proxy_grpc,
            children,
            dashboard_url=dashboard_url,
            engine=engine,
        )
    except BaseException:
        for child in reversed(children):
            child.process.stop(timeout=10)
        if engine is not None:
            engine.stop()
        raise


class ServerProcess:
    """``lightning-grpc serve`` (Store, Trainer, the hosted proxy and the dashboard) as a child of the run: the
    first start takes free ports, a restart takes the same ones (the runners, the agents' LLM resource and the
    run's clients keep their addresses) and the same store file."""

    def __init__(
        self, config: ExperimentConfig, db: Path | None, engine_url: str, engine: Engine | None
    ) -> None:
        self.config, self.db, self.engine_url, self.engine = config, db, engine_url, engine
        self.address = self.proxy_url = self.dashboard_url = ""

    def args(self, policy_version: int) -> list[str]:
        postgres = self.config.services.store_postgres
        where = (
            ["--postgres", postgres]
            if postgres
            else ["--db", str(self.db)]
            if self.db is not None
            else ["--memory"]
        )
        ports = ["--port", _port(self.address), "--proxy-port", _port(self.proxy_url)]
        if self.dashboard_url:
            ports += ["--dashboard-port", _port(self.dashboard_url)]
        # engines whose answers carry no policy version: the proxy's backend entry carries it
        version = (
            ["--proxy-policy-version", str(policy_version)]
            if self.engine is not None and not self.engine.reports_version
            else []
        )
        backend = (
            ["--proxy-backend", f"{self.engine_url}/v1", "--proxy-model-name", self.config.model.served_name]
            if self.engine_url
            else ["--proxy"]
        )
        return [*CLI, "serve", *where, "--grace", "2", *backend, *version, *ports]

    def start(self, policy_version: int, current_version: Callable[[], int] | None = None) -> Child:
        server = Background("server", self.args(policy_version), model_child_env(1))
        self.address = log_field(server.wait_until_serving("event=server_started", timeout=60)[0], "address")
        self.proxy_url = log_field(
            server.wait_until_serving("event=proxy_started", timeout=60)[0], "http_address"
        )
        # the server's dashboard (if it serves one) started before its proxy, so its line is already here
        dashboard = [line for line in server.lines if "event=dashboard_started" in line]
        self.dashboard_url = log_field(dashboard[0], "http_address") if dashboard else ""
        version = current_version or (lambda: policy_version)
        return Child("server", server, restart=lambda: self._restart(version()))

    def _restart(self, policy_version: int) -> Background:
        """The same server again (an in-memory store comes back empty: ``services.store_path`` keeps it)."""
        server = Background("server", self.args(policy_version), model_child_env(1))
        server.wait_until_serving("event=proxy_started", timeout=120)
        return server


def start_runners(config: ExperimentConfig, services: Services) -> Background | None:
    """The runner fleet playing the experiment's agent against the server (none with ``agent.processes = 0``:
    runners started elsewhere serve the store)."""
    if config.agent.processes == 0:
        return None
    if config.agent.command:
        return _start_command_runners(config, services)
    # one child per runner process, so that each one that dies is seen and restarted alone
    args = [
        *CLI,
        "runner",
        config.agent.agent,
        "--store",
        services.store,
        "--concurrency",
        str(config.agent.concurrency),
        "--processes",
        "1",
        "--poll-wait",
        "1",
        "--heartbeat-interval",
        f"{heartbeat_interval(config):g}",
    ]
    env = {**model_child_env(1), "PYTHONPATH": str(Path.cwd())}
    return _start_runner_children(
        [
            (runner_name(index), functools.partial(Background, runner_name(index), args, env))
            for index in range(config.agent.processes)
        ],
        services,
    )


def runner_name(index: int) -> str:
    return f"runners-{index}"


def heartbeat_interval(config: ExperimentConfig) -> float:
    """How often a runner tells the store its attempts live: a few times per agent.unresponsive_timeout."""
    return max(0.5, min(10.0, config.agent.unresponsive_timeout / 4))


def _start_runner_children(
    starts: list[tuple[str, Callable[[], Background]]], services: Services, describe: str = ""
) -> Background:
    """Start each runner, wait until every one serves (each logs ``event=runner_started``), and add them to
    the run's children; on a failure stop them and say why in the runner's own words."""
    started: list[Child] = []
    try:
        for name, start in starts:
            started.append(
                Child(name, start(), restart=functools.partial(_serving_runner, start), ports=False)
            )
        for child in started:
            try:
                child.process.wait_until_serving("event=runner_started", timeout=120)
            except RuntimeError as exc:
                raise RuntimeError(f"{describe}{exc}") from None
    except BaseException:
        for child in started:
            child.process.stop(timeout=10)
        raise
    services.children.extend(started)
    return started[0].process


def _serving_runner(start: Callable[[], Background]) -> Background:
    runner = start()
    runner.wait_until_serving("event=runner_started", timeout=120)
    return runner


def command_env(config: ExperimentConfig, services: Services, index: int) -> dict[str, str]:
    """What a runner in another language is told: the store, its concurrency and worker id, and (unless the
    environment already names one) the store's port as its OTLP/gRPC endpoint."""
    env = {
        **model_child_env(1),
        environment.STORE: services.store,
        environment.CONCURRENCY: str(config.agent.concurrency),
        environment.WORKER_ID: f"{config.experiment.name}-runner-{index}-{secrets.token_hex(3)}",
    }
    if not (
        environment.read(environment.OTEL_EXPORTER_OTLP_ENDPOINT)
        or environment.read(environment.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
    ):
        env[environment.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT] = _http(services.store)
        env[environment.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL] = "grpc"
    return env


def _start_command_runners(config: ExperimentConfig, services: Services) -> Background:
    """``agent.processes`` copies of ``agent.command``, each logging ``event=runner_started`` once it serves."""

    def starter(index: int) -> Callable[[], Background]:
        return lambda: Background(
            runner_name(index),
            list(config.agent.command),
            command_env(config, services, index),
            cwd=config.path("."),
            python=False,
        )

    return _start_runner_children(
        [(runner_name(index), starter(index)) for index in range(config.agent.processes)],
        services,
        describe=f"agent.command {list(config.agent.command)}: ",
    )


def _http(address: str) -> str:
    return address if address.startswith("http") else f"http://{address}"


def _port(address: str) -> str:
    """The port of ``host:port`` or ``http://host:port`` ("0": any free one, for an address not known yet)."""
    if not address:
        return "0"
    return str(urlsplit(_http(address)).port or 0)
