"""The durable backend: SQLite through sqlite-utils, WAL, one writer thread.

The writer drains every change submitted while it was busy and commits them together (group
commit); each submitter's future resolves only after that commit. What an acknowledged write survives
depends on the sync level (:data:`SYNC_LEVELS`):

- ``full`` (the default): SQLite syncs the write-ahead log to the disk at every commit, so an
  acknowledged write survives a crash of the server process, of the operating system, and a power loss.
- ``normal``: the log is synced only at checkpoints. An acknowledged write survives a crash of the
  server process (``kill -9``); a crash of the host or a power loss may lose the last commits.

When a commit fails for want of space (a full disk, or the database at ``max_bytes``), nothing of it is
acknowledged: the writer keeps the batch and tries it again, with back-off, until space returns, while
:attr:`SqliteBackend.out_of_space` tells the store to refuse new writes. Deletes are still taken: the writer
commits them ahead of the held batch (whose rows of deleted rollouts it drops, as the delete would have), so
that deleting finished rollouts makes room for what waits.

A new store file is made with pages of :data:`PAGE_SIZE` bytes; a file made before keeps its own (SQLite fixes a
file's page size when it is created), and both are read and written alike.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import queue
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlite_utils
from sqlite_utils import Migrations

from lightning_grpc import logs

from . import rows
from .backend import SpanQuery
from .state import Change, LoadedState, SpanRecord, Txn

log = logs.get_logger(__name__)

migrations = Migrations("lightning_grpc.store")


@migrations(name="0001_initial")
def _initial_schema(db: sqlite_utils.Database) -> None:
    table = db.table
    table("meta").create({"key": str, "value": str}, pk="key")
    table("rollouts").create(
        {
            "rollout_id": str,
            "status": int,
            "mode": int,
            "group_id": str,
            "resources_id": str,
            "create_time": float,
            "start_time": float,
            "end_time": float,
            "attempt_count": int,
            "status_message": str,
            "queue_seq": int,
            "fingerprint": str,
            "input": str,
            "config": str,
            "metadata": str,
        },
        pk="rollout_id",
    )
    table("attempts").create(
        {
            "attempt_id": str,
            "rollout_id": str,
            "sequence_number": int,
            "status": int,
            "worker_id": str,
            "start_time": float,
            "end_time": float,
            "last_heartbeat_time": float,
            "status_message": str,
            "metadata": str,
            "next_sequence_id": int,
            "span_count": int,
            "request_id": str,
        },
        pk="attempt_id",
    )
    table("attempts").create_index(["rollout_id", "sequence_number"], unique=True)
    table("spans").create(
        {
            "rollout_id": str,
            "attempt_id": str,
            "attempt_no": int,
            "sequence_id": int,
            "span_id": str,
            "trace_id": str,
            "parent_span_id": str,
            "name": str,
            "start_ns": int,
            "end_ns": int,
            "body": bytes,
        }
    )
    table("spans").create_index(["rollout_id", "attempt_no", "sequence_id"], unique=True)
    table("workers").create(
        {
            "worker_id": str,
            "status": int,
            "heartbeat_stats": str,
            "last_heartbeat_time": float,
            "last_dequeue_time": float,
            "current_rollout_id": str,
            "current_attempt_id": str,
        },
        pk="worker_id",
    )
    table("resources").create(
        {
            "resources_id": str,
            "version": int,
            "create_time": float,
            "update_time": float,
            "body": str,
            "fingerprint": str,
        },
        pk="resources_id",
    )
    table("changes").create({"revision": int, "rollout_id": str, "body": str}, pk="revision")


#: The most rows one INSERT statement writes (fewer where the SQLite library allows fewer parameters a
#: statement). Python's sqlite3 lets other threads run while SQLite executes each statement and takes the
#: GIL back after it, which under load means waiting for the event loop, a millisecond or more a statement
#: (measured at 8 span streams: 8 attempt rows written one statement each took 10 ms of a commit, 0.5 ms of
#: it on the CPU; 4-5.5 ms as one statement). So a commit writes each table's rows in as few statements as it
#: can. A cap of 2,048 rows held 14 MB more of prepared statements in a server after 1,000,000 spans, for
#: no throughput measured.
ROWS_PER_STATEMENT = 256
#: The spans of a commit (``rows.SPAN_COLUMNS``).
SPANS_INSERT = f"INSERT INTO spans ({', '.join(rows.SPAN_COLUMNS)})"
#: The change log's rows (revision, rollout_id, body).
CHANGES_INSERT = "INSERT OR REPLACE INTO changes (revision, rollout_id, body)"
#: The meta table's (key, value) rows.
META_UPSERT = ("INSERT INTO meta (key, value)", " ON CONFLICT (key) DO UPDATE SET value = excluded.value")


def rows_per_statement(conn: sqlite3.Connection, columns: int) -> int:
    """The rows of ``columns`` values that one statement writes at most: :data:`ROWS_PER_STATEMENT`, or fewer
    where the library takes fewer parameters; a power of two (see :func:`statement_sizes`)."""
    most = max(1, min(ROWS_PER_STATEMENT, conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // columns))
    return 1 << (most.bit_length() - 1)


def statement_sizes(count: int, most: int) -> Iterator[int]:
    """How ``count`` rows are written: statements of ``most`` rows (a power of two), then the rest in smaller
    powers of two, largest first. A commit takes few statements, and a table has at most log2(most) + 1
    statement texts, which sqlite3's cache of prepared statements keeps."""
    while count:
        size = most if count >= most else 1 << (count.bit_length() - 1)
        yield size
        count -= size


