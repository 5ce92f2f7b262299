"""The run's supervisor with real child processes: a child that dies is started again, the journal keeps the
interruption with its cause, and the log keeps what the child said last (why it died, when it died by itself)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lightning_grpc.processes import Background
from lightning_grpc.training.recovery import Journal
from lightning_grpc.training.services import Child, Services
from lightning_grpc.training.supervision import ChildLost, Supervisor

DIES = "import sys; print('opening the store: disk full', flush=True); sys.exit(3)"
SERVES = "import time; print('serving', flush=True); time.sleep(60)"


def python(name: str, code: str) -> Background:
    return Background(name, ["-c", code], {})


def test_a_child_that_dies_is_restarted_and_its_last_words_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    restarted: list[Background] = []

    def restart() -> Background:
        process = python("server", SERVES)
        process.wait_for("serving", timeout=20)
        restarted.append(process)
        return process

    child = Child("server", python("server", DIES), restart=restart)
    services = Services(store="", proxy_url="", proxy_grpc="", children=[child])
    journal = Journal(tmp_path)
    supervisor = Supervisor(services, journal, restarts=2, backoff=0.05, step=lambda: 7)

    async def main() -> None:
        task = asyncio.create_task(supervisor.watch())
        deadline = asyncio.get_running_loop().time() + 20
        while not journal.path.exists():
            assert asyncio.get_running_loop().time() < deadline, "no interruption journaled in 20 s"
            await asyncio.sleep(0.05)
        task.cancel()

    try:
        with caplog.at_level("WARNING", logger="lightning_grpc.training"):
            asyncio.run(main())
        assert child.process is restarted[0] and child.process.alive()
        [entry] = journal.take_unreported()
        assert (entry.process, entry.step, entry.cause) == ("server", 7, "exited with code 3")
        died = [r.getMessage() for r in caplog.records if "event=child_died" in r.getMessage()]
        assert died and "opening the store: disk full" in died[0], caplog.text
    finally:
        for process in restarted:
            process.stop(timeout=5)


def test_a_child_that_dies_more_often_than_allowed_ends_the_run_with_its_last_words(tmp_path: Path) -> None:
    child = Child("runners-0", python("runners-0", DIES), restart=lambda: python("runners-0", DIES))
    services = Services(store="", proxy_url="", proxy_grpc="", children=[child])
    supervisor = Supervisor(services, Journal(tmp_path), restarts=0, backoff=0.05, step=lambda: 1)

    with pytest.raises(ChildLost) as lost:
        asyncio.run(asyncio.wait_for(supervisor.watch(), timeout=20))
    message = str(lost.value)
    assert "the runners-0 process exited (code 3)" in message
    assert "opening the store: disk full" in message
    assert "services.restarts = 0" in message
