"""The embedded ledger store: one SQLite file (WAL, ``synchronous=FULL``), tables ``requests`` and ``daily``."""
from __future__ import annotations

import dataclasses
import os
import sqlite3
from typing import Any, Iterable

from ...store.sqlite import Database, apply_schema
from .record import DAILY_FIELDS, PROBE_PREFIX, TOTAL_FIELDS, LedgerRecord, LedgerUnavailable
from .report import Reports, _check_limit, _empty_totals

_COLUMNS = [f.name for f in dataclasses.fields(LedgerRecord)]
_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, instance_id TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL,
    status TEXT NOT NULL, http_status INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
    engine_prompt_tokens INTEGER NOT NULL, billed_prompt_micro INTEGER NOT NULL,
    billed_completion_micro INTEGER NOT NULL, received_at REAL NOT NULL, finished_at REAL NOT NULL,
    ttft_s REAL, latency_s REAL NOT NULL, streamed INTEGER NOT NULL, api_key_id TEXT, conversation_id TEXT,
    reuse_ratio REAL, cost_pico_usd INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS requests_finished ON requests (finished_at);
CREATE INDEX IF NOT EXISTS requests_instance_tokens ON requests (instance_id, engine_prompt_tokens, completion_tokens);
CREATE TABLE IF NOT EXISTS daily (
    api_key_id TEXT NOT NULL, day TEXT NOT NULL, model TEXT NOT NULL, requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    billed_micro INTEGER NOT NULL, cost_pico_usd INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (api_key_id, day, model));