@functools.lru_cache(maxsize=256)
def _values_statement(head: str, columns: int, count: int, tail: str = "") -> str:
    """``head`` VALUES with ``count`` rows of ``columns`` parameters, then ``tail``."""
    row = "(" + ",".join("?" * columns) + ")"
    return f"{head} VALUES {','.join([row] * count)}{tail}"


def _write_rows(conn: sqlite3.Connection, values: list[tuple[Any, ...]], head: str, tail: str = "") -> None:
    """Write ``values`` (rows of equal length) with the statement ``head`` VALUES ... ``tail``, in as few
    statements as the library allows."""
    columns = len(values[0])
    start = 0
    for size in statement_sizes(len(values), rows_per_statement(conn, columns)):
        sql = _values_statement(head, columns, size, tail)
        conn.execute(sql, list(itertools.chain.from_iterable(values[start : start + size])))
        start += size


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


#: The page size of a new store file (SQLite's default is 4 KiB). A span's row is about 1.4 KB (its body is the
#: span's Protobuf bytes), so a 4 KiB page holds two and leaves a third of itself empty: 16 KiB pages hold eleven.
#: Measured with bench/grpc_peer.py span-ingest (8 streams of 64-span batches, synchronous=FULL): 28 % less
#: file per span, 18 % less server CPU per span, 25 % more spans a second; the rollout cycle, whose commits
#: change small rows, was the same either way.
PAGE_SIZE = 16384

#: SQLite's ``synchronous`` setting for each sync level this backend offers.
SYNC_LEVELS = {"full": "FULL", "normal": "NORMAL"}
DEFAULT_SYNC = "full"
#: SQLite's own largest page count: no limit.
_NO_PAGE_LIMIT = 4294967294
#: How long the writer waits before trying a batch again while out of space (doubling up to the second).
_FULL_RETRY = (0.1, 2.0)


