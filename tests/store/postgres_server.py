"""A real PostgreSQL server for the tests: its own cluster in a temporary directory, on loopback only.

``initdb`` makes the cluster (trust authentication, no password), ``pg_ctl`` starts it listening on
127.0.0.1 at a free port, with its Unix socket in the same directory, and stops it at the end (killed by
its process id when a stop does not finish). PostgreSQL refuses to run as root: a test run as root runs
``initdb`` and ``pg_ctl`` as the unprivileged ``postgres`` user (``runuser``), in a directory it owns.

:func:`why_unavailable` says why no server can be started here (no PostgreSQL binaries, no psycopg, root
without a ``postgres`` user), so that the tests that need one are skipped with that reason.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

#: The unprivileged user that runs the server when the tests run as root.
SERVER_USER = "postgres"


def find_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl`` (on PATH, or the newest under /usr/lib/postgresql)."""
    found = shutil.which("pg_ctl")
    candidates = [Path(os.path.realpath(found)).parent] if found else []
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for directory in candidates:
        if (directory / "initdb").exists() and (directory / "pg_ctl").exists():
            return directory
    return None


def why_unavailable() -> str:
    """Why a test PostgreSQL server cannot be started here ('' when it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'lightning-grpc[postgres]')"
    if find_bin_dir() is None:
        return "PostgreSQL is not installed (no initdb and pg_ctl on PATH or under /usr/lib/postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root, and there is no {SERVER_USER!r} user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            return "running as root, and there is no runuser to run PostgreSQL as another user"
    return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One PostgreSQL cluster of the tests: :meth:`start`, :meth:`stop`, :meth:`start` again (same port and
    data), :meth:`destroy` at the end."""

    def __init__(self) -> None:
        bin_dir = find_bin_dir()
        assert bin_dir is not None, why_unavailable()
        self.bin_dir = bin_dir
        self.as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="lightning-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        if self.as_root:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    def _run(self, tool: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / tool), *args]
        if self.as_root:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if out.returncode != 0:
            raise RuntimeError(
                f"{tool} failed ({out.returncode}): {out.stdout}{out.stderr}{self._log_tail()}"
            )
        return out

    def _log_tail(self) -> str:
        try:
            return "\n" + "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        except OSError:
            return ""

    def start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.root}"
            " -c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: active connections are cut; ``immediate``: as a crash)."""
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")
        except (RuntimeError, subprocess.TimeoutExpired):
            self.kill()

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)

    def running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def destroy(self) -> None:
        if self.pid() is not None:
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str | None = None) -> str:
        """A new, empty database; returns its URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> int:
    """``python -m tests.store.postgres_server``: a throwaway server with one database, for a test written in
    another language (the TypeScript client's). Prints ``url=URL`` once it serves, or ``unavailable=REASON``
    (exit 3) when none can be started here; removes everything on SIGTERM, or once its parent is gone."""
    reason = why_unavailable()
    if reason:
        print(f"unavailable={reason}", flush=True)
        return 3
    parent = os.getppid()
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    server = PostgresServer()
    try:
        server.start()
        print(f"url={server.create_database()}", flush=True)
        while not stopping and os.getppid() == parent:
            time.sleep(0.2)
    finally:
        server.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
