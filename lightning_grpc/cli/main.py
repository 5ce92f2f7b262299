"""``lightning-grpc``: the Store, proxy, engine, runners and trainer of an agent RL platform over gRPC.

lightning-grpc serve --host 127.0.0.1 --port 4747 --db store.db
lightning-grpc serve --memory --max-memory 2GiB
lightning-grpc serve --postgres postgresql://lightning@db.example/lightning
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from lightning_grpc import environment, logs
from lightning_grpc._extras import MissingExtraError
from lightning_grpc.cli import proxy_commands
from lightning_grpc.cli.inspect_commands import add_store_option
from lightning_grpc.errors import LightningError
from lightning_grpc.processes import stop_with_parent

log = logs.get_logger(__name__)

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1000000' -> bytes."""
    s = text.strip().lower()
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits) :].strip()
    if unit not in SIZE_UNITS or not digits:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 512MiB or 2GB")
    return int(float(digits) * SIZE_UNITS[unit])


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the store server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4747, help="0 picks a free port (logged at start)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--db", type=Path, help="SQLite file (created if missing); the default is lightning.db"
    )
    where.add_argument("--memory", action="store_true", help="keep everything in memory (lost on exit)")
    where.add_argument(
        "--postgres",
        metavar="URL",
        help="store in this PostgreSQL database (a postgresql:// URL or libpq connection string; the database "
        "must exist, its tables are created on first use; a password is best left to PGPASSWORD or ~/.pgpass); "
        "needs pip install 'lightning-grpc[postgres]'",
    )
    p.add_argument(
        "--max-memory", type=parse_size, help="in-memory backend: evict oldest finished rollouts above this"
    )
    p.add_argument(
        "--sqlite-sync",
        choices=("full", "normal"),
        default="full",
        help="full: an acknowledged write survives a power loss; normal: it survives a crash of the server "
        "process, but a power loss may lose the last commits (faster on slow disks)",
    )
    p.add_argument(
        "--max-db-size",
        type=parse_size,
        help="SQLite: the largest the database may grow; writes beyond it are refused as on a full disk",
    )
    p.add_argument("--max-span-size", type=parse_size, default=16 * 1024 * 1024, help="largest span accepted")
    p.add_argument(
        "--token",
        default=os.environ.get(environment.TOKEN),
        help="the admin token: every call but health and reflection then needs a credential "
        f"(this token, or one signed under it; default: ${environment.TOKEN})",
    )
    p.add_argument(
        "--no-reflection",
        dest="reflection",
        action="store_false",
        help="do not serve gRPC reflection; without this flag it is served (it lists the public contract to "
        "anyone, for grpcurl and buf curl)",
    )
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain (enables TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--tls-client-ca", type=Path, help="require client certificates signed by this CA")
    p.add_argument(
        "--gzip", action="store_true", help="gzip responses (requests are always accepted gzipped)"
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    add_dashboard_options(p)
    proxy_commands.add_serve_options(p)
    p.set_defaults(func=run_serve)


def add_dashboard_options(p: argparse.ArgumentParser) -> None:
    """``serve``'s dashboard: its HTTP server (a Connect gateway to the services, and the built frontend)."""
    group = p.add_argument_group("dashboard (served unless --no-dashboard)")
    group.add_argument(
        "--dashboard-port",
        type=int,
        metavar="PORT",
        default=None,
        help="the dashboard's HTTP port, on --host (default: 4750, or any free port when 4750 is taken; "
        "0: any free port)",
    )
    group.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="do not serve the dashboard; without this flag it is served (the browser's way to the services, "
        "behind the same credentials)",
    )
    group.add_argument(
        "--dashboard-assets",
        type=Path,
        metavar="DIR",
        help="the built dashboard (index.html and its assets; default: the one installed with the package)",
    )


def run_serve(args: argparse.Namespace) -> int:
    from lightning_grpc.server.app import ServerConfig, TlsFiles, serve

    logs.configure_logging(args.log_level)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    config = ServerConfig(
        host=args.host,
        port=args.port,
        db=None if args.memory or args.postgres else (args.db or Path("lightning.db")),
        postgres=args.postgres,
        token=args.token or None,
        tls=tls,
        max_memory_bytes=args.max_memory,
        sqlite_sync=args.sqlite_sync,
        max_db_bytes=args.max_db_size,
        max_span_bytes=args.max_span_size,
        gzip_responses=args.gzip,
        grace=args.grace,
        reflection=args.reflection,
        companions=dashboard_companions(args),
    )
    if proxy_commands.wants_proxy(args):
        return proxy_commands.run_serve_with_proxy(args, config)
    try:
        asyncio.run(serve(config))
    except MissingExtraError as exc:  # --postgres without psycopg: one line naming the extra
        log.error("event=server_failed error=%s", exc)
        return 1
    except OSError as exc:
        log.error("event=server_failed error=%s", exc)
        return 1
    return 0


def dashboard_companions(args: argparse.Namespace) -> tuple[Any, ...]:
    if not args.dashboard:
        return ()
    from lightning_grpc.dashboard import DashboardConfig, companion

    return (companion(DashboardConfig(port=args.dashboard_port, assets=args.dashboard_assets)),)


def add_runner_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("runner", help="run an agent on rollouts from a store")
    p.add_argument(
        "agent", help="module:name or path/file.py:name (a @rollout function, LitAgent, or its class)"
    )
    add_store_option(p, "the store to take rollouts from")
    p.add_argument(
        "--token",
        default=os.environ.get(environment.TOKEN),
        help="the admin token, or a runner credential (its worker id becomes the runner's) "
        f"(default: ${environment.TOKEN})",
    )
    p.add_argument("--concurrency", type=int, default=1, help="rollouts run at once in each process")
    p.add_argument(
        "--processes", type=int, default=1, help="runner processes on this machine (or Ray actors)"
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the runners as Ray actors (a cluster address, or a local Ray when none is given)",
    )
    p.add_argument("--max-rollouts", type=int, help="stop each runner after this many rollouts")
    p.add_argument("--heartbeat-interval", type=float, default=5.0, help="seconds between attempt heartbeats")
    p.add_argument("--poll-wait", type=float, default=2.0, help="long-poll wait of each dequeue, seconds")
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the store at start-up before giving up (once connected, it reconnects)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.set_defaults(func=run_runner)


def run_runner(args: argparse.Namespace) -> int:
    from lightning_grpc.runner import RunnerSpec, run_processes
    from lightning_grpc.runner.fleet import run_ray

    logs.configure_logging(args.log_level)
    os.environ[environment.LOG_LEVEL] = args.log_level
    if args.concurrency < 1 or args.processes < 1:
        raise SystemExit("error: --concurrency and --processes must be at least 1")
    spec = RunnerSpec(
        agent=args.agent,
        store=args.store,
        concurrency=args.concurrency,
        token=args.token or None,
        max_rollouts=args.max_rollouts,
        options={
            "heartbeat_interval": args.heartbeat_interval,
            "poll_wait": args.poll_wait,
            "connect_timeout": args.connect_timeout,
        },
    )
    from lightning_grpc.runner import load_agent

    try:
        load_agent(args.agent)  # fail here, with a clear message, if the reference is wrong
    except (ImportError, ValueError, TypeError, AttributeError) as exc:
        print(f"error: cannot load agent {args.agent!r}: {exc}", file=sys.stderr)
        return 2
    if args.ray is not None:
        return run_ray(spec, args.processes, args.ray or None)
    return run_processes(spec, args.processes)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless its help already says it or there is none to show.

    A flag that takes no value (``--no-dashboard``, ``--gzip``) never shows one: its default is the value
    of its ``dest`` (``dashboard=True``), which printed under the flag would read as the flag being on.
    Nor does an option whose help names an environment variable: its default came from there (and may be
    a secret), so the help says ``default: $NAME`` itself.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or "$" in text
            or action.nargs == 0
            or action.default in (None, "", False, [], argparse.SUPPRESS)
        ):
            return text
        return str(super()._get_help_string(action))