def _is_full(exc: BaseException) -> bool:
    """Whether SQLite failed for want of space (SQLITE_FULL: the disk, or max_page_count)."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "database or disk is full" in str(
        exc
    )


class SqliteBackend:
    """Durable storage in one SQLite file.

    ``synchronous``: ``"full"`` (the default) or ``"normal"`` (see the module's docstring). ``max_bytes``:
    the largest the database may grow (None: as large as the disk allows); beyond it, writes are refused
    as on a full disk.
    """

    name = "sqlite"
    in_memory = False
    #: A file in this process's reach: never out of reach (see Backend.unavailable).
    unavailable = ""

    def __init__(
        self,
        path: str | Path,
        *,
        change_retention: int = 10_000,
        synchronous: str = DEFAULT_SYNC,
        max_bytes: int | None = None,
    ) -> None:
        if synchronous not in SYNC_LEVELS:
            raise ValueError(f"synchronous must be one of {', '.join(SYNC_LEVELS)} (got {synchronous!r})")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive (got {max_bytes})")
        self.path = Path(path)
        self.change_retention = change_retention
        self.synchronous = synchronous
        self.max_bytes = max_bytes
        #: True while commits fail for want of space (see the module's docstring).
        self.out_of_space = False
        self._closing = threading.Event()
        #: Set when a write that frees space arrives (or on close): a writer waiting for space looks at once.
        self._wake = threading.Event()
        self._applied_page_limit: int | None = None
        self._queue: queue.Queue[tuple[list[tuple[str, Any]], asyncio.Future[None]] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lightning-sqlite-read")
        self._local = threading.local()
        self._index_conn: sqlite3.Connection | None = None
        self._write_conn: sqlite3.Connection | None = None
        self._last_pruned = 0

    # ---------------------------------------------------------------- start-up
    async def open(self) -> LoadedState:
        self._loop = asyncio.get_running_loop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = _connect(self.path)
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # takes effect only where the file is new
        db = sqlite_utils.Database(conn)
        db.enable_wal()
        conn.execute(f"PRAGMA synchronous={SYNC_LEVELS[self.synchronous]}")
        migrations.apply(db)
        self._write_conn = conn
        state = self._load(db)
        self._index_conn = _connect(self.path)
        self._writer = threading.Thread(target=self._write_loop, name="lightning-sqlite-writer", daemon=True)
        self._writer.start()
        log.info(
            "event=sqlite_opened path=%s synchronous=%s rollouts=%d spans=%d",
            self.path,
            self.synchronous,
            len(state.rollouts),
            state.total_spans,
        )
        return state

    def _load(self, db: sqlite_utils.Database) -> LoadedState:
        meta = {r["key"]: r["value"] for r in db["meta"].rows}
        store_id = meta.get("store_id")
        if not store_id:
            store_id = uuid.uuid4().hex[:12]
            with db.conn:
                db.conn.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('store_id', ?)", (store_id,)
                )
        state = LoadedState(
            store_id=store_id, latest_resources_id=meta.get("latest_resources_id", ""), meta=meta
        )
        by_id = {}
        for row in db.query("SELECT * FROM rollouts ORDER BY create_time, rowid"):
            rs = rows.rollout_from_row(row)
            by_id[rs.rollout.rollout_id] = rs
            state.rollouts.append(rs)
        for row in db.query("SELECT * FROM attempts ORDER BY rollout_id, sequence_number"):
            ast = rows.attempt_from_row(row)
            owner = by_id.get(ast.attempt.rollout_id)
            if owner is not None:
                owner.attempts.append(ast)
        for rs in state.rollouts:
            if rs.attempts:
                rs.rollout.latest_attempt = rs.attempts[-1].attempt
        state.workers = [rows.worker_from_row(r) for r in db.query("SELECT * FROM workers")]
        state.resources = [
            rows.resources_from_row(r) for r in db.query("SELECT * FROM resources ORDER BY create_time")
        ]
        for row in db.query(
            "SELECT revision, body FROM changes ORDER BY revision DESC LIMIT ?", [self.change_retention]
        ):
            state.changes.append(Change(row["revision"], rows.rollout_from_dict(json.loads(row["body"]))))
        state.changes.reverse()
        state.revision = int(meta.get("revision", "0"))
        if state.changes:
            state.revision = max(state.revision, state.changes[-1].revision)
        state.total_spans = sum(a.span_count for rs in state.rollouts for a in rs.attempts)
        return state

    def on_outage(self, callback: Callable[[], None]) -> None:
        return None  # a full disk is found by a failing commit, which the write waiting on it reports

    def on_lease_lost(self, callback: Callable[[], None]) -> None:
        return None  # a SQLite file has one server, with nobody waiting to take it over

    # ---------------------------------------------------------------- writes
    def submit(self, tx: Txn) -> asyncio.Future[None]:
        """Snapshot the changed rows now (on the event loop) and hand them to the writer."""
        assert self._loop is not None
        ops = rows.txn_ops(tx)
        fut: asyncio.Future[None] = self._loop.create_future()
        self._queue.put((ops, fut))
        if tx.deleted_rollouts:
            self._wake.set()
        return fut

    def _write_loop(self) -> None:
        conn = self._write_conn
        assert conn is not None
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < 512:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            error = self._commit(conn, batch)
            assert self._loop is not None
            self._loop.call_soon_threadsafe(rows.resolve_all, batch, error)
        conn.close()

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Change the size limit while running (None: none); the writer applies it before its next commit."""
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive (got {max_bytes})")
        self.max_bytes = max_bytes

    def _commit(self, conn: sqlite3.Connection, batch: list[Any]) -> BaseException | None:
        """Commit a batch of submissions in one transaction; returns the error that ended it, if any.

        Out of space, the transaction is rolled back and tried again, with back-off, until it commits
        (or the backend closes): the batch's submitters wait, and nothing is acknowledged before it is
        written.
        """
        delay = _FULL_RETRY[0]
        while True:
            try:
                self._apply_page_limit(conn)
                with conn:
                    self._apply(conn, rows.merged_ops(ops for ops, _ in batch))
            except BaseException as exc:
                if _is_full(exc) and not self._closing.is_set():
                    if not self.out_of_space:
                        log.error(
                            "event=sqlite_out_of_space path=%s waiting=%d error=%s",
                            self.path,
                            len(batch),
                            exc,
                        )
                    self.out_of_space = True
                    if self._wake.wait(delay):
                        self._wake.clear()
                    if self._commit_deletes_first(conn, batch):
                        delay = _FULL_RETRY[0]
                    else:
                        delay = min(delay * 2, _FULL_RETRY[1])
                    continue
                log.error("event=sqlite_commit_failed error=%r", exc)  # resolve every waiter, keep serving
                return exc
            if self.out_of_space:
                self.out_of_space = False
                log.info("event=sqlite_space_returned path=%s committed=%d", self.path, len(batch))
            return None

    def _commit_deletes_first(self, conn: sqlite3.Connection, batch: list[Any]) -> bool:
        """While ``batch`` waits for space: commit the deletes submitted since, ahead of it (rows.commit_deletes_first)."""
        assert self._loop is not None
        loop = self._loop

        def try_delete(item: rows.Submission, deleted: set[str]) -> rows.DeleteOutcome:
            ops, fut = item
            try:
                with conn:
                    self._apply(conn, ops)
            except BaseException as exc:
                if _is_full(exc):
                    return rows.DeleteOutcome.WAITS
                loop.call_soon_threadsafe(rows.resolve, fut, exc)
                return rows.DeleteOutcome.REFUSED
            log.info("event=sqlite_deleted_while_full path=%s rollouts=%d", self.path, len(deleted))
            loop.call_soon_threadsafe(rows.resolve, fut, None)
            return rows.DeleteOutcome.COMMITTED

        return rows.commit_deletes_first(self._queue, batch, try_delete)

    def _apply_page_limit(self, conn: sqlite3.Connection) -> None:
        if self.max_bytes is None:
            pages = _NO_PAGE_LIMIT
        else:
            page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
            pages = max(1, self.max_bytes // page_size)
        if pages != self._applied_page_limit:
            conn.execute(f"PRAGMA max_page_count={pages}")
            self._applied_page_limit = pages

    def _apply(self, conn: sqlite3.Connection, ops: list[tuple[str, Any]]) -> None:
        for kind, payload in ops:
            if kind == "spans":
                _write_rows(conn, payload, SPANS_INSERT)
            elif kind in rows.ROW_KEYS:
                columns, values = rows.row_values(payload)
                _write_rows(conn, values, *rows.upsert_parts(kind, columns))
            elif kind == "changes":
                _write_rows(conn, payload, CHANGES_INSERT)
                last = payload[-1][0]
                if last - self._last_pruned >= 1000:
                    conn.execute("DELETE FROM changes WHERE revision <= ?", (last - self.change_retention,))
                    self._last_pruned = last
            elif kind == "meta":
                _write_rows(conn, payload, *META_UPSERT)
            elif kind == "delete":
                ids = [(rid,) for rid in payload]
                conn.executemany("DELETE FROM spans WHERE rollout_id = ?", ids)
                conn.executemany("DELETE FROM attempts WHERE rollout_id = ?", ids)
                conn.executemany("DELETE FROM rollouts WHERE rollout_id = ?", ids)

    # ---------------------------------------------------------------- reads
    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _connect(self.path)
        return conn

    async def query_spans(self, query: SpanQuery) -> list[SpanRecord]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._query_spans, query)

    def _query_spans(self, q: SpanQuery) -> list[SpanRecord]:
        where, params = self._span_filters(q)
        where.append(
            "(attempt_no, sequence_id) < (?, ?)" if q.descending else "(attempt_no, sequence_id) > (?, ?)"
        )
        params += [q.after[0], q.after[1]]
        direction = " DESC" if q.descending else ""
        sql = (
            "SELECT rollout_id, attempt_id, span_id, trace_id, parent_span_id, name, start_ns, end_ns, body,"
            " sequence_id, attempt_no FROM spans WHERE "
            + " AND ".join(where)
            + f" ORDER BY attempt_no{direction}, sequence_id{direction} LIMIT ?"
        )
        params.append(q.limit)
        return [SpanRecord(*row) for row in self._reader().execute(sql, params)]

    async def count_spans(self, query: SpanQuery) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._count_spans, query)

    def _count_spans(self, q: SpanQuery) -> int:
        where, params = self._span_filters(q)
        row = (
            self._reader()
            .execute("SELECT COUNT(*) FROM spans WHERE " + " AND ".join(where), params)
            .fetchone()
        )
        return int(row[0])

    @staticmethod
    def _span_filters(q: SpanQuery) -> tuple[list[str], list[Any]]:
        return rows.span_filters(q, mark="?", contains="instr(name, ?) > 0")

    def storage_bytes(self) -> int:
        """The database file and its write-ahead log and shared-memory files, as they are now."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += (self.path.parent / (self.path.name + suffix)).stat().st_size
            except OSError:
                continue
        return total

    def load_span_ids(self, rollout_id: str, attempt_no: int) -> dict[str, int]:
        assert self._index_conn is not None
        cur = self._index_conn.execute(
            "SELECT span_id, sequence_id FROM spans WHERE rollout_id = ? AND attempt_no = ?",
            (rollout_id, attempt_no),
        )
        return dict(cur.fetchall())

    async def close(self) -> None:
        if self._writer is not None:
            self._closing.set()  # a batch waiting for space gives up: its writes were never acknowledged
            self._wake.set()
            self._queue.put(None)
            await asyncio.get_running_loop().run_in_executor(None, self._writer.join)
            self._writer = None
        self._readers.shutdown(wait=True)
        if self._index_conn is not None:
            self._index_conn.close()
            self._index_conn = None
        log.info("event=sqlite_closed path=%s", self.path)
