"""Child processes of ``lightning-grpc`` commands (store, engine, runners), their output read line by line,
and what a long-running server process does once it has started."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from lightning_grpc import environment

#: The arguments that run ``lightning-grpc`` with a Python interpreter (``python -m ...``).
CLI = ["-m", "lightning_grpc.cli.main"]
#: The lines of a child's output kept (the latest): a run's runners live for days, and an agent that prints,
#: or fails, on every rollout would otherwise grow the run's memory by a line each time.
KEPT_LINES = 10_000
#: The most a child's output file (:func:`write_output_to`) holds before it is moved to ``<name>.log.1``
#: (replacing the one there) and a new one begun.
OUTPUT_FILE_BYTES = 64 * 1024 * 1024

_output_dir: Path | None = None


def write_output_to(folder: str | os.PathLike[str] | None) -> Path | None:
    """From now on each child started here also writes its output, line by line as it comes, to
    ``folder/<name>.log`` (appended: a child started again goes on in the same file), so that what a run's
    server, engine and runners said is there to read while it runs and after it ends, however it ended.
    None: their output is kept in memory only (:data:`KEPT_LINES` lines each). Returns the folder."""
    global _output_dir
    _output_dir = None if folder is None else Path(folder)
    if _output_dir is not None:
        _output_dir.mkdir(parents=True, exist_ok=True)
    return _output_dir


class Background:
    """A child process whose output (stdout and stderr together) a thread reads line by line, keeping the
    latest :data:`KEPT_LINES` in :attr:`lines`."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        python: bool = True,
    ) -> None:
        """``args`` are this Python's arguments (``python=False``: a whole command line of any program)."""
        self.name = name
        if not python and not args:
            raise ValueError(f"{name}: an empty command")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, *args] if python else list(args),
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**env, environment.PARENT_PID: str(os.getpid())},
                # a group of its own: Ctrl-C in a terminal reaches the command that started it, which stops
                # it in order (a child that took the SIGINT too would die mid-step, printing tracebacks)
                process_group=0,
            )
        except OSError as exc:  # a command that is not there, or not executable
            raise RuntimeError(f"{name}: cannot start {next(iter(args))!r}: {exc.strerror or exc}") from None
        self._lines: deque[str] = deque(maxlen=KEPT_LINES)
        #: Where its output is written too (:func:`write_output_to`), or None.
        self.output_path = None if _output_dir is None else _output_dir / f"{name}.log"
        self._closed = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        output = _OutputFile(self.output_path) if self.output_path is not None else None
        for line in self.proc.stdout:
            with self._changed:
                self._lines.append(line.rstrip("\n"))
                self._changed.notify_all()
            if output is not None:
                output.write(line)
        if output is not None:
            output.close()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, marker: str, count: int = 1, timeout: float = 30.0) -> list[str]:
        """The first ``count`` output lines holding ``marker``, once there are that many."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in self._lines if marker in line]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    why = "exited" if self._closed else f"waited {timeout:.0f}s"
                    raise RuntimeError(f"{self.name}: {why} before {count} x {marker!r} in its output")
                self._changed.wait(left)

    def wait_until_serving(self, marker: str, timeout: float) -> list[str]:
        """:meth:`wait_for` the line that says it serves; when it does not come (the process exited, or
        ``timeout`` passed), stop the process, so that one stuck starting does not keep the ports its next
        start needs, and raise RuntimeError with its last lines."""
        try:
            return self.wait_for(marker, timeout=timeout)
        except RuntimeError as exc:
            self.stop(timeout=5)
            raise RuntimeError(f"{exc}; its last lines:\n{self.tail()}") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it is still there after ``timeout`` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.read_to_end(5)
        return code

    def read_to_end(self, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` seconds until what an exited process printed is all in :attr:`lines` (its
        last lines may still be in the pipe when its exit is seen)."""
        self._reader.join(timeout)

    @property
    def lines(self) -> list[str]:
        """What it printed so far, the latest :data:`KEPT_LINES` lines (a copy: the reader goes on)."""
        with self._changed:
            return list(self._lines)

    def last_lines(self, count: int) -> list[str]:
        """The last ``count`` lines it printed (without copying the rest)."""
        with self._changed:
            return list(itertools.islice(reversed(self._lines), count))[::-1]

    def tail(self, lines: int = 20) -> str:
        return "\n".join(f"  | {line}" for line in self.last_lines(lines))


