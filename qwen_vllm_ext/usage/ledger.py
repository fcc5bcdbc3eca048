"""The usage ledger: one durable record per request, exact integer aggregates, group commit.

Pure Python (no vLLM import). Two stores with identical semantics:

* :class:`SqliteLedgerStore` -- the embedded default, one file in the data directory. WAL journal,
  ``synchronous=FULL``, a busy timeout; every process (``--api-server-count N``) opens its own connection
  to the same file. Table ``requests`` (one row per request id) and table ``daily`` (per API key id, UTC
  day of ``finished_at``, model) are updated in the same transaction.
* :class:`RedisLedgerStore` -- for several replicas: one Lua script per batch (atomic on the server, and
  written to the AOF as one MULTI/EXEC). ``SET qve:req:<id> <json> NX`` records a request id once; only
  when newly recorded it is added to the sorted set ``qve:by_finished`` (score ``finished_at``) and the
  integer aggregates are incremented with HINCRBY: ``qve:daily:<day>:<key>:<model>`` and
  ``qve:totals:<instance_id>``. Money is integer micro-units everywhere (never INCRBYFLOAT).

Both stores are idempotent: writing a request id that is already present changes nothing, so retries and
spill replays never double count.

:class:`LedgerWriter` keeps writes off the caller's path: :meth:`LedgerWriter.submit` is O(1) and returns a
:class:`concurrent.futures.Future`; a dedicated thread drains the queue and commits batches (group commit).

**Durability guarantee.** A record whose future resolved with a result (``True`` = newly recorded,
``False`` = that request id was already recorded) is durable: with SQLite it is committed in WAL mode with
``synchronous=FULL`` (fsynced before the commit returns), so it survives ``kill -9`` of any process and a
power loss; with Redis the server acknowledged the script, so it is durable as far as the server's
``appendfsync`` setting says (``always``: on disk before the reply). A record whose future has not resolved
may be lost by a crash -- do not acknowledge it to anyone.

**Failures.** A batch that fails is retried with exponential backoff (``retries`` times) when the error is
transient (Redis connection/timeout, SQLite "database is locked", OS errors). If it still fails, the records
are appended to the local spill file ``<spill_dir>/ledger-spill-<pid>.jsonl`` (fsynced) and their futures
fail with :class:`LedgerWriteError` (``.spilled_to`` names the file, or is ``None`` if even the spill
failed). Records are never dropped silently: the writer replays its own spill file as soon as the store takes a
batch again (or, idle, every ``replay_interval_s``), and :meth:`LedgerWriter.replay_spill` at startup (each
process may; files are claimed by rename) re-submits what a dead process spilled; thanks to idempotency a record
that did reach the store before the failure is not counted twice.
"""
from __future__ import annotations

import atexit
import calendar
import collections
import concurrent.futures
import dataclasses
import glob
import json
import logging
import math
import os
import queue
import sqlite3
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from ..store.redis import connect
from ..store.sqlite import Database, apply_schema

log = logging.getLogger(__name__)

STATUSES = ("stop", "length", "client_disconnected", "aborted", "error")
PROBE_PREFIX = "qwen-doctor-"
"""Request ids (``x-request-id``) of health probes: see :attr:`LedgerRecord.probe`."""
MICRO = 1_000_000
_INT_FIELDS = ("http_status", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
               "engine_prompt_tokens", "billed_prompt_micro", "billed_completion_micro", "cost_pico_usd")
_MAX_INT = 2**63 - 1
# Aggregates kept per (api key, UTC day, model) and reported by ``report``.
DAILY_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "billed_micro", "cost_pico_usd")
TOTAL_FIELDS = ("requests", "prompt_tokens", "engine_prompt_tokens", "cached_tokens", "completion_tokens",
                "reasoning_tokens", "billed_micro", "cost_pico_usd")
REPORT_BY = {"key": "api_key_id", "model": "model", "day": "day", "instance": "instance_id"}
# ``instance`` (the replica, for a fleet sharing one Redis ledger) is not in the daily aggregates: read off records.


