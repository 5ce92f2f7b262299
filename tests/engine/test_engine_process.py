"""EngineProcess.start keeps its timeout when the engine neither serves nor exits."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lightning_grpc.engine import EngineProcess


def test_an_engine_that_stays_silent_is_killed_when_start_times_out(tmp_path: Path) -> None:
    # The child imports sitecustomize before anything else: this one hangs there, printing nothing.
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(600)\n")
    engine = EngineProcess(tmp_path / "no-model", env={"PYTHONPATH": str(tmp_path)})
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the engine did not start \(engine: waited 3s"):
        engine.start(timeout=3)
    assert time.monotonic() - started < 30
    assert engine.proc is not None and engine.proc.poll() is not None  # killed, not left behind
