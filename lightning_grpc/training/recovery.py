"""What lets a training run be killed anywhere and go on: checkpoints replaced atomically, the choice between a
fresh start and a resume, and the journal of the run's interruptions (``interruptions.jsonl``).

A checkpoint is written into ``step-N.partial`` and renamed to ``step-N`` once whole, so a kill during the
write leaves the previous checkpoint the latest complete one; the partial directory is removed by the next
run. Only ``step-N`` directories (and ``final``) are checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from lightning_grpc import logs
from lightning_grpc.batching import RunInterruption
from lightning_grpc.errors import FailedPreconditionError

from .learner import STATE_FILE
from .sharded import SHARDED_DIR

log = logs.get_logger(__name__)

CHECKPOINTS = "checkpoints"
PARTIAL = ".partial"
#: The file of a checkpoint of the one-process learner; a learner with ranks writes ``sharded/`` instead.
STATE_MARKERS = (STATE_FILE, SHARDED_DIR)
JOURNAL = "interruptions.jsonl"
#: The folder of the output directory that holds each child's output (``<child>.log``, see
#: :func:`lightning_grpc.processes.write_output_to`).
LOGS = "logs"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a whole checkpoint (a learner's state in it, not a partial write)."""
    return (
        path.is_dir() and not path.name.endswith(PARTIAL) and any((path / m).exists() for m in STATE_MARKERS)
    )


def step_checkpoints(output_dir: Path) -> list[Path]:
    """The run's ``checkpoints/step-N`` directories that are whole, oldest first."""
    folder = output_dir / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step-*") if is_checkpoint(p))


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest whole step checkpoint of the run, or None."""
    found = step_checkpoints(output_dir)
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    """N of ``step-N`` (0 for another name)."""
    digits = path.name.removeprefix("step-")
    return int(digits) if digits.isdigit() else 0


def write_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """``write(partial)`` into ``path.partial``, then that directory renamed to ``path`` (an existing ``path``
    is replaced only once the new one is whole)."""
    partial = path.with_name(path.name + PARTIAL)
    if partial.exists():
        shutil.rmtree(partial)
    write(partial)
    _fsync_tree(partial)
    if path.exists():
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old)
    else:
        os.replace(partial, path)
    _fsync_dir(path.parent)
    return path


def prune(output_dir: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest step checkpoints, and partial writes a kill left behind."""
    folder = output_dir / CHECKPOINTS
    for leftover in (*folder.glob(f"*{PARTIAL}"), *folder.glob("*.old")) if folder.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)
    whole = step_checkpoints(output_dir)
    for old in whole[: max(0, len(whole) - max(1, keep))]:
        shutil.rmtree(old)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: How far a run got and how it ended (written by the loop; read here to choose between resuming and not).
RUN_STATE = "run_state.json"


def run_finished(output_dir: Path) -> bool:
    """Whether the run in ``output_dir`` ran to its end (step limit, target or stop when stalled)."""
    try:
        return bool(json.loads((output_dir / RUN_STATE).read_text()).get("status") == "finished")
    except (OSError, ValueError, AttributeError):
        return False


def store_files(db: Path) -> Iterator[Path]:
    """The SQLite file and its write-ahead log and shared-memory files."""
    for suffix in ("", "-wal", "-shm"):
        yield db.with_name(db.name + suffix)


def clear_for_fresh_start(output_dir: Path, db: Path | None, *, checkpoints: bool) -> None:
    """Before a run that starts at step 1: the store, journal and children's output of an earlier run there
    go (its group and batch ids would be taken for this run's), and with ``checkpoints`` its checkpoints
    too."""
    if db is not None:
        for path in store_files(db):
            path.unlink(missing_ok=True)
    if checkpoints:
        for name in (CHECKPOINTS, "final"):
            if (output_dir / name).is_dir():
                shutil.rmtree(output_dir / name)
    (output_dir / JOURNAL).unlink(missing_ok=True)
    shutil.rmtree(output_dir / LOGS, ignore_errors=True)


def check_database_is_empty(url: str) -> None:
    """Before a fresh run on ``services.store_postgres``: an earlier run's rollouts there would be taken for
    this run's (and are not this run's to delete), so the database must hold none."""
    from lightning_grpc.store.postgres import count_rollouts, describe_url

    found = count_rollouts(url)
    if found:
        raise FailedPreconditionError(
            f"services.store_postgres: {describe_url(url)} holds {found} rollouts of an earlier run; a fresh "
            "run needs an empty database (create another, or resume the run that wrote them)"
        )


#: A process of the run that died, and how the run went on (one line of ``interruptions.jsonl``, and what
#: the step report carries to TrainerService and the dashboard).
Interruption = RunInterruption


class Journal:
    """``interruptions.jsonl`` in the output directory: one JSON object per interruption, appended and flushed
    as it happens; :meth:`take_unreported` hands each to the next step report once."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / JOURNAL
        self._unreported: list[Interruption] = []

    def record(self, interruption: Interruption) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(interruption)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._unreported.append(interruption)
        log.warning(
            "event=run_interrupted process=%s step=%d cause=%r recovery=%r seconds=%.1f",
            interruption.process,
            interruption.step,
            interruption.cause,
            interruption.recovery,
            interruption.recovery_seconds,
        )

    def take_unreported(self) -> list[Interruption]:
        taken, self._unreported = self._unreported, []
        return taken

    def read(self) -> list[Interruption]:
        """Every interruption recorded in the output directory, this invocation's and earlier ones'."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(Interruption(**json.loads(line)))
            except (ValueError, TypeError):
                continue  # a line cut by a kill during its write
        return out


def describe_exit(code: int | None) -> str:
    """``exited with code 1`` / ``killed by signal 9 (SIGKILL)``."""
    import signal

    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"
