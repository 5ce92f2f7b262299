"""Shared fixtures: a real gRPC server on 127.0.0.1 (port 0) over each backend, and clients."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from lightning_grpc.client import StoreClient
from lightning_grpc.server.app import RunningServer, ServerConfig
from tests.helpers import serving
from tests.store import postgres_server

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.engine_fixtures"]
BACKENDS = ["memory", "sqlite"]
#: The backends the store's behaviour suite (tests/store/test_store_semantics.py) runs on: PostgreSQL too,
#: on a real server started for the test session (skipped, with the reason, where none can be started).
STORE_BACKENDS = [*BACKENDS, "postgres"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=STORE_BACKENDS, name="backend")
def every_store_backend(request: pytest.FixtureRequest) -> str:
    """The ``backend`` of a test file that runs on PostgreSQL too (``from tests.conftest import
    every_store_backend``): memory, SQLite and PostgreSQL (skipped, saying why, where it cannot run)."""
    return str(request.param)


@pytest.fixture
def server_config(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> ServerConfig:
    if backend == "postgres":
        return ServerConfig(port=0, postgres=request.getfixturevalue("postgres_url"), grace=1.0)
    return ServerConfig(port=0, db=tmp_path / "store.db" if backend == "sqlite" else None, grace=1.0)


def _running_postgres() -> Iterator[postgres_server.PostgresServer]:
    """A started PostgreSQL server (loopback only, trust authentication), removed afterwards; the test is
    skipped, saying why, where none can run."""
    reason = postgres_server.why_unavailable()
    if reason:
        pytest.skip(reason)
    server = postgres_server.PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def postgres() -> Iterator[postgres_server.PostgresServer]:
    """A PostgreSQL server for the whole session."""
    yield from _running_postgres()


@pytest.fixture
def own_postgres() -> Iterator[postgres_server.PostgresServer]:
    """A PostgreSQL server of this test alone (for a test that stops and starts it again)."""
    yield from _running_postgres()


@pytest.fixture
def postgres_url(postgres: postgres_server.PostgresServer) -> Iterator[str]:
    """A new, empty database on the session's PostgreSQL server, dropped after the test."""
    url = postgres.create_database()
    yield url
    postgres.drop_database(url)


@pytest_asyncio.fixture
async def server(server_config: ServerConfig) -> AsyncIterator[RunningServer]:
    async with serving(server_config) as running:
        yield running


@pytest_asyncio.fixture
async def client(server: RunningServer) -> AsyncIterator[StoreClient]:
    c = StoreClient(f"127.0.0.1:{server.port}")
    try:
        yield c
    finally:
        await c.close()


@pytest_asyncio.fixture
async def store_server() -> AsyncIterator[RunningServer]:
    """A Store server in memory, no token (files that need another define their own)."""
    async with serving(ServerConfig(port=0, grace=1.0)) as running:
        yield running


@pytest_asyncio.fixture
async def store(store_server: RunningServer) -> AsyncIterator[StoreClient]:
    """A client of :func:`store_server`."""
    client = StoreClient(f"127.0.0.1:{store_server.port}")
    try:
        yield client
    finally:
        await client.close()