class LedgerUnavailable(RuntimeError):
    """The ledger store cannot be opened or reached."""


class LedgerWriteError(RuntimeError):
    """A batch could not be committed after retries; ``spilled_to`` is the spill file (None if spill failed)."""

    def __init__(self, message: str, spilled_to: str | None):
        super().__init__(message)
        self.spilled_to = spilled_to


def utc_day(ts: float) -> str:
    """``YYYY-MM-DD`` (UTC) of a unix timestamp."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def _day_start(day: str) -> float:
    return float(calendar.timegm(time.strptime(day, "%Y-%m-%d")))


def billed_prompt_tokens(prompt_tokens: int, engine_prompt_tokens: int) -> int:
    """The prompt tokens billed and charged: usage's count (each prompt once), only when the engine computed the
    prompt (a request aborted before prefill is not billed for it)."""
    return prompt_tokens if engine_prompt_tokens else 0


@dataclasses.dataclass
class LedgerRecord:
    """One request as the ledger records it. Billed figures are integer micro-units (units x 10^6); the cost is
    integer pico-dollars (USD x 10^12: exact for the provider's prices, ``qwen_v3_calculator.billing.Prices``)."""

    request_id: str
    instance_id: str
    model: str
    endpoint: str
    status: str
    http_status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    engine_prompt_tokens: int
    billed_prompt_micro: int
    billed_completion_micro: int
    received_at: float
    finished_at: float
    ttft_s: float | None
    latency_s: float
    streamed: bool
    api_key_id: str | None = None
    conversation_id: str | None = None  # x-session-id / x-conversation-id header or the `user` field (KV reuse)
    reuse_ratio: float | None = None  # cached tokens / previous turn's prompt + completion of the conversation
    cost_pico_usd: int = 0  # usage x the provider's prices (settings price_*), pico-dollars; 0 without prices

    def __post_init__(self) -> None:
        self.validate()

    @property
    def usage_tokens(self) -> int:
        """Prompt + completion tokens as usage and billing count them: each prompt once (also with ``n`` > 1
        parallel samples), and only when the engine computed it; every sample's generated tokens. The gateway
        charges exactly this against TPM."""
        return billed_prompt_tokens(self.prompt_tokens, self.engine_prompt_tokens) + self.completion_tokens

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (also run by the stores before writing)."""
        for name in ("request_id", "instance_id", "model", "endpoint"):
            value = getattr(self, name)
            if not isinstance(value, str) or (name == "request_id" and not value):
                raise ValueError(f"LedgerRecord.{name} must be a{' non-empty' if name == 'request_id' else ''} "
                                 f"string, got {value!r}")
        if self.status not in STATUSES:
            raise ValueError(f"LedgerRecord.status must be one of {STATUSES}, got {self.status!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
                raise ValueError(f"LedgerRecord.{name} must be a non-negative integer, got {value!r}")
        for name in ("received_at", "finished_at", "ttft_s", "latency_s"):
            value = getattr(self, name)
            if value is None and name == "ttft_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"LedgerRecord.{name} must be a non-negative number, got {value!r}")
            setattr(self, name, float(value))
        if not isinstance(self.streamed, bool):
            raise ValueError(f"LedgerRecord.streamed must be a bool, got {self.streamed!r}")
        if self.api_key_id is not None and not isinstance(self.api_key_id, str):
            raise ValueError(f"LedgerRecord.api_key_id must be a string or None, got {self.api_key_id!r}")
        if self.conversation_id is not None and not isinstance(self.conversation_id, str):
            raise ValueError(f"LedgerRecord.conversation_id must be a string or None, got {self.conversation_id!r}")
        if self.reuse_ratio is not None:
            if isinstance(self.reuse_ratio, bool) or not isinstance(self.reuse_ratio, (int, float)) \
                    or not math.isfinite(self.reuse_ratio) or self.reuse_ratio < 0:
                raise ValueError(f"LedgerRecord.reuse_ratio must be a non-negative number or None, "
                                 f"got {self.reuse_ratio!r}")
            self.reuse_ratio = float(self.reuse_ratio)

    @property
    def probe(self) -> bool:
        """A health probe (``python -m qwen_vllm_ext.doctor``): recorded and in the instance totals (the engine did the
        work), but not in the daily aggregates nor, by default, in reports."""
        return self.request_id.startswith(PROBE_PREFIX)

    @property
    def billed_total_micro(self) -> int:
        return self.billed_prompt_micro + self.billed_completion_micro

    @property
    def day(self) -> str:
        """UTC day of ``finished_at``: the ``daily`` aggregate this record counts in."""
        return utc_day(self.finished_at)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LedgerRecord":
        """Inverse of :meth:`to_dict`; unknown keys are ignored (forward compatibility)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _empty_totals() -> dict[str, Any]:
    return {**{f: 0 for f in TOTAL_FIELDS}, "by_status": {s: 0 for s in STATUSES}}


def _totals_of(records: Iterable[LedgerRecord]) -> dict[str, Any]:
    out = _empty_totals()
    for r in records:
        out["requests"] += 1
        for f in TOTAL_FIELDS[1:-2]:
            out[f] += getattr(r, f)
        out["billed_micro"] += r.billed_total_micro
        out["cost_pico_usd"] += r.cost_pico_usd
        out["by_status"][r.status] += 1
    return out


def _report_rows(by: str, groups: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    return [{by: k, **{f: v[f] for f in DAILY_FIELDS}} for k, v in sorted(groups.items())]


def _report_from_records(by: str, records: Iterable[LedgerRecord]) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, int]] = {}
    for r in records:
        k = {"key": r.api_key_id or "", "model": r.model, "day": r.day, "instance": r.instance_id}[by]
        g = groups.setdefault(k, dict.fromkeys(DAILY_FIELDS, 0))
        g["requests"] += 1
        g["prompt_tokens"] += r.prompt_tokens
        g["cached_tokens"] += r.cached_tokens
        g["completion_tokens"] += r.completion_tokens
        g["billed_micro"] += r.billed_total_micro
        g["cost_pico_usd"] += r.cost_pico_usd
    return _report_rows(by, groups)