"""
_INSERT = (f"INSERT OR IGNORE INTO requests ({', '.join(_COLUMNS)}) "
           f"VALUES ({', '.join('?' * len(_COLUMNS))})")
_UPSERT_DAILY = """
INSERT INTO daily (api_key_id, day, model, requests, prompt_tokens, cached_tokens, completion_tokens, billed_micro,
    cost_pico_usd) VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?) ON CONFLICT (api_key_id, day, model) DO UPDATE SET
    requests = requests + 1, prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_tokens = cached_tokens + excluded.cached_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens,
    billed_micro = billed_micro + excluded.billed_micro, cost_pico_usd = cost_pico_usd + excluded.cost_pico_usd"""


# Columns added after the first release: (name, SQL type). A ledger file from before gets them (NULL for old rows).
_ADDED_COLUMNS = (("conversation_id", "TEXT"), ("reuse_ratio", "REAL"), ("cost_pico_usd", "INTEGER NOT NULL DEFAULT 0"))
_ADDED_DAILY_COLUMNS = (("cost_pico_usd", "INTEGER NOT NULL DEFAULT 0"),)


def _migrate(db: sqlite3.Connection) -> None:
    """Backward-compatible schema migration (inside the opening transaction): add missing columns."""
    present = {row[1] for row in db.execute("PRAGMA table_info(requests)")}
    for name, kind in _ADDED_COLUMNS:
        if name not in present:
            db.execute(f"ALTER TABLE requests ADD COLUMN {name} {kind}")
    present = {row[1] for row in db.execute("PRAGMA table_info(daily)")}
    for name, kind in _ADDED_DAILY_COLUMNS:
        if name not in present:
            db.execute(f"ALTER TABLE daily ADD COLUMN {name} {kind}")


def _row_to_record(row: sqlite3.Row | tuple) -> LedgerRecord:
    data = dict(zip(_COLUMNS, row))
    data["streamed"] = bool(data["streamed"])
    return LedgerRecord(**data)


class SqliteLedgerStore(Reports):
    """The embedded ledger: one SQLite file, safe with several processes (each opens its own store)."""

    transient_errors: tuple[type[BaseException], ...] = (sqlite3.OperationalError, OSError)
    # SQLite refuses the record itself (a value it cannot bind or store): LedgerWriter dead-letters it.
    record_errors: tuple[type[BaseException], ...] = (sqlite3.InterfaceError, sqlite3.DataError,
                                                      sqlite3.IntegrityError)

    def __init__(self, path: str, busy_timeout_s: float = 30.0):
        self.path = self.url = os.path.abspath(path)
        self.default_spill_dir = os.path.dirname(self.path)
        try:
            self._sql = Database(self.path, synchronous="FULL", busy_timeout_s=busy_timeout_s)
            with self._sql.transaction() as db:
                apply_schema(db, _SCHEMA)
                _migrate(db)
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(f"cannot open the SQLite ledger {self.path}: {exc}") from exc

    def write_batch(self, records: list[LedgerRecord]) -> int:
        return sum(self.write_batch_flags(records))

    def write_batch_flags(self, records: list[LedgerRecord]) -> list[bool]:
        for r in records:
            r.validate()
        out: list[bool] = []
        with self._sql.transaction() as db:
            for r in records:
                new = db.execute(_INSERT, [getattr(r, c) for c in _COLUMNS]).rowcount == 1
                if new and not r.probe:
                    db.execute(_UPSERT_DAILY, (r.api_key_id or "", r.day, r.model, r.prompt_tokens,
                                               r.cached_tokens, r.completion_tokens, r.billed_total_micro,
                                               r.cost_pico_usd))
                out.append(new)
        return out

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple]:
        return self._sql.query(sql, args)

    @staticmethod
    def _where(since: float | None, until: float | None, instance_id: str | None,
               *more: tuple[str, Any]) -> tuple[str, list]:
        """A WHERE clause of the window, the instance and ``more`` (condition, value) pairs; None values left out."""
        conds, args = [], []
        for cond, value in (("finished_at >= ?", since), ("finished_at < ?", until),
                            ("instance_id = ?", instance_id), *more):
            if value is not None:
                conds.append(cond)
                args.append(value)
        return (" WHERE " + " AND ".join(conds)) if conds else "", args

    def get(self, request_id: str) -> LedgerRecord | None:
        rows = self._query(f"SELECT {', '.join(_COLUMNS)} FROM requests WHERE request_id = ?", (request_id,))
        return _row_to_record(rows[0]) if rows else None

    def records(self, since=None, until=None, instance_id=None) -> list[LedgerRecord]:
        where, args = self._where(since, until, instance_id)
        rows = self._query(f"SELECT {', '.join(_COLUMNS)} FROM requests{where} "
                           f"ORDER BY finished_at, request_id", args)
        return [_row_to_record(r) for r in rows]

    def requests(self, since=None, until=None, api_key_id=None, model=None, limit=100,
                 include_probes=False) -> list[LedgerRecord]:
        _check_limit(limit)
        # Walks the finished_at index newest first and stops after `limit` matching rows.
        where, args = self._where(since, until, None, ("COALESCE(api_key_id, '') = ?", api_key_id),
                                  ("model = ?", model),
                                  (f"substr(request_id, 1, {len(PROBE_PREFIX)}) <> ?",
                                   None if include_probes else PROBE_PREFIX))
        rows = self._query(f"SELECT {', '.join(_COLUMNS)} FROM requests{where} "
                           f"ORDER BY finished_at DESC, request_id DESC LIMIT ?", [*args, limit])
        return [_row_to_record(r) for r in rows]

    def totals(self, instance_id=None, since=None) -> dict[str, Any]:
        where, args = self._where(since, None, instance_id)
        out = _empty_totals()
        for status, n, *sums in self._query(
                "SELECT status, COUNT(*), SUM(prompt_tokens), SUM(engine_prompt_tokens), SUM(cached_tokens), "
                "SUM(completion_tokens), SUM(reasoning_tokens), SUM(billed_prompt_micro + "
                f"billed_completion_micro), SUM(cost_pico_usd) FROM requests{where} GROUP BY status", args):
            out["by_status"][status] = n
            out["requests"] += n
            for f, v in zip(TOTAL_FIELDS[1:], sums):
                out[f] += v
        return out

    def instance_tokens(self, instance_id: str) -> dict[str, int]:
        (prompt, completion), = self._query(  # an index-only scan (requests_instance_tokens)
            "SELECT COALESCE(SUM(engine_prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) FROM requests "
            "WHERE instance_id = ?", (instance_id,))
        return {"engine_prompt_tokens": int(prompt), "completion_tokens": int(completion)}

    def _daily_rows(self) -> list[dict[str, Any]]:
        cols = ("api_key_id", "day", "model") + DAILY_FIELDS
        return [dict(zip(cols, row)) for row in self._query(f"SELECT {', '.join(cols)} FROM daily")]

    def daily(self, api_key_id, day) -> dict[str, int]:
        rows = self._query(f"SELECT {', '.join('SUM(%s)' % f for f in DAILY_FIELDS)} FROM daily "
                           "WHERE api_key_id = ? AND day = ?", (api_key_id or "", day))
        return {f: int(v or 0) for f, v in zip(DAILY_FIELDS, rows[0])}

    def close(self) -> None:
        self._sql.close()