#: Tests of the whole system (training runs, the examples, real vLLM): marked e2e by where they live.
E2E_PATHS = (
    "tests/e2e/",
    "tests/examples/",
    "tests/training/test_training.py",
    "tests/training/test_chaos.py",
    "tests/vllm/",
)
#: Tests measured slow (0.9 s or more on this project's 2-core CPU machine): node-id prefixes, marked slow,
#: which `make test-fast` leaves out (about 1.5 minutes here for the rest).
SLOW_TESTS = (
    # whole files and folders: they start servers, browsers or children in every test
    "tests/docs/",
    "tests/bench/",
    "tests/dashboard/test_dashboard.py::",
    "tests/training/test_distributed_learner.py::",
    "tests/store/test_durability.py::",
    "tests/store/test_postgres_backend.py::",
    "tests/proxy/test_proxy_sampling.py::",
    # one test each: 0.9 s or more in `make test PYTEST_ARGS=--durations=150` (2026-11-26, 2 cores)
    "tests/batching/test_trainer_service.py::test_cli_shows_a_rollouts_triplets_and_the_trainer_status",
    "tests/batching/test_trainer_service.py::test_kill_9_between_submit_and_batch_loses_nothing",
    "tests/cli/test_cli.py::test_a_runner_that_cannot_reach_its_store_says_so_in_one_line_and_exits",
    "tests/cli/test_cli.py::test_cancel_then_delete_a_rollout",
    "tests/cli/test_cli.py::test_help_of_no_flags_is_truthful_and_shows_no_default_from_the_environment",
    "tests/cli/test_cli.py::test_help_shows_defaults_and_no_internal_names",
    "tests/cli/test_cli.py::test_serve_names_the_option_to_pass_when_the_backend_cannot_say_its_model",
    "tests/cli/test_cli.py::test_store_and_token_come_from_the_environment",
    "tests/cli/test_cli.py::test_unreachable_store_is_a_one_line_error",
    "tests/dashboard/test_dashboard_gateway.py::test_a_watch_streams_live_then_ends_with_an_end_stream_message",
    "tests/dashboard/test_dashboard_gateway.py::test_serve_starts_the_dashboard_and_no_dashboard_turns_it_off",
    "tests/engine/test_engine.py::test_chat_token_ids_match_the_template_and_the_text",
    "tests/engine/test_engine.py::test_init_model_cli_then_an_engine_subprocess",
    "tests/engine/test_engine.py::test_init_model_refuses_to_overwrite_a_model_without_force",
    "tests/engine/test_engine.py::test_the_admin_key_file_the_engine_made_is_removed_when_it_exits",
    "tests/proxy/test_proxy.py::test_32_concurrent_agents_each_recorded_once_under_its_attempt",
    "tests/proxy/test_proxy.py::test_a_long_call_keeps_its_attempt_alive",
    "tests/proxy/test_proxy.py::test_litellm_reshapes_vllm_token_fields",
    "tests/proxy/test_proxy.py::test_spans_written_while_the_store_is_down_arrive_when_it_returns",
    "tests/proxy/test_proxy_access.py::test_a_store_out_of_reach_is_a_server_side_error_that_names_no_address",
    "tests/runner/test_runner.py::test_200_concurrent_rollouts_keep_every_span_in_its_own_attempt",
    "tests/runner/test_runner.py::test_a_killed_runner_leaves_unresponsive_attempts_that_another_runner_retries",
    "tests/runner/test_runner.py::test_a_ray_fleet_runs_a_batch_of_rollouts_to_completion",
    "tests/runner/test_runner.py::test_sigterm_while_a_fleet_starts_stops_it_cleanly",
    "tests/runner/test_runner.py::test_spans_cut_by_a_store_restart_arrive_exactly_once",
    "tests/runner/test_runner.py::test_the_runner_command_runs_ray_actors_on_a_local_ray",
    "tests/server/test_access.py::test_a_fleet_started_with_the_admin_token_gives_each_process_its_own_runner_credential",
    "tests/server/test_hardening.py::test_the_shortest_progress_interval_allowed_paces_the_watcher",
    "tests/server/test_otlp.py::test_twenty_mebibyte_gzip_request",
    "tests/server/test_server.py::test_retries_recover_when_the_server_comes_up_during_the_call",
    "tests/server/test_server.py::test_sqlite_state_survives_a_restart",
    "tests/store/test_store_robustness.py::test_generated_traffic_keeps_the_store_sound",
    "tests/store/test_store_semantics.py::test_a_superseded_attempt_cannot_move_the_rollout_but_its_spans_are_kept",
    "tests/store/test_store_semantics.py::test_heartbeats_and_spans_both_keep_an_attempt_alive",
    "tests/store/test_store_semantics.py::test_tail_spans_follow_ends_when_the_rollout_has_ended",
    "tests/store/test_store_semantics.py::test_timeout_fires_within_a_second_with_no_client_calls",
    "tests/store/test_store_semantics.py::test_worker_heartbeats_do_not_keep_an_attempt_alive",
    "tests/test_extras.py::test_a_missing_extra_is_named",
    "tests/test_processes.py::test_a_child_server_stops_when_its_parent_is_killed",
    "tests/training/test_dynamic_sampling.py::test_flat_groups_are_set_aside_and_more_groups_drawn_until_the_batch_is_full",
    "tests/training/test_dynamic_sampling.py::test_at_the_cap_the_step_trains_on_what_it_has_and_says_so_once",
    "tests/training/test_experiment_config.py::test_help_config_lists_every_key_with_its_type_default_and_help",
    "tests/training/test_recovery.py::test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_the_latest",
    "tests/training/test_learner_temperatures.py::test_an_update_compares_the_recorded_log_probs_at_each_rows_temperature",
    "tests/training/test_reference_docs.py::test_every_metric_an_update_writes_is_in_the_table_and_pg_clipfrac_is_what_the_table_says",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark e2e and slow tests, which `make test-fast` leaves out (`make test` runs everything)."""
    for item in items:
        node = item.nodeid
        if node.startswith(E2E_PATHS):
            item.add_marker(pytest.mark.e2e)
        if node.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


def status_of(exc: BaseException) -> str:
    """The gRPC status code name of a raw stub error."""
    assert isinstance(exc, grpc.RpcError)
    return exc.code().name  # type: ignore[attr-defined, no-any-return]


class ServerProcess:
    """`lightning-grpc serve` in its own process (for kill -9 and CLI tests)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.lines: list[str] = []
        self._drainer: threading.Thread | None = None

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def start(self, timeout: float = 20.0) -> ServerProcess:
        self.launch()
        self.wait_for("event=server_started", timeout)
        return self

    def launch(self) -> ServerProcess:
        """Start the process without waiting for it to serve (a standby waits for its writer's lease)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_grpc.cli.main", "serve", "--host", "127.0.0.1", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=ROOT,
        )
        return self

    def wait_for(self, event: str, timeout: float = 20.0) -> str:
        """Read the output up to a line with ``event``; returns it. Once the server has started, the rest
        of its output is collected in :attr:`lines` by a thread."""
        assert self.proc is not None and self.proc.stdout is not None and self._drainer is None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if event in line:
                if "event=server_started" in line:
                    self.port = int(line.split("address=")[1].split()[0].rsplit(":", 1)[1])
                    self._drainer = threading.Thread(target=self._drain, daemon=True)
                    self._drainer.start()
                return line
        raise RuntimeError(
            f"server did not start (no {event} logged): exit={self.proc.poll()}\n{''.join(self.lines[-20:])}"
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(timeout)
        if self._drainer is not None:
            self._drainer.join(5)
        return code


@pytest.fixture
def server_process() -> Iterator[type[ServerProcess]]:
    started: list[ServerProcess] = []

    class Tracked(ServerProcess):
        def launch(self) -> ServerProcess:
            started.append(self)
            return super().launch()

    yield Tracked
    for p in started:
        p.kill()