def _report_from_daily(by: str, daily_rows: Iterable[dict[str, Any]], since: float | None,
                       until: float | None) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, int]] = {}
    for row in daily_rows:
        start = _day_start(row["day"])
        if (since is not None and start < since) or (until is not None and start >= until):
            continue
        g = groups.setdefault(row[REPORT_BY[by]], dict.fromkeys(DAILY_FIELDS, 0))
        for f in DAILY_FIELDS:
            g[f] += int(row.get(f) or 0)  # rows written before a field existed lack it
    return _report_rows(by, groups)


def _midnight(ts: float | None) -> bool:
    return ts is None or ts % 86400 == 0


def _from_daily(by: str, since: float | None, until: float | None) -> bool:
    """Whether the exact daily aggregates answer this report (whole UTC days, grouped by a daily column)."""
    return by != "instance" and _midnight(since) and _midnight(until)


def _check_by(by: str) -> None:
    if by not in REPORT_BY:
        raise ValueError(f"report by must be one of {sorted(REPORT_BY)}, got {by!r}")


@runtime_checkable
class LedgerStore(Protocol):
    """What every ledger backend provides (identical semantics). Time ranges: ``since <= finished_at < until``."""

    url: str
    default_spill_dir: str | None

    def write_batch(self, records: list[LedgerRecord]) -> int:
        """Record a batch atomically (all or nothing); returns the number newly recorded. A request id
        already present (also earlier in the same batch) is ignored: nothing changes, nothing double counts."""

    def write_batch_flags(self, records: list[LedgerRecord]) -> list[bool]:
        """Like :meth:`write_batch`, one flag per record: True if newly recorded, False if already present."""

    def get(self, request_id: str) -> LedgerRecord | None: ...

    def records(self, since: float | None = None, until: float | None = None,
                instance_id: str | None = None) -> list[LedgerRecord]:
        """Records ordered by (finished_at, request_id)."""

    def totals(self, instance_id: str | None = None, since: float | None = None) -> dict[str, Any]:
        """``requests``, token sums, ``billed_micro`` and ``by_status`` (every status, 0 included)."""

    def instance_tokens(self, instance_id: str) -> dict[str, int]:
        """``engine_prompt_tokens`` and ``completion_tokens`` summed over one instance's records (what vLLM's counters
        of that server count): cheap enough for every metrics scrape."""

    def report(self, by: str = "key", since: float | None = None, until: float | None = None,
               include_probes: bool = False) -> list[dict]:
        """One row per key/model/day: ``{by: value, requests, prompt_tokens, cached_tokens,
        completion_tokens, billed_micro}`` sorted by value (key '' = no API key); health probes left out unless
        ``include_probes``."""

    def daily(self, api_key_id: str | None, day: str) -> dict[str, int]:
        """The exact per-(key, day) aggregate summed over models (zeros when absent)."""

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------- SQLite
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