class _OutputFile:
    """A child's output file, written by its reader thread: each line as it comes (line-buffered, so a kill of
    the whole run loses none), moved aside at :data:`OUTPUT_FILE_BYTES`; a write that fails (a full disk)
    stops the writing, never the reading."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError as exc:
            print(f"lightning-grpc: cannot write {path}: {exc}", file=sys.stderr)

    def write(self, line: str) -> None:
        if self._file is None:
            return
        try:
            self._file.write(line if line.endswith("\n") else line + "\n")
            if self._file.tell() >= OUTPUT_FILE_BYTES:
                self._file.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self._file = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError as exc:
            print(f"lightning-grpc: stopped writing {self.path}: {exc}", file=sys.stderr)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def log_field(line: str, key: str) -> str:
    """The value of ``key=value`` in a log line."""
    return line.split(f"{key}=", 1)[1].split()[0]


def freeze_startup_heap() -> None:
    """Put what a server process allocated to start (modules, descriptors, the state it loaded) out of the
    garbage collector's sight: its full collections then visit only what it made since.

    A server that keeps many container objects (the in-memory store's spans) runs full collections now and
    then while it grows, and each one visits every tracked object, the tens of thousands its imports left
    included: span ingest at 128 streams spent about 7% more CPU once the dashboard's imports were added.
    For processes that serve until they exit (``serve``, ``proxy``, ``engine``, the ``runner`` processes),
    called once they serve; not in tests. In the engine and the runners the collector had taken 8-11% of
    the process's CPU time during a training run (py-spy, the demo's loop).

    It also collects less often (:data:`SERVER_GC_THRESHOLDS`): a call makes a few hundred short-lived
    containers, most of them freed as soon as the call ends, and at Python's default the collector ran every
    couple of calls and promoted what was still in flight towards the full collections.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLDS)


def hand_over_the_gil_promptly() -> None:
    """Let a thread waiting for the GIL have it within :data:`SERVER_SWITCH_INTERVAL` of asking: for ``serve``
    with a SQLite store, once it serves (not in tests).

    The SQLite store commits on a writer thread, and Python's sqlite3 gives the GIL up some six times a statement
    (the step, the resets, the column count, the last row id); each time the writer must take it back from the
    event loop, which holds it until its own work pauses or the switch interval (Python's default: 5 ms) runs
    out. Measured in ``serve --db`` at 8 span streams: a commit's statements took 27-35 ms of the writer's time
    for 8-10 ms of its CPU, about 50 waits for the GIL a commit; the same with the file on tmpfs, so not the
    disk. Acknowledgements wait for the commit, so that wait set the pace. At 100 us (alternating pairs): span
    ingest (W=8, 64-span batches) 57-59k -> 70-75k spans/s and the rollout cycle (K=32) 1,300-1,490 ->
    1,430-1,610 rollouts/s (three pairs each), the training batch the same (two). Not set where it cost more than
    it saved, two or three alternating pairs each (why was not looked into): with PostgreSQL (span ingest 35-37k
    -> 27k spans/s), and in a server that hosts the LLM proxy (the demo's loop 4-11 % fewer rollouts/s, the
    server's CPU a step up by 11-39 %); nor with the in-memory store, which has no writer (its rollout cycle the
    same either way).
    """
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL)


#: The switch interval of a serving SQLite store (seconds; Python's default is 0.005): see
#: :func:`hand_over_the_gil_promptly`.
SERVER_SWITCH_INTERVAL = 0.0001


#: The collector's thresholds in a serving process (Python's default: 700, 10, 10): the youngest generation
#: is collected after 50,000 new containers, the middle one every 50 of those collections.
SERVER_GC_THRESHOLDS = (50_000, 50, 100)


def stop_with_parent(interval: float = 1.0, grace: float = 5.0) -> None:
    """In a child started by :class:`Background`: SIGTERM itself once that parent is gone, and exit outright
    ``grace`` seconds later if it is still there (a runner would otherwise wait out its drain for rollouts
    nobody will take: their attempts are tried again when the run resumes).

    A run killed outright (SIGKILL, or SIGTERM before its cleanup) would otherwise leave its engine,
    server and runners serving nobody. Each child checks its parent every ``interval`` seconds.
    """
    expected = os.environ.pop(environment.PARENT_PID, "")
    if not expected.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(expected):
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


def child_env() -> dict[str, str]:
    """This environment without LIGHTNING_GRPC_* settings (a token or store address of the user's own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(environment.PREFIX)}


def model_child_env(threads: int) -> dict[str, str]:
    """:func:`child_env` for a child that runs a model: ``threads`` torch threads, no model hub."""
    return {
        **child_env(),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


#: Seconds a starting Ray head waits for its GCS server to publish its port (Ray's own default, 30 s, is short on
#: a loaded two-core machine; ``RAY_gcs_server_port_wait_time_s`` set by the user wins).
RAY_GCS_WAIT_S = "120"


def start_ray(ray: ModuleType, **options: Any) -> None:
    """``ray.init(**options)`` with a longer wait for the GCS server, and one more try after a head that did not
    come up (Ray raises ``RuntimeError`` naming the port file it waited for)."""
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", RAY_GCS_WAIT_S)
    try:
        ray.init(**options)
    except RuntimeError as error:
        if options.get("address") or "Timed out waiting for file" not in str(error):
            raise
        ray.shutdown()
        ray.init(**options)
