"""Child processes of a run (engine, server, runners): they stop when the run that started them is gone, keep
only their latest lines in memory, and write what they say to files when asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from lightning_grpc import processes
from lightning_grpc.processes import KEPT_LINES, Background
from tests.engine_fixtures import QUIET_ENV


def test_a_child_server_stops_when_its_parent_is_killed() -> None:
    parent_code = textwrap.dedent(
        """
        import sys, time
        from lightning_grpc.processes import Background, log_field
        server = Background("server", ["-m", "lightning_grpc.cli.main", "serve", "--memory", "--port", "0"], {})
        line = server.wait_for("event=server_started", timeout=60)[0]
        print(server.proc.pid, log_field(line, "address"), flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=QUIET_ENV
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline().split()[0])
        child = psutil.Process(child_pid)
        assert child.is_running() and child.ppid() == parent.pid
        os.kill(parent.pid, signal.SIGKILL)  # no cleanup at all
        parent.wait(10)
        deadline = time.monotonic() + 20
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, (
            "the orphaned server kept running"
        )
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_child_that_does_not_start_serving_in_time_is_stopped_with_its_last_words() -> None:
    """A start (or a supervisor's restart) that hangs must not keep running: it would hold the ports that the
    next try needs."""
    stuck = Background(
        "server", ["-c", "import time; print('binding 127.0.0.1:4747', flush=True); time.sleep(600)"], {}
    )
    started = time.monotonic()
    try:
        stuck.wait_until_serving("event=server_started", timeout=1)
    except RuntimeError as exc:
        message = str(exc)
    else:
        raise AssertionError("wait_until_serving returned for a process that never served")
    assert "server: waited 1s before 1 x 'event=server_started' in its output" in message
    assert "binding 127.0.0.1:4747" in message
    assert not stuck.alive() and time.monotonic() - started < 10


def test_a_child_that_prints_without_end_keeps_only_its_latest_lines() -> None:
    """A run's runners live for days: an agent that prints on every rollout must not grow the run's memory."""
    printed = KEPT_LINES + 5_000
    chatty = Background(
        "runners-0",
        [
            "-c",
            f"for i in range({printed}): print(f'rollout {{i}} done')\nprint('event=runner_exit', flush=True)",
        ],
        {},
    )
    try:
        chatty.wait_for("event=runner_exit", timeout=30)
        chatty.read_to_end(10)
        lines = chatty.lines
        assert len(lines) == KEPT_LINES
        assert lines[0] == f"rollout {printed - KEPT_LINES + 1} done" and lines[-1] == "event=runner_exit"
        assert chatty.last_lines(2) == [f"rollout {printed - 1} done", "event=runner_exit"]
    finally:
        chatty.stop(timeout=5)


def finished(name: str, code: str) -> Background:
    child = Background(name, ["-c", code], {})
    child.proc.wait(30)
    child.read_to_end(10)
    return child


def test_a_childs_output_goes_to_its_file_line_by_line_and_a_restart_goes_on_in_it(tmp_path: Path) -> None:
    folder = processes.write_output_to(tmp_path / "logs")
    try:
        first = finished("runners-0", "print('event=runner_started'); print('a second line', flush=True)")
        assert first.output_path == tmp_path / "logs" / "runners-0.log"
        again = finished("runners-0", "import sys; print('started again'); sys.stdout.write('no newline')")
        assert again.output_path == first.output_path
        finished("server", "print('event=server_started')")
    finally:
        processes.write_output_to(None)
    assert folder is not None
    assert (folder / "runners-0.log").read_text() == (
        "event=runner_started\na second line\nstarted again\nno newline\n"
    )
    assert (folder / "server.log").read_text() == "event=server_started\n"
    after = finished("runners-0", "print('after the run')")  # none once the run has ended
    assert after.output_path is None and "after the run" not in (folder / "runners-0.log").read_text()


def test_a_childs_output_file_is_moved_aside_when_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "OUTPUT_FILE_BYTES", 1000)
    processes.write_output_to(tmp_path)
    try:
        chatty = finished("runners-0", "for i in range(300): print(f'rollout {i:04d} done')")
    finally:
        processes.write_output_to(None)
    assert chatty.output_path is not None
    kept, older = chatty.output_path.read_text(), (tmp_path / "runners-0.log.1").read_text()
    assert older.startswith("rollout ") and len(older.encode()) >= 1000
    assert kept.endswith("rollout 0299 done\n") and 0 < len(kept.encode()) < 1000 + 20
    assert len(chatty.lines) == 300  # the lines in memory are all there, whatever the files hold


_SERVING_SWITCH_INTERVAL = """
import asyncio, os, signal, sys
from pathlib import Path

from lightning_grpc.server.app import ServerConfig, serve


def ready(running):
    print("switch_interval", sys.getswitchinterval(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


db = Path(sys.argv[1]) if sys.argv[1] != "memory" else None
asyncio.run(serve(ServerConfig(port=0, db=db, grace=0.5), ready=ready))
"""


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
def test_a_serving_sqlite_store_hands_the_gil_over_within_its_switch_interval(
    backend: str, tmp_path: Path
) -> None:
    """The SQLite store's writer thread waits for the GIL after every call into SQLite: a process serving one
    sets the short switch interval once it serves (and still drains and exits 0); with the in-memory store,
    which has no writer, the process keeps Python's default."""
    where = str(tmp_path / "store.db") if backend == "sqlite" else "memory"
    done = subprocess.run(
        [sys.executable, "-c", _SERVING_SWITCH_INTERVAL, where],
        capture_output=True,
        text=True,
        timeout=120,
        env=QUIET_ENV,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("switch_interval")]
    expected = processes.SERVER_SWITCH_INTERVAL if backend == "sqlite" else 0.005
    assert float(line.split()[1]) == pytest.approx(expected)
    assert processes.SERVER_SWITCH_INTERVAL < 0.005  # Python's default, which it replaces
    assert sys.getswitchinterval() == pytest.approx(0.005)  # the test process keeps its own
