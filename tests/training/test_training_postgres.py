"""A training run whose store lives in PostgreSQL (``services.store_postgres``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_grpc.errors import FailedPreconditionError
from lightning_grpc.training.loop import run_experiment
from tests.training.test_training import experiment

pytestmark = pytest.mark.timeout(300)


def test_a_run_keeps_its_store_in_postgres_and_a_fresh_run_wants_an_empty_database(
    tmp_path: Path, tiny_model: Path, postgres_url: str
) -> None:
    from lightning_grpc.store.postgres import count_rollouts

    config = experiment(tmp_path, tiny_model, services={"store_postgres": postgres_url})
    assert config.store_file is None
    result = run_experiment(config, progress=False)
    assert result.checkpoint is not None and (result.checkpoint / "model.safetensors").exists()
    assert not (config.output_dir / "store.db").exists()
    # 4 steps x 8 groups x 4 rollouts, each group whole, all in the database
    assert count_rollouts(postgres_url) >= 4 * 8 * 4

    (tmp_path / "again").mkdir()
    again = experiment(tmp_path / "again", tiny_model, services={"store_postgres": postgres_url})
    with pytest.raises(FailedPreconditionError, match=r"services.store_postgres: .* holds \d+ rollouts"):
        run_experiment(again, progress=False)
