"""Assemble and run the gRPC server: StoreService, TrainerService, OTLP, health, reflection, auth, TLS, limits, drain."""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from lightning_grpc import logs
from lightning_grpc.batching import TrainerCore
from lightning_grpc.errors import Reason, UnavailableError
from lightning_grpc.processes import freeze_startup_heap, hand_over_the_gil_promptly
from lightning_grpc.store import Backend, SqliteBackend, Store, make_backend
from lightning_grpc.v1 import store_service_pb2

from .auth import interceptors_for
from .handlers import ServicerState, register_service
from .health import HealthServicer
from .otlp import TRACE_SERVICE, TraceServicer, add_otlp_service
from .store_servicer import StoreServicer, add_store_service, check_duration
from .trainer_servicer import TRAINER_SERVICE, TrainerServicer, add_trainer_service, span_reader

log = logs.get_logger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Once no handler runs, how long gRPC may still take (at most, and never beyond the drain's grace) to send the
#: answers of the calls just ended before it cuts what is left. A handler counts as done when it returns, before
#: gRPC has sent its answer: with 0.2 s a loaded host sometimes cut such a call (CANCELLED) in the drain test.
#: Calls that never end by themselves (a client's health watch) hold the stop that long.
ANSWER_GRACE = 2.0
STORE_SERVICE = store_service_pb2.DESCRIPTOR.services_by_name["StoreService"].full_name

#: Extra services hosted by the same server: (full service name, function adding it to a server and
#: returning its servicer, which the drain then covers).
ServiceHook = tuple[str, Callable[[grpc.aio.Server], ServicerState]]

#: Something that runs beside the server and calls it (the dashboard's HTTP gateway): started, given the
#: server, once it listens; returns the coroutine function that stops it, which the drain awaits after
#: the server's calls have ended and before the server stops.
Companion = Callable[["RunningServer"], Awaitable[Callable[[], Awaitable[None]]]]


@dataclass(frozen=True)
class TlsFiles:
    cert_chain: Path
    private_key: Path
    #: When set, clients must present a certificate signed by this CA.
    client_ca: Path | None = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 4747
    #: SQLite file; None for the in-memory backend (or PostgreSQL, when ``postgres`` is set).
    db: Path | None = None
    #: A PostgreSQL connection string or URL (the database must exist): the store lives there instead.
    #: Kept out of the repr: it may hold a password.
    postgres: str | None = field(default=None, repr=False)
    #: The admin token; None: no authentication (local use). See lightning_grpc.access for the roles.
    token: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None
    #: In-memory backend only: evict the oldest finished rollouts above this many bytes.
    max_memory_bytes: int | None = None
    #: SQLite only: "full" (an acknowledged write survives a power loss) or "normal" (it survives a crash of
    #: the server process; a power loss may lose the last commits). See lightning_grpc.store.sqlite.
    sqlite_sync: str = "full"
    #: SQLite only: the largest the database may grow; beyond it writes are refused as on a full disk.
    max_db_bytes: int | None = None
    max_span_bytes: int = 16 * 1024 * 1024
    gzip_responses: bool = False
    #: Seconds in-flight calls get to finish on shutdown.
    grace: float = 10.0
    extra_services: Sequence[ServiceHook] = field(default_factory=tuple)
    #: Serve gRPC reflection (open to anyone, like health: it lists the public contract).
    reflection: bool = True
    companions: Sequence[Companion] = field(default_factory=tuple)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    store: Store
    trainer: TrainerCore
    health: HealthServicer
    port: int
    config: ServerConfig
    service_names: tuple[str, ...]
    #: Servicers whose calls the drain waits for (extra services may add theirs).
    servicers: list[ServicerState] = field(default_factory=list)
    #: How to stop each started companion (see :data:`Companion`).
    companion_stops: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    #: Set when another server took over the store's database (PostgreSQL: the writer lease); this one
    #: must stop serving (:func:`serve` does).
    lost_lease: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def stop(self) -> None:
        """Drain, then stop.

        Health turns NOT_SERVING; new calls are refused with UNAVAILABLE (which clients retry);
        long-polls and watches end; calls in flight get up to ``grace`` seconds to finish; then
        the server stops and the store commits and closes.
        """
        log.info("event=server_draining address=%s grace=%.1f", self.address, self.config.grace)
        await self.health.enter_graceful_shutdown()
        for servicer in self.servicers:
            servicer.drain()
        self.store.begin_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.grace
        while any(s.in_flight for s in self.servicers) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        left = sum(s.in_flight for s in self.servicers)
        if left:
            log.warning("event=server_drain_timeout address=%s calls_cancelled=%d", self.address, left)
        while self.companion_stops:
            await self.companion_stops.pop()()
        await self.server.stop(max(0.2, min(ANSWER_GRACE, deadline - loop.time())))
        await self.trainer.close()
        await self.store.close()
        log.info("event=server_stopped address=%s", self.address)


HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


class MethodResolvingPool:
    """The default descriptor pool for server reflection, whose ``FindFileContainingSymbol`` also finds a
    method by its full name (``lightning.v1.StoreService.GetRollout``).

    Reflection's FileContainingSymbol takes ``<package>.<service>[.<method>]`` or ``<package>.<type>``, and
    clients ask for methods by it (``grpcurl describe SERVICE.METHOD``). The upb pool that the Python
    protobuf runtime uses resolves services, messages, enums, fields and extensions there, but not methods:
    a KeyError, which the reflection servicer answers NOT_FOUND ("Symbol not found" in grpcurl). Everything
    else, and every other lookup, is the default pool's, so an unknown symbol is still NOT_FOUND.
    """

    def __init__(self, pool: descriptor_pool.DescriptorPool | None = None) -> None:
        self._pool = pool if pool is not None else descriptor_pool.Default()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> descriptor.FileDescriptor:
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service_name, _, method = symbol.rpartition(".")
            try:
                service = self._pool.FindServiceByName(service_name) if service_name else None
            except KeyError:
                service = None
            if service is None or method not in service.methods_by_name:
                raise
            return service.file


def add_health_and_reflection(
    server: grpc.aio.Server, names: Sequence[str], *, with_reflection: bool = True
) -> HealthServicer:
    """gRPC health checking (Check, Watch and List) and (unless turned off) server reflection listing
    ``names`` and themselves, parsing requests as every other service does; returns the health servicer,
    whose statuses the caller sets."""
    health = HealthServicer()
    register_service(HEALTH_SERVICE, health_pb2, health, server, foreign=True)
    if with_reflection:
        listed = (*names, HEALTH_SERVICE.full_name, REFLECTION_SERVICE.full_name)
        servicer = reflection.aio.ReflectionServicer(listed, pool=MethodResolvingPool())
        register_service(REFLECTION_SERVICE, reflection_pb2, servicer, server, foreign=True)
    return health


def make_store(config: ServerConfig) -> Store:
    backend: Backend
    if config.postgres is not None:
        if config.db is not None:
            raise ValueError("a server stores in SQLite (db) or PostgreSQL (postgres), not both")
        backend = make_backend(postgres_url=config.postgres)
    elif config.db is not None:
        backend = SqliteBackend(config.db, synchronous=config.sqlite_sync, max_bytes=config.max_db_bytes)
    else:
        backend = make_backend()
    return Store(
        backend,
        max_memory_bytes=config.max_memory_bytes,
        max_span_bytes=config.max_span_bytes,
        timeout_rule=check_duration,
    )


def listen(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Add the listening port to ``server``; returns the bound port.

    A port already taken is found with a plain socket first, so the user reads one clear line and
    not gRPC core's own log line about the failed bind.
    """
    address = f"{host}:{port}"
    if port:
        _check_free(host, port, address)
    try:
        bound = (
            server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"cannot listen on {address} (is another server using the port?)")
    return bound


def _check_free(host: str, port: int, address: str) -> None:
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {address}: {exc.strerror}") from None
    for family, kind, proto, _name, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # as gRPC does, so that a closed server's connections in TIME_WAIT are no conflict
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(
                        f"cannot listen on {address}: the port is in use (is another server running there?)"
                    ) from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise OSError(f"cannot listen on {address}: this machine has no such address") from None


async def start_server(config: ServerConfig, store: Store | None = None) -> RunningServer:
    """Open the store (unless given, already started: make it with :func:`make_store`, so that it takes only
    timeouts the wire can carry) and serve it; returns once listening."""
    if store is None:
        if config.port:  # before the store opens: a standby would only find it at its take-over
            _check_free(config.host, config.port, f"{config.host}:{config.port}")
        store = await make_store(config).start()
    server = grpc.aio.server(
        interceptors=interceptors_for(config.token, store),
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
        compression=grpc.Compression.Gzip if config.gzip_responses else None,
    )
    trainer = await TrainerCore(store, span_reader(store)).start()
    store_servicer, trace_servicer, trainer_servicer = (
        StoreServicer(store),
        TraceServicer(store),
        TrainerServicer(trainer),
    )
    add_store_service(store_servicer, server)
    add_otlp_service(trace_servicer, server)
    add_trainer_service(trainer_servicer, server)
    servicers: list[ServicerState] = [store_servicer, trace_servicer, trainer_servicer]
    names = [STORE_SERVICE, TRACE_SERVICE, TRAINER_SERVICE]
    for name, add in config.extra_services:
        servicers.append(add(server))
        names.append(name)
    health = add_health_and_reflection(server, names, with_reflection=config.reflection)
    credentials = None
    if config.tls is not None:
        credentials = grpc.ssl_server_credentials(
            [(config.tls.private_key.read_bytes(), config.tls.cert_chain.read_bytes())],
            root_certificates=config.tls.client_ca.read_bytes() if config.tls.client_ca else None,
            require_client_auth=config.tls.client_ca is not None,
        )
    try:
        port = listen(server, config.host, config.port, credentials)
    except OSError:
        await store.close()
        raise
    await server.start()
    for name in ("", *names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "event=server_started address=%s:%d backend=%s tls=%s auth=%s",
        config.host,
        port,
        store.backend.name,
        config.tls is not None,
        bool(config.token),
    )
    running = RunningServer(server, store, trainer, health, port, config, tuple(names), servicers)
    store.backend.on_lease_lost(running.lost_lease.set)
    for companion in config.companions:
        try:
            running.companion_stops.append(await companion(running))
        except BaseException:
            await running.stop()
            raise
    return running


class StopSignals:
    """SIGTERM and SIGINT for a server's process: once it serves, they stop it (:meth:`wait`); before, while
    it starts (a standby waiting for its database's writer lease), they cancel the start."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._starting = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        self.event.set()
        if self._starting is not None:
            self._starting.cancel()

    def started(self) -> None:
        self._starting = None

    def stopped_while_starting(self) -> bool:
        """After a start was cancelled: whether a signal did it (then the task is no longer cancelling)."""
        task = asyncio.current_task()
        if not self.event.is_set() or task is None:
            return False
        task.uncancel()
        log.info("event=server_stopped_before_serving")
        return True

    async def wait(self, running: RunningServer | None = None) -> None:
        """Until a signal, or until another server took over ``running``'s store database."""
        self.started()
        waits = [asyncio.create_task(self.event.wait())]
        if running is not None:
            waits.append(asyncio.create_task(running.lost_lease.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()


def raise_if_taken_over(running: RunningServer) -> None:
    """After a stop: one error when another server took over the store's database (the process exits 2)."""
    if running.lost_lease.is_set():
        raise UnavailableError(
            "another server took over the store's database (its writer lease): this one stopped",
            reason=Reason.NOT_THE_WRITER,
        )


async def serve(config: ServerConfig, ready: Callable[[RunningServer], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT (or another server takes over the store's database), then drain and exit."""
    signals = StopSignals()
    try:
        running = await start_server(config)
    except asyncio.CancelledError:
        if signals.stopped_while_starting():
            return
        raise
    freeze_startup_heap()
    if isinstance(running.store.backend, SqliteBackend):
        hand_over_the_gil_promptly()  # SQLite's writer thread (see there for where it is not set)
    if ready is not None:
        ready(running)
    await signals.wait(running)
    await running.stop()
    raise_if_taken_over(running)
