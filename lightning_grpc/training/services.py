"""What a training run talks to: the engine (:mod:`.engines`: the embedded one or vLLM), the server (Store,
Trainer and the hosted proxy) and a runner fleet. Each is started here as a child process unless the
experiment names a running one."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from lightning_grpc import environment, logs
from lightning_grpc.processes import CLI, Background, log_field, model_child_env

from .engines import Engine, VllmEngine, make_engine
from .experiment import ExperimentConfig

log = logs.get_logger(__name__)


@dataclass
class Services:
    """Addresses of the running services, and the processes this run started."""

    store: str
    proxy_url: str
    proxy_grpc: str
    started: list[Background] = field(default_factory=list)
    runners: Background | None = None
    #: The web dashboard of the server this run started ("" when it uses a running one).
    dashboard_url: str = ""
    #: The engine behind the proxy (started here or running elsewhere); None when an update backend serves.
    engine: Engine | None = None

    def check_alive(self) -> None:
        """Raise when a process this run started has exited."""
        for process in self.started:
            if not process.alive():
                raise RuntimeError(
                    f"the {process.name} process exited (code {process.proc.returncode}):\n{process.tail()}"
                )

    def stop(self) -> None:
        """Stop the processes this run started, runners first."""
        for process in reversed(self.started):
            process.stop(timeout=20)
        if self.engine is not None:
            self.engine.stop()  # what it keeps besides its processes (vLLM's socket directory)


def start_services(
    config: ExperimentConfig,
    model_dir: Path,
    *,
    policy_version: int = 0,
    db: Path | None = None,
    start_engine: bool = True,
) -> Services:
    """Start what the experiment does not name; returns once everything serves.

    The engine is the one ``[engine]`` chooses (:func:`~.engines.make_engine`: the embedded engine, or a
    vLLM server), started here unless ``services.engine`` names a running one. ``start_engine=False``: the
    model is served elsewhere (an update backend's inference servers, set as the proxy's backends once they
    run); the proxy starts without backends.
    """
    svc = config.services
    started: list[Background] = []
    engine = make_engine(config) if start_engine or svc.engine else None
    try:
        engine_url = ""
        served_version = policy_version
        if engine is not None:
            engine_url = engine.start(model_dir, policy_version)
            started.extend(engine.processes)
            if isinstance(engine, VllmEngine):
                served_version = engine.served_version()
        # engines whose answers carry no policy version: the proxy's backend entry carries it
        version_args = (
            ["--proxy-policy-version", str(served_version)]
            if engine is not None and not engine.reports_version
            else []
        )
        store, proxy_url, proxy_grpc = svc.store, svc.proxy, svc.proxy_grpc or svc.store
        dashboard_url = ""
        if not store:
            where = ["--db", str(db)] if db is not None else ["--memory"]
            server = Background(
                "server",
                [
                    *CLI,
                    "serve",
                    "--port",
                    "0",
                    *where,
                    "--grace",
                    "2",
                    *(
                        [
                            "--proxy-backend",
                            f"{engine_url}/v1",
                            "--proxy-model-name",
                            config.model.served_name,
                            *version_args,
                        ]
                        if engine_url
                        else ["--proxy"]
                    ),
                    "--proxy-port",
                    "0",
                ],
                model_child_env(1),
            )
            started.append(server)
            store = log_field(server.wait_for("event=server_started", timeout=60)[0], "address")
            proxy_url = log_field(server.wait_for("event=proxy_started", timeout=60)[0], "http_address")
            proxy_grpc = store
            # the server's dashboard (if it serves one) started before its proxy, so its line is already here
            dashboard = [line for line in server.lines if "event=dashboard_started" in line]
            dashboard_url = log_field(dashboard[0], "http_address") if dashboard else ""
        if not proxy_url:
            raise RuntimeError(
                "services.proxy must name the running proxy's HTTP address when services.store is set"
            )
        return Services(
            store,
            _http(proxy_url),
            proxy_grpc,
            started,
            dashboard_url=dashboard_url,
            engine=engine,
        )
    except BaseException:
        for process in reversed(started):
            process.stop(timeout=10)
        if engine is not None:
            engine.stop()
        raise


def start_runners(config: ExperimentConfig, services: Services) -> Background | None:
    """The runner fleet playing the experiment's agent against the server (none with ``agent.processes = 0``:
    runners started elsewhere serve the store)."""
    if config.agent.processes == 0:
        return None
    if config.agent.command:
        return _start_command_runners(config, services)
    runners = Background(
        "runners",
        [
            *CLI,
            "runner",
            config.agent.agent,
            "--store",
            services.store,
            "--concurrency",
            str(config.agent.concurrency),
            "--processes",
            str(config.agent.processes),
            "--poll-wait",
            "1",
            "--heartbeat-interval",
            "10",
        ],
        {**model_child_env(1), "PYTHONPATH": str(Path.cwd())},
    )
    try:
        runners.wait_for("event=runner_started", count=config.agent.processes, timeout=120)
    except RuntimeError:
        runners.stop(timeout=10)
        raise
    services.started.append(runners)
    services.runners = runners
    return runners


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
    started: list[Background] = []
    try:
        for index in range(config.agent.processes):
            runner = Background(
                "runners" if index == 0 else f"runners-{index}",
                list(config.agent.command),
                command_env(config, services, index),
                cwd=config.path("."),
                python=False,
            )
            started.append(runner)
        for runner in started:
            try:
                runner.wait_for("event=runner_started", timeout=120)
            except RuntimeError as exc:  # say why, in the command's own words
                raise RuntimeError(
                    f"agent.command {list(config.agent.command)}: {exc}\n{runner.tail()}"
                ) from None
    except BaseException:
        for runner in started:
            runner.stop(timeout=10)
        raise
    services.started.extend(started)
    services.runners = started[0]
    return started[0]


def _http(address: str) -> str:
    return address if address.startswith("http") else f"http://{address}"