class Parser(argparse.ArgumentParser):
    """Every (sub)command shows its defaults in --help, and reports its own mistakes with its own usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        found, extras = super().parse_known_args(args, namespace)
        if extras and self.prog != "lightning-grpc":  # a subcommand: its usage, not the top-level one
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return found, extras


DESCRIPTION = (
    "lightning-grpc: serve the Store (and TrainerService, the proxy, the engine), run agents, train, "
    "and look at a running store. `lightning-grpc COMMAND --help` shows each command's options."
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lightning-grpc", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"lightning-grpc {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    add_serve_parser(sub)
    add_runner_parser(sub)
    from lightning_grpc.cli import (
        credential_commands,
        engine_commands,
        inspect_commands,
        queue_commands,
        train_commands,
        trainer_commands,
    )

    inspect_commands.add_parsers(sub)
    queue_commands.add_parsers(sub)
    trainer_commands.add_parsers(sub)
    train_commands.add_parsers(sub)
    engine_commands.add_parsers(sub)
    proxy_commands.add_parsers(sub)
    credential_commands.add_parsers(sub)
    return parser


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-grpc")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_with_parent()
    try:
        return int(args.func(args) or 0)
    except LightningError as exc:
        print(f"error: {exc.reason}: {exc.message}", file=sys.stderr)
        return 2
    except MissingExtraError as exc:
        # a command whose optional dependency is not installed: one line naming the extra to install
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
