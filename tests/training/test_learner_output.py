"""What the one-process learner prints: nothing per weight export (a run exports every step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_grpc.training.learner import Learner


def test_exporting_the_weights_draws_no_progress_bar(
    tiny_model: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    learner = Learner(tiny_model)
    capfd.readouterr()
    for step in range(2):
        exported = learner.export_weights(tmp_path / f"step-{step}")
        assert (exported / "config.json").is_file()
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err and "it/s" not in err, err
