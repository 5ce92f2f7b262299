"""The one-process learner's exports and checkpoints: what they print, what they hold."""

from __future__ import annotations

import shutil
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


def test_a_checkpoint_of_a_resumed_learner_holds_the_tokenizer_after_its_source_is_gone(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Every checkpoint is self-contained: a learner resumed from a checkpoint that ``keep`` deletes later still
    writes the tokenizer and chat template into its own (an engine starts from a checkpoint)."""
    from transformers import AutoTokenizer

    first = Learner(tiny_model).save_checkpoint(tmp_path / "step-1")
    resumed, _ = Learner.resume(first)
    shutil.rmtree(first)  # what checkpoint.keep does to old checkpoints
    later = resumed.save_checkpoint(tmp_path / "step-2")
    tokenizer = AutoTokenizer.from_pretrained(later, local_files_only=True)
    original = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert tokenizer.chat_template and tokenizer.chat_template == original.chat_template
    assert tokenizer("press 3")["input_ids"] == original("press 3")["input_ids"]