class SqliteLedgerStore:
    """The embedded ledger: one SQLite file, safe with several processes (each opens its own store)."""

    transient_errors: tuple[type[BaseException], ...] = (sqlite3.OperationalError, OSError)

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
    def _where(since: float | None, until: float | None, instance_id: str | None) -> tuple[str, list]:
        conds, args = [], []
        for cond, value in (("finished_at >= ?", since), ("finished_at < ?", until),
                            ("instance_id = ?", instance_id)):
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

    def report(self, by="key", since=None, until=None, include_probes=False) -> list[dict[str, Any]]:
        _check_by(by)
        if _from_daily(by, since, until) and not include_probes:
            return _report_from_daily(by, self._daily_rows(), since, until)
        return _report_from_records(by, (r for r in self.records(since, until) if include_probes or not r.probe))

    def daily(self, api_key_id, day) -> dict[str, int]:
        rows = self._query(f"SELECT {', '.join('SUM(%s)' % f for f in DAILY_FIELDS)} FROM daily "
                           "WHERE api_key_id = ? AND day = ?", (api_key_id or "", day))
        return {f: int(v or 0) for f, v in zip(DAILY_FIELDS, rows[0])}

    def close(self) -> None:
        self._sql.close()


# ------------------------------------------------------------------------------------------------ Redis
# ARGV: prefix, then per record: id, json, finished_at, instance, api_key ('' = none), day, model, status,
# daily hash name (``qve:daily:<day>:<key>:<model>``, ':' and '%' in key/model percent-encoded), prompt,
# engine_prompt, cached, completion, reasoning, billed_micro, cost_pico_usd. Returns one 0/1 per record.
# The shebang makes Redis check OOM before the script starts, so a batch is applied entirely or not at all.
_LUA = """#!lua
local p = ARGV[1]
local out = {}
for i = 2, #ARGV, 16 do
  local id = ARGV[i]
  if redis.call('SET', p .. 'req:' .. id, ARGV[i + 1], 'NX') then
    local inst, key, day, model, status = ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
    local d, prompt, engine, cached, compl, reason, billed, cost =
      ARGV[i + 8], ARGV[i + 9], ARGV[i + 10], ARGV[i + 11], ARGV[i + 12], ARGV[i + 13], ARGV[i + 14], ARGV[i + 15]
    redis.call('ZADD', p .. 'by_finished', ARGV[i + 2], id)
    if d ~= '' then  -- '' for health probes: not in the daily aggregates
      redis.call('HSET', d, 'api_key_id', key, 'day', day, 'model', model)
      redis.call('HINCRBY', d, 'requests', 1)
      redis.call('HINCRBY', d, 'prompt_tokens', prompt)
      redis.call('HINCRBY', d, 'cached_tokens', cached)
      redis.call('HINCRBY', d, 'completion_tokens', compl)
      redis.call('HINCRBY', d, 'billed_micro', billed)
      redis.call('HINCRBY', d, 'cost_pico_usd', cost)
      redis.call('SADD', p .. 'dailies', d)
    end
    local t = p .. 'totals:' .. inst
    redis.call('HINCRBY', t, 'requests', 1)
    redis.call('HINCRBY', t, 'prompt_tokens', prompt)
    redis.call('HINCRBY', t, 'engine_prompt_tokens', engine)
    redis.call('HINCRBY', t, 'cached_tokens', cached)
    redis.call('HINCRBY', t, 'completion_tokens', compl)
    redis.call('HINCRBY', t, 'reasoning_tokens', reason)
    redis.call('HINCRBY', t, 'billed_micro', billed)
    redis.call('HINCRBY', t, 'cost_pico_usd', cost)
    redis.call('HINCRBY', t, 'status:' .. status, 1)
    redis.call('SADD', p .. 'instances', inst)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""


class RedisLedgerStore:
    """The shared ledger on a (single, non-cluster) Redis server; several replicas may write concurrently."""

    def __init__(self, url: str, prefix: str = "qve:", socket_timeout_s: float = 10.0):
        import redis

        self.url, self.prefix, self.default_spill_dir = url, prefix, None
        self.transient_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                                 redis.exceptions.BusyLoadingError, OSError)
        # Retries are the LedgerWriter's job (with backoff and spill): the client itself tries once.
        self._r = connect(url, LedgerUnavailable, "ledger", socket_timeout_s)
        self._script = self._r.register_script(_LUA)

    def write_batch(self, records: list[LedgerRecord]) -> int:
        return sum(self.write_batch_flags(records))

    def _daily_key(self, r: LedgerRecord) -> str:
        esc = lambda s: s.replace("%", "%25").replace(":", "%3A")   # noqa: E731  keep the key unambiguous
        return f"{self.prefix}daily:{r.day}:{esc(r.api_key_id or '')}:{esc(r.model)}"

    def write_batch_flags(self, records: list[LedgerRecord]) -> list[bool]:
        args: list[Any] = [self.prefix]
        for r in records:
            r.validate()
            args += [r.request_id, json.dumps(r.to_dict(), separators=(",", ":")), repr(r.finished_at),
                     r.instance_id, r.api_key_id or "", r.day, r.model, r.status,
                     "" if r.probe else self._daily_key(r),
                     r.prompt_tokens, r.engine_prompt_tokens, r.cached_tokens, r.completion_tokens, r.reasoning_tokens,
                     r.billed_total_micro, r.cost_pico_usd]
        if not records:
            return []
        return [bool(x) for x in self._script(args=args)]

    def get(self, request_id: str) -> LedgerRecord | None:
        blob = self._r.get(self.prefix + "req:" + request_id)
        return LedgerRecord.from_dict(json.loads(blob)) if blob else None

    def records(self, since=None, until=None, instance_id=None) -> list[LedgerRecord]:
        lo = "-inf" if since is None else repr(float(since))
        hi = "+inf" if until is None else "(" + repr(float(until))
        ids = self._r.zrangebyscore(self.prefix + "by_finished", lo, hi)
        out = []
        for i in range(0, len(ids), 1000):
            for blob in self._r.mget([self.prefix + "req:" + x for x in ids[i:i + 1000]]):
                if blob:
                    rec = LedgerRecord.from_dict(json.loads(blob))
                    if instance_id is None or rec.instance_id == instance_id:
                        out.append(rec)
        return out

    def totals(self, instance_id=None, since=None) -> dict[str, Any]:
        if since is not None:
            return _totals_of(self.records(since=since, instance_id=instance_id))
        instances = [instance_id] if instance_id is not None else sorted(self._r.smembers(self.prefix + "instances"))
        out = _empty_totals()
        for inst in instances:
            for field, value in self._r.hgetall(self.prefix + "totals:" + inst).items():
                if field.startswith("status:"):
                    out["by_status"][field[7:]] = out["by_status"].get(field[7:], 0) + int(value)
                else:
                    out[field] += int(value)
        return out

    def instance_tokens(self, instance_id: str) -> dict[str, int]:
        prompt, completion = self._r.hmget(self.prefix + "totals:" + instance_id, "engine_prompt_tokens",
                                           "completion_tokens")
        return {"engine_prompt_tokens": int(prompt or 0), "completion_tokens": int(completion or 0)}

    def _daily_rows(self) -> list[dict[str, Any]]:
        pipe = self._r.pipeline(transaction=False)
        for key in self._r.smembers(self.prefix + "dailies"):
            pipe.hgetall(key)
        return [row for row in pipe.execute() if row]

    def report(self, by="key", since=None, until=None, include_probes=False) -> list[dict[str, Any]]:
        _check_by(by)
        if _from_daily(by, since, until) and not include_probes:
            return _report_from_daily(by, self._daily_rows(), since, until)
        return _report_from_records(by, (r for r in self.records(since, until) if include_probes or not r.probe))

    def daily(self, api_key_id, day) -> dict[str, int]:
        out = dict.fromkeys(DAILY_FIELDS, 0)
        for row in self._daily_rows():
            if row["api_key_id"] == (api_key_id or "") and row["day"] == day:
                for f in DAILY_FIELDS:
                    out[f] += int(row.get(f) or 0)
        return out

    def close(self) -> None:
        self._r.close()


def open_store(backend: str, path_or_url: str) -> SqliteLedgerStore | RedisLedgerStore:
    """Open the ``sqlite`` (file path) or ``redis`` (URL) store; raises :class:`LedgerUnavailable`."""
    if backend == "sqlite":
        return SqliteLedgerStore(path_or_url)
    if backend == "redis":
        if not path_or_url:
            raise LedgerUnavailable("the Redis ledger backend needs a URL (setting ledger_redis_url)")
        return RedisLedgerStore(path_or_url)
    raise ValueError(f"unknown ledger backend {backend!r}; expected 'sqlite' or 'redis'")


# ----------------------------------------------------------------------------------------------- writer
_STOP = object()


class LedgerWriter:
    """Group-committing writer thread in front of a store. See the module docstring for the guarantee.

    Metrics: ``last_batch_latency_s``, ``last_batch_size``, ``batches_total``, ``committed_total`` (newly
    recorded), ``duplicates_total``, ``committed_by_status`` (status -> newly recorded count),
    ``failed_total``, ``spilled_total``, ``replayed_total`` (spilled records the store took later), each also reported
    as it grows to ``on_count(name, n)`` (name: "failed", "spilled" or "replayed");
    ``on_batch(latency_s, newly_recorded_records)`` is called from the writer thread after every committed batch,
    ``on_failure(error)`` after every batch the store failed to take (exceptions in callbacks are logged, never
    raised). A batch whose reply was lost (Redis connection dropped after the server ran it) is retried and then reports those
    records as duplicates (future result False): they are recorded exactly once all the same.
    Futures' done-callbacks run on the writer thread: keep them short (asyncio callers: ``asyncio.wrap_future``).
    """

    def __init__(self, store: LedgerStore, batch_max: int = 256, linger_s: float = 0.005,
                 spill_dir: str | None = None, retries: int = 4, backoff_s: float = 0.05,
                 on_batch: Callable[[float, list[LedgerRecord]], None] | None = None,
                 replay_interval_s: float = 5.0,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_count: Callable[[str, int], None] | None = None):
        self.store, self.batch_max, self.linger_s = store, batch_max, linger_s
        self.replay_interval_s = replay_interval_s
        self._spill_pending = False  # this process spilled records it has not replayed yet
        self.retries, self.backoff_s, self.on_batch, self.on_failure = retries, backoff_s, on_batch, on_failure
        if spill_dir is None:
            spill_dir = getattr(store, "default_spill_dir", None)
        if spill_dir is None:  # a Redis store has no directory of its own: the caller passes data_dir
            raise TypeError("LedgerWriter needs spill_dir for a store without a default (Redis): pass data_dir")
        self.spill_dir = spill_dir
        self.last_batch_latency_s = 0.0
        self.last_batch_size = self.batches_total = self.committed_total = self.duplicates_total = 0
        self.failed_total = self.spilled_total = self.replayed_total = 0
        self.on_count = on_count
        self.committed_by_status: collections.Counter[str] = collections.Counter()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = self._done = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="qve-ledger-writer", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        self._atexit = lambda: (w := ref()) is not None and w.close(timeout=10.0)
        atexit.register(self._atexit)

    @property
    def spill_path(self) -> str:
        return os.path.join(self.spill_dir, f"ledger-spill-{os.getpid()}.jsonl")

    def submit(self, record: LedgerRecord) -> concurrent.futures.Future:
        """Queue a record (O(1), never blocks); the future resolves once it is durable (see module doc)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("LedgerWriter is closed")
            self._submitted += 1
        self._q.put((record, fut))
        return fut

    def queue_depth(self) -> int:
        """Records submitted but not yet committed (or failed)."""
        return self._submitted - self._done

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is committed or failed (spilled); False on timeout.

        Never call it (nor :meth:`close`, :meth:`replay_spill`) from a future's done-callback: those run
        on the writer thread."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then stop the thread. Idempotent. False if the flush timed out."""
        with self._cond:
            already, self._closed = self._closed, True
        ok = self.flush(timeout)
        if not already:
            self._q.put(_STOP)
            self._thread.join(timeout)
            atexit.unregister(self._atexit)
        return ok

    # -- writer thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=self.replay_interval_s if self._spill_pending else None)
            except queue.Empty:            # idle with records spilled: try the store again
                self._replay_own_spill()
                continue
            if item is _STOP:
                return
            batch, stop = [item], False
            deadline = time.monotonic() + self.linger_s
            while len(batch) < self.batch_max:
                try:
                    nxt = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            committed = False
            try:
                committed = self._commit(batch)
            except BaseException:          # never let the thread die with futures pending
                log.exception("ledger writer: unexpected error")
                for _, fut in batch:
                    _resolve(fut, exc=RuntimeError("ledger writer failed unexpectedly"))
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()
            if stop:
                return
            if committed and self._spill_pending:  # the store is back: replay what this process spilled
                self._replay_own_spill()

    def _replay_own_spill(self) -> None:
        """On the writer thread: commit this process's spill file (claimed by rename first, so a concurrent
        startup replay cannot take it too). Records that fail again are spilled again; none is dropped."""
        self._spill_pending = False
        path = self.spill_path
        claimed = f"{path[:-6]}.claimed-{os.getpid()}-{time.monotonic_ns()}.jsonl"
        try:
            os.rename(path, claimed)
        except FileNotFoundError:
            return
        records = _read_jsonl(claimed)
        replayed = 0
        for i in range(0, len(records), self.batch_max):
            chunk = [(r, concurrent.futures.Future()) for r in records[i:i + self.batch_max]]
            if self._commit(chunk):
                replayed += len(chunk)
        self._count("replayed", replayed)
        os.unlink(claimed)
        log.warning("ledger: the store is reachable again; replayed %d of %d spilled record(s)%s", replayed,
                    len(records), "" if replayed == len(records) else f" (the rest spilled again to {path})")

    def _commit(self, batch: list[tuple[LedgerRecord, concurrent.futures.Future]]) -> bool:
        """Write a batch (retries with backoff, then spill); True when the store took it."""
        valid = []
        for record, fut in batch:          # a record that can never be written fails alone, unspilled
            try:
                record.validate()
                valid.append((record, fut))
            except (ValueError, AttributeError) as exc:
                self._count("failed", 1)
                _resolve(fut, exc=exc if isinstance(exc, ValueError) else ValueError(str(exc)))
        if not valid:
            return False
        batch, records = valid, [r for r, _ in valid]
        transient = getattr(self.store, "transient_errors", (OSError,))
        for attempt in range(self.retries + 1):
            t0 = time.monotonic()
            try:
                results = self.store.write_batch_flags(records)
            except transient as exc:
                error: BaseException = exc
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
            except Exception as exc:       # not transient (e.g. a bug): no retry, but spill all the same
                error = exc
            else:
                self._committed(time.monotonic() - t0, batch, results)
                return True
            break
        self._fail(batch, error)
        return False

    def _count(self, name: str, n: int) -> None:
        if n <= 0:
            return
        setattr(self, f"{name}_total", getattr(self, f"{name}_total") + n)
        if self.on_count is not None:
            try:
                self.on_count(name, n)
            except Exception:
                log.exception("ledger writer: on_count callback failed")

    def _committed(self, latency: float, batch, results: list[bool]) -> None:
        self.last_batch_latency_s, self.last_batch_size = latency, len(batch)
        self.batches_total += 1
        new = [r for (r, _), n in zip(batch, results) if n]
        self.committed_total += len(new)
        self.duplicates_total += len(batch) - len(new)
        self.committed_by_status.update(r.status for r in new)
        if self.on_batch is not None:
            try:
                self.on_batch(latency, new)
            except Exception:
                log.exception("ledger writer: on_batch callback failed")
        for (_, fut), n in zip(batch, results):
            _resolve(fut, result=n)

    def _fail(self, batch, error: BaseException) -> None:
        records = [r for r, _ in batch]
        self._count("failed", len(batch))
        if self.on_failure is not None:
            try:
                self.on_failure(error)
            except Exception:
                log.exception("ledger writer: on_failure callback failed")
        path: str | None = self.spill_path
        try:
            _append_jsonl(path, records)
            self._count("spilled", len(batch))
            self._spill_pending = True
            log.error("ledger: %d record(s) could not be written to %s (%s); spilled to %s -- replayed when the "
                      "store answers again (or at the next start)", len(batch), getattr(self.store, "url", "?"),
                      error, path)
        except OSError as spill_exc:
            log.critical("ledger: %d record(s) could not be written (%s) NOR spilled to %s (%s): %s",
                         len(batch), error, path, spill_exc, [r.to_dict() for r in records])
            path = None
        exc = LedgerWriteError(f"ledger write failed ({type(error).__name__}: {error}); "
                               + (f"spilled to {path}" if path else "spill failed too"), path)
        exc.__cause__ = error
        for _, fut in batch:
            _resolve(fut, exc=exc)

    def replay_spill(self, timeout: float | None = 60.0) -> int:
        """Re-submit every record of ``<spill_dir>/ledger-spill-*.jsonl`` (any pid: call it at startup).

        Each file is first claimed by an atomic rename (so concurrent processes never replay the same file
        twice) and deleted once all its records are committed; a record that fails again is spilled again.
        Returns the number of records newly recorded (records already in the store are skipped).
        """
        newly = 0
        for path in sorted(glob.glob(os.path.join(self.spill_dir, "ledger-spill-*.jsonl"))):
            claimed = f"{path[:-6]}.claimed-{os.getpid()}-{time.monotonic_ns()}.jsonl"
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                continue                   # another process claimed it
            futures = [self.submit(r) for r in _read_jsonl(claimed)]
            done, pending = concurrent.futures.wait(futures, timeout)
            ok = not pending and all(f.exception() is None for f in done)
            newly += sum(1 for f in done if f.exception() is None and f.result())
            self._count("replayed", sum(1 for f in done if f.exception() is None))
            if ok:
                os.unlink(claimed)
            else:
                log.error("ledger: replay of %s incomplete; the file is kept for the next replay", claimed)
        return newly


def _resolve(fut: concurrent.futures.Future, result: Any = None, exc: BaseException | None = None) -> None:
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except concurrent.futures.InvalidStateError:   # cancelled by the caller: the record is still handled
        pass


def _append_jsonl(path: str, records: list[LedgerRecord]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    new = not os.path.exists(path)
    data = "".join(json.dumps(r.to_dict(), separators=(",", ":")) + "\n" for r in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:                                        # make the new directory entry durable too
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _read_jsonl(path: str) -> list[LedgerRecord]:
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            try:
                out.append(LedgerRecord.from_dict(json.loads(line)))
            except (ValueError, TypeError) as exc:  # a torn last line after a crash mid-spill
                log.warning("ledger: skipping unreadable line %d of %s: %s", n, path, exc)
    return out
