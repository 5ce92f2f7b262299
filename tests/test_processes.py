"""Child processes of a run (engine, server, runners) stop when the run that started them is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

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
