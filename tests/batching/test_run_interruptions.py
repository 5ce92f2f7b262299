"""A training run's interruptions (a process that died, why, how the run recovered) through the contract:
ReportStep carries them, its answer, WatchTraining, the stored history and ``trainer status`` give them back."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from lightning_grpc.batching import RunInterruption, TrainerStatus, TrainingEvent
from lightning_grpc.batching.core import EVENT_KEY
from lightning_grpc.cli.trainer_commands import interruptions_text, status_text
from lightning_grpc.client import SyncTrainerClient, TrainerClient
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.server.app import RunningServer, ServerConfig
from lightning_grpc.v1 import trainer_service_pb2 as pb
from lightning_grpc.v1 import trainer_service_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.helpers import serving

KILLED_ENGINE = RunInterruption(
    time=1_700_000_000.25,
    process="engine",
    cause="exited with signal 9 (SIGKILL)",
    recovery="restarted on the same port after 1.0 s back-off",
    recovery_seconds=2.5,
    step=11,
)
KILLED_TRAINER = RunInterruption(
    time=1_700_000_042.5,
    process="trainer",
    cause="exited with signal 9 (SIGKILL)",
    recovery="resumed from checkpoint step-000010; steps 11-12 redone from their stored batches",
    recovery_seconds=14.0,
    step=12,
)


@pytest_asyncio.fixture
async def trainer(server: RunningServer) -> AsyncIterator[TrainerClient]:
    async with TrainerClient(f"127.0.0.1:{server.port}") as client:
        yield client


async def test_a_step_reports_two_interruptions_and_they_come_back_everywhere(trainer: TrainerClient) -> None:
    await trainer.report_step(11, 11, {"reward_mean": 0.25}, run_id="killed")
    event = await trainer.report_step(
        12, 12, {"reward_mean": 0.5}, run_id="killed", interruptions=[KILLED_ENGINE, KILLED_TRAINER]
    )
    assert event.interruptions == [KILLED_ENGINE, KILLED_TRAINER]  # the answer of ReportStep
    watched = [e async for e in trainer.watch_training("killed")]
    assert [e.interruptions for e in watched] == [[], [KILLED_ENGINE, KILLED_TRAINER]]
    last = (await trainer.status()).last_event
    assert last is not None and last.interruptions == [KILLED_ENGINE, KILLED_TRAINER]


async def test_a_resent_report_is_the_stored_event_only_with_the_same_interruptions(
    trainer: TrainerClient,
) -> None:
    first = await trainer.report_step(3, 3, {"loss": 0.1}, run_id="resent", interruptions=[KILLED_ENGINE])
    again = await trainer.report_step(3, 3, {"loss": 0.1}, run_id="resent", interruptions=[KILLED_ENGINE])
    assert again == first  # a retry: the stored event, not a second one
    other = await trainer.report_step(
        3, 3, {"loss": 0.1}, run_id="resent", interruptions=[KILLED_ENGINE, KILLED_TRAINER]
    )
    assert other.sequence == first.sequence + 1 and other.interruptions == [KILLED_ENGINE, KILLED_TRAINER]
    without = await trainer.report_step(3, 3, {"loss": 0.1}, run_id="resent")
    assert without.sequence == other.sequence + 1 and without.interruptions == []
    assert len([e async for e in trainer.watch_training("resent")]) == 3


@pytest.mark.parametrize(
    ("change", "field_name"),
    [
        ({"process": ""}, "interruptions[1].process"),
        ({"process": "p" * 129}, "interruptions[1].process"),
        ({"cause": "c" * 5000}, "interruptions[1].cause"),
        ({"recovery": "r" * 5000}, "interruptions[1].recovery"),
        ({"recovery_seconds": -1.0}, "interruptions[1].recovery_seconds"),
        ({"recovery_seconds": float("inf")}, "interruptions[1].recovery_seconds"),
        ({"step": -1}, "interruptions[1].step"),
    ],
)
async def test_a_refused_interruption_names_its_field(
    store_server: RunningServer, change: dict[str, object], field_name: str
) -> None:
    bad = RunInterruption(**{**KILLED_ENGINE.__dict__, **change})  # type: ignore[arg-type]
    async with TrainerClient(store_server.address) as trainer:
        with pytest.raises(InvalidArgumentError) as info:
            await trainer.report_step(1, 1, {}, interruptions=[KILLED_TRAINER, bad])
        assert info.value.metadata["field"] == field_name, info.value
        assert [e async for e in trainer.watch_training()] == []  # nothing recorded


async def test_too_many_interruptions_are_refused(store_server: RunningServer) -> None:
    async with TrainerClient(store_server.address) as trainer:
        with pytest.raises(InvalidArgumentError) as info:
            await trainer.report_step(1, 1, {}, interruptions=[KILLED_ENGINE] * 101)
        assert info.value.metadata["field"] == "interruptions"


async def test_the_raw_stub_carries_interruptions(store_server: RunningServer) -> None:
    """The contract's fields as any client sends them: RunInterruption on the request and on the event."""
    async with grpc.aio.insecure_channel(store_server.address) as channel:
        stub = pb_grpc.TrainerServiceStub(channel)
        request = pb.ReportStepRequest(run_id="raw", step=4, policy_version=4)
        sent = request.interruptions.add(process="runners", cause="exited with code 1", recovery_seconds=0.5)
        sent.time.FromSeconds(1_700_000_100)
        sent.step = 4
        answer = await stub.ReportStep(request)
        [got] = answer.event.interruptions
        assert (got.process, got.cause, got.recovery_seconds, got.step, got.time.seconds) == (
            "runners",
            "exited with code 1",
            0.5,
            4,
            1_700_000_100,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ReportStep(
                pb.ReportStepRequest(step=5, interruptions=[pb.RunInterruption(cause="no process")])
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "interruptions[0].process" in (refused.value.details() or "")


async def test_interruptions_survive_a_restart_and_older_events_still_load(tmp_path: Path) -> None:
    config = ServerConfig(port=0, db=tmp_path / "store.db", grace=0.5)
    async with serving(config) as running:
        # an event as an earlier version stored it: no interruptions key
        old = {"sequence": 1, "run_id": "old", "step": 1, "policy_version": 1, "metrics": {}, "time": 1.5}
        await running.store.put_meta({f"{EVENT_KEY}{1:012d}": json.dumps(old)})
    async with serving(config) as running, TrainerClient(running.address) as trainer:
        [loaded] = [e async for e in trainer.watch_training()]
        assert loaded == TrainingEvent(1, "old", 1, 1, {}, 1.5, [])
        reported = await trainer.report_step(2, 2, {}, run_id="old", interruptions=[KILLED_TRAINER])
        assert reported.sequence == 2
    async with serving(config) as running, TrainerClient(running.address) as trainer:
        events = [e async for e in trainer.watch_training("old")]
        assert [e.interruptions for e in events] == [[], [KILLED_TRAINER]]
        # a retry after the restart is still recognized as one
        again = await trainer.report_step(2, 2, {}, run_id="old", interruptions=[KILLED_TRAINER])
        assert again == events[1]


def test_status_text_lists_the_count_and_the_latest_interruptions() -> None:
    status = TrainerStatus(groups=[], drops={}, batches=0, rows=0, policy_version=3, last_event=None)
    assert "interruptions" not in status_text(status)
    assert status_text(status, []) == status_text(status)
    many = [
        RunInterruption(
            time=1_700_000_000.0 + n,
            process="engine",
            cause="exited with signal 9 (SIGKILL)",
            recovery=f"restart {n}",
            recovery_seconds=n / 2,
            step=n,
        )
        for n in range(7)
    ]
    text = interruptions_text(many)
    lines = text.splitlines()
    assert lines[0] == "interruptions: 7 (recovered, the last 5)"
    assert len(lines) == 6 and "restart 2" in lines[1] and "restart 6" in lines[-1]
    assert "step 6  engine: exited with signal 9 (SIGKILL); restart 6 (3.0 s)" in lines[-1]
    assert status_text(status, many).endswith(text)
    assert interruptions_text(many[:2]).splitlines()[0] == "interruptions: 2 (recovered)"


def test_trainer_status_shows_the_runs_interruptions(server_process: type[ServerProcess]) -> None:
    process = server_process("--port", "0", "--memory").start()
    with SyncTrainerClient(process.address) as trainer:
        before = trainer.report_step(10, 10, {"reward_mean": 0.5}, run_id="cli-run")
        cli = [sys.executable, "-m", "lightning_grpc.cli.main", "trainer", "status"]
        cli += ["--store", process.address]
        plain = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert plain.returncode == 0, plain.stderr
        assert "last step:" in plain.stdout and "interruptions" not in plain.stdout
        trainer.report_step(
            12, 12, {"reward_mean": 0.5}, run_id="cli-run", interruptions=[KILLED_ENGINE, KILLED_TRAINER]
        )
        trainer.report_step(13, 13, {}, run_id="cli-run")
        trainer.report_step(1, 1, {}, run_id="other-run", interruptions=[KILLED_ENGINE])
        trainer.report_step(14, 14, {}, run_id="cli-run")  # the last step: cli-run's are shown
    assert before.interruptions == []
    shown = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "last step:" in out and "14 (run cli-run)" in out and "consumed" in out
    tail = out.rstrip("\n").splitlines()[-3:]
    assert tail[0] == "interruptions: 2 (recovered)"
    assert "step 11  engine: exited with signal 9 (SIGKILL); restarted on the same port" in tail[1]
    assert tail[1].endswith("(2.5 s)")
    assert "step 12  trainer: exited with signal 9 (SIGKILL); resumed from checkpoint step-000010" in tail[2]
    assert tail[2].endswith("(14.0 s)")
    as_json = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert [i["process"] for i in data["interruptions"]] == ["engine", "trainer"]
    assert data["last_event"]["step"] == 14 and data["policy_version"] == 14
