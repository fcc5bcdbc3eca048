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

**Records that can never be written** -- they fail :meth:`LedgerRecord.validate` (e.g. a lone surrogate or a NUL in
a string), or the store refuses them with a non-transient error while it takes the rest of their batch (the writer
splits a refused batch in halves to find them) -- are appended with the reason to the dead-letter file
``<spill_dir>/ledger-deadletter-<pid>.jsonl`` (fsynced, ASCII JSON) and their futures fail with
:class:`LedgerDeadLettered` (a :class:`LedgerWriteError` whose ``spilled_to`` is that file); they are not retried,
and a spill replay sends such records there instead of spilling them again.

**The writer cannot die of an error**: every step of its thread is guarded (errors are logged and counted); if
the thread ends all the same, :attr:`LedgerWriter.alive` is False and ``submit`` spills synchronously.
:meth:`LedgerWriter.close` is bounded (5 s by default, also at interpreter exit): what is not committed by then
is spilled for the next start.
"""
from __future__ import annotations

from .record import (DAILY_FIELDS, MICRO, PROBE_PREFIX, REPORT_BY, STATUSES, TOTAL_FIELDS, LedgerDeadLettered,
                     LedgerRecord, LedgerUnavailable, LedgerWriteError, billed_prompt_tokens, utc_day)
from .redis import RedisLedgerStore
from .report import LedgerStore
from .sqlite import SqliteLedgerStore
from .writer import LedgerWriter


def open_store(backend: str, path_or_url: str) -> SqliteLedgerStore | RedisLedgerStore:
    """Open the ``sqlite`` (file path) or ``redis`` (URL) store; raises :class:`LedgerUnavailable`."""
    if backend == "sqlite":
        return SqliteLedgerStore(path_or_url)
    if backend == "redis":
        if not path_or_url:
            raise LedgerUnavailable("the Redis ledger backend needs a URL (setting ledger_redis_url)")
        return RedisLedgerStore(path_or_url)
    raise ValueError(f"unknown ledger backend {backend!r}; expected 'sqlite' or 'redis'")


__all__ = ["DAILY_FIELDS", "MICRO", "PROBE_PREFIX", "REPORT_BY", "STATUSES", "TOTAL_FIELDS", "LedgerDeadLettered",
           "LedgerRecord", "LedgerStore", "LedgerUnavailable", "LedgerWriteError", "LedgerWriter", "RedisLedgerStore",
           "SqliteLedgerStore", "billed_prompt_tokens", "open_store", "utc_day"]
