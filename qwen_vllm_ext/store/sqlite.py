"""SQLite for every store of the extension (ledger, keys, limiter): one connection set-up, one transaction.

Each store opens its own :class:`Database` on its file; several processes share a file through SQLite's WAL
and its write lock. A :class:`Database`:

* connects with ``isolation_level=None`` (transactions are issued explicitly), a busy timeout, WAL (the switch
  retried while other connections make it) and the store's ``synchronous`` level (``FULL`` for the ledger and
  keys: a record acknowledged is on disk; ``NORMAL`` for limiter state, which may lose the last transactions in
  a power cut but never corrupts);
* serializes its users with a lock (one connection, any thread);
* reconnects after ``fork()``: a child never shares the parent's connection;
* runs every write as one ``BEGIN IMMEDIATE`` transaction (:meth:`transaction`), rolled back on any error.

``blocking=False`` makes a connection for calls made on an event loop: it never waits for the write lock
(``busy_timeout = 0``, a busy database raises at once) and never checkpoints the WAL.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

BUSY_CODES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def apply_schema(conn: sqlite3.Connection, schema: str) -> None:
    """Run the ``;``-separated statements of ``schema`` (tables, indexes) inside the caller's transaction."""
    for stmt in schema.split(";"):
        if stmt.strip():
            conn.execute(stmt)


def is_busy(exc: sqlite3.Error) -> bool:
    """The error says another connection holds the write lock (retry), not that the store failed."""
    return getattr(exc, "sqlite_errorcode", None) in BUSY_CODES


class Database:
    """One SQLite connection with the extension's pragmas, fork safety and transactions."""

    def __init__(self, path: str, *, synchronous: str = "FULL", busy_timeout_s: float = 30.0,
                 blocking: bool = True):
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = os.path.abspath(path)
        self.synchronous, self.busy_timeout_s, self.blocking = synchronous, busy_timeout_s, blocking
        self.lock = threading.Lock()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:  # a new file is the owner's alone (key hashes, usage); SQLite gives its -wal and -shm the same mode
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
        self._connect()

    def _connect(self) -> None:
        self.conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                    check_same_thread=False)
        self.conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        self._switch_to_wal()
        self.conn.execute(f"PRAGMA synchronous = {self.synchronous}")
        if not self.blocking:
            self.conn.execute("PRAGMA busy_timeout = 0")
            self.conn.execute("PRAGMA wal_autocheckpoint = 0")
        self._pid = os.getpid()

    def _switch_to_wal(self) -> None:
        """``PRAGMA journal_mode = WAL``, retried until the busy timeout. Connections that open a new file at once
        (API-server processes starting together) race to switch it, and SQLite answers the losers "database is
        locked" at once instead of calling their busy handler (waiting could deadlock), so the retry is ours."""
        deadline, pause = time.monotonic() + self.busy_timeout_s, 0.005
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if not is_busy(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def twin(self, *, blocking: bool) -> "Database":
        """Another connection to the same file with the same settings."""
        return Database(self.path, synchronous=self.synchronous, busy_timeout_s=self.busy_timeout_s,
                        blocking=blocking)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` under the lock (``ROLLBACK`` on any error); yields the connection."""
        with self.lock:
            if self._pid != os.getpid():  # forked: never share a connection with the parent
                self._connect()
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    def query(self, sql: str, args: Any = ()) -> list[tuple]:
        """A read outside any explicit transaction."""
        with self.lock:
            if self._pid != os.getpid():
                self._connect()
            return self.conn.execute(sql, tuple(args)).fetchall()

    def executescript(self, schema: str) -> None:
        """Create tables and indexes (statements separated by ``;``) in one transaction."""
        with self.transaction() as db:
            apply_schema(db, schema)

    def close(self) -> None:
        with self.lock:
            self.conn.close()
