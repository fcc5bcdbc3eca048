"""The ledger writer: group commit on a thread, retries, spill files and their replay, the dead letter.

The writer thread cannot die of an error: every step of its loop (a batch, the replay of its spill file) is
guarded; an error is logged and counted (``errors_total``) and the loop goes on. Should the thread end all the same
(a ``BaseException`` escaping), :attr:`LedgerWriter.alive` turns False, :attr:`LedgerWriter.stopped_reason` says
why, everything still queued is spilled, and :meth:`LedgerWriter.submit` spills synchronously from then on: no
caller waits for a thread that is gone.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import glob
import json
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from .record import LedgerDeadLettered, LedgerRecord, LedgerWriteError
from .report import LedgerStore

log = logging.getLogger("qwen_vllm_ext.usage.ledger")

SPILL_GLOB = "ledger-spill-*.jsonl"
"""Spill files in ``spill_dir`` (claimed ones, ``…claimed-<pid>-<ns>.jsonl``, included): replayed at start."""
DEAD_LETTER_GLOB = "ledger-deadletter-*.jsonl"
"""Dead-letter files in ``spill_dir``: records that can never be written, one JSON object a line with the reason."""
CLOSE_TIMEOUT_S = 5.0
""":meth:`LedgerWriter.close`'s default bound (also at interpreter exit): what is not committed by then is spilled."""
SPILL_GROWING_S = 60.0
"""A writer that spilled within this many seconds reports its spill as growing (``/qwen_ext/health``: not ready)."""
_RECORD_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OverflowError)
"""Errors of a store that blame the record, not the store (with the store's own ``record_errors``)."""


class LedgerWriter:
    """Group-committing writer thread in front of a store. See the package docstring for the guarantee.

    Metrics: ``last_batch_latency_s``, ``last_batch_size``, ``batches_total``, ``committed_total`` (newly
    recorded), ``duplicates_total``, ``committed_by_status`` (status -> newly recorded count),
    ``failed_total`` (records not taken by the store: spilled or dead-lettered), ``spilled_total``,
    ``replayed_total`` (spilled records the store took later), ``dead_lettered_total`` (records that can never be
    written, kept in the dead-letter file), ``errors_total`` (unexpected errors the thread caught and survived), each
    also reported as it grows to ``on_count(name, n)`` (name: "failed", "spilled", "replayed", "dead_lettered",
    "errors"); ``on_batch(latency_s, newly_recorded_records)`` is called from the writer thread after every committed
    batch, ``on_failure(error)`` after every batch the store failed to take, ``on_stop(reason)`` once when the thread
    ends ("closed" after :meth:`close`; exceptions in callbacks are logged, never raised). A batch whose reply was lost
    (Redis connection dropped after the server ran it) is retried and then reports those records as duplicates
    (future result False): they are recorded exactly once all the same.

    A record that fails :meth:`LedgerRecord.validate`, or that the store refuses (a non-transient error) while it
    takes the rest of its batch (found by splitting the batch in halves), goes to the dead-letter file
    ``<spill_dir>/ledger-deadletter-<pid>.jsonl`` with the reason; its future fails with :class:`LedgerDeadLettered`
    and the rest of the batch is written. Futures' done-callbacks run on the writer thread: keep them short (asyncio
    callers: ``asyncio.wrap_future``).
    """

    def __init__(self, store: LedgerStore, batch_max: int = 256, linger_s: float = 0.005,
                 spill_dir: str | None = None, retries: int = 4, backoff_s: float = 0.05,
                 on_batch: Callable[[float, list[LedgerRecord]], None] | None = None,
                 replay_interval_s: float = 5.0,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_count: Callable[[str, int], None] | None = None,
                 on_stop: Callable[[str], None] | None = None):
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
        self.dead_lettered_total = self.errors_total = 0
        self.on_count, self.on_stop = on_count, on_stop
        self.committed_by_status: collections.Counter[str] = collections.Counter()
        self.stopped_reason: str | None = None
        """Why the writer thread ended (None while it runs): "closed", or the exception that ended it."""
        self.last_spill_at: float | None = None  # time.monotonic() of this writer's latest spill
        self._busy_since: float | None = None  # time.monotonic() when the store call in progress started
        self._inflight: list | None = None  # the batch the thread is gathering or writing (shared with close)
        self._claims: list[str] = []  # own spill files claimed for a replay that has not finished
        self._file_lock = threading.Lock()  # appends to the spill and dead-letter files
        # One lock for the queue, the batch in hand and the counts: a record is always either queued or in
        # ``_inflight`` (or resolved), so close() and the thread's end can take over every record not committed.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)       # _done moved (flush waits on it)
        self._has_items = threading.Condition(self._lock)  # a record was queued, or stop was asked
        self._items: collections.deque = collections.deque()
        self._submitted = self._done = 0
        self._closed = self._stopped = self._stop_asked = self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="qve-ledger-writer", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        self._atexit = lambda: (w := ref()) is not None and w.close(timeout=CLOSE_TIMEOUT_S)
        atexit.register(self._atexit)

    @property
    def spill_path(self) -> str:
        return os.path.join(self.spill_dir, f"ledger-spill-{os.getpid()}.jsonl")

    @property
    def dead_letter_path(self) -> str:
        return os.path.join(self.spill_dir, f"ledger-deadletter-{os.getpid()}.jsonl")

    @property
    def alive(self) -> bool:
        """The writer thread runs and takes records (False once closed, or if the thread ended)."""
        return not (self._closed or self._stopped) and self._thread.is_alive()

    def submit(self, record: LedgerRecord) -> concurrent.futures.Future:
        """Queue a record (O(1), never blocks); the future resolves once it is durable (see the package doc).

        If the writer thread has stopped, the record is spilled right here and the future is already failed with
        :class:`LedgerWriteError` (``spilled_to`` the spill file): callers never wait for a thread that is gone."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("LedgerWriter is closed")
            if not self._stopped:
                self._submitted += 1
                self._items.append((record, fut))
                self._has_items.notify()
                return fut
        self._fail([(record, fut)], RuntimeError(f"the ledger writer thread stopped ({self.stopped_reason})"),
                   store_failed=False)
        return fut

    def queue_depth(self) -> int:
        """Records submitted but not yet committed (or failed)."""
        return self._submitted - self._done

    def commit_running_s(self) -> float:
        """Seconds the store call in progress has taken so far (0 when none is)."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def status(self) -> dict[str, Any]:
        """This writer's state, for the health route."""
        since = self.last_spill_at
        age = None if since is None else round(time.monotonic() - since, 3)
        return {"writer_alive": self.alive, "stopped_reason": self.stopped_reason, "queue_depth": self.queue_depth(),
                "commit_running_s": round(self.commit_running_s(), 3), "spilled_total": self.spilled_total,
                "replayed_total": self.replayed_total, "dead_lettered_total": self.dead_lettered_total,
                "errors_total": self.errors_total, "last_spill_age_s": age,
                "spill_growing": age is not None and age < SPILL_GROWING_S}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is committed or failed (spilled); False on timeout.

        Never call it (nor :meth:`close`, :meth:`replay_spill`) from a future's done-callback: those run
        on the writer thread."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> bool:
        """Flush, then stop the thread, within ``timeout`` seconds in all. Idempotent. False if the flush timed out:
        then every record not committed yet (queued, or in the batch the store still holds) is spilled before it
        returns, so the next start replays it (a record the store takes after all is not counted twice)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            already, self._closed = self._closed, True
        ok = self.flush(timeout)
        if not already:
            with self._lock:
                self._stop_asked = True            # the thread stops once the queue is empty
                self._has_items.notify_all()
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            atexit.unregister(self._atexit)
        if not ok:
            self._spill_unfinished()
        return ok

    # -- writer thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        reason = "closed"
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - nothing in the loop raises; recorded, and callers are released
            reason = f"{type(exc).__name__}: {exc}"
            log.critical("ledger writer: the writer thread stopped (%s); records are spilled to %s from now on, "
                         "and /health fails: restart the server", reason, self.spill_path, exc_info=True)
        finally:
            self._thread_ended(reason)

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:                  # idle with records spilled: try the store again
                self._replay_guarded()
                continue
            with self._lock:
                taken_over = self._abandoned   # close() gave up waiting and spilled this batch itself
            committed = False
            if not taken_over:
                try:
                    committed = self._commit(batch)
                except Exception as exc:   # a bug in a step: the records still go to the spill file
                    self._error("writing a batch", exc)
                    self._fail([x for x in batch if not x[1].done()], exc)
            with self._lock:
                self._inflight = None
                self._done += len(batch)
                self._cond.notify_all()
            if committed and self._spill_pending:  # the store is back: replay what this process spilled
                self._replay_guarded()

    def _next_batch(self) -> list | None:
        """The next batch (up to ``batch_max`` records, gathered for ``linger_s``), ``[]`` when idle for
        ``replay_interval_s`` with records spilled, ``None`` once stop is asked and nothing is queued. The batch is
        ``_inflight`` from its first record on."""
        with self._lock:
            if not self._items and not self._stop_asked:
                self._has_items.wait(self.replay_interval_s if self._spill_pending else None)
            if not self._items:
                return None if self._stop_asked else []
            batch = self._inflight = [self._items.popleft()]
            deadline = time.monotonic() + self.linger_s
            while len(batch) < self.batch_max and not self._abandoned:
                if self._items:
                    batch.append(self._items.popleft())
                    continue
                remaining = deadline - time.monotonic()
                if self._stop_asked or remaining <= 0:
                    break
                self._has_items.wait(remaining)
            return batch

    def _take_over(self) -> tuple[list, list]:
        """Under the lock: every queued record (counted done) and the batch in hand's unresolved records; the thread
        skips a batch taken over before it reached the store."""
        queued = list(self._items)
        self._items.clear()
        inflight = [x for x in (self._inflight or []) if not x[1].done()]
        self._done += len(queued)
        self._cond.notify_all()
        return queued, inflight

    def _thread_ended(self, reason: str) -> None:
        with self._lock:
            self.stopped_reason, self._stopped, self._abandoned = reason, True, True
            queued, inflight = self._take_over()
            self._done += len(self._inflight or [])
            self._inflight = None
        left = inflight + queued
        if left:
            self._fail(left, RuntimeError(f"the ledger writer thread stopped ({reason})"), store_failed=False)
        if self.on_stop is not None:
            try:
                self.on_stop(reason)
            except Exception:
                log.exception("ledger writer: on_stop callback failed")

    def _spill_unfinished(self) -> None:
        """At :meth:`close`'s deadline: spill what is still queued and the batch the store has not answered."""
        with self._lock:
            self._abandoned = True
            queued, inflight = self._take_over()
        if queued or inflight:
            log.error("ledger: closing with %d record(s) not committed yet (the store is slow or hung); spilling them "
                      "for the next start", len(queued) + len(inflight))
            self._fail(inflight + queued, TimeoutError("the ledger writer was closed before the store answered"),
                       store_failed=False, lock_timeout=1.0)

    def _error(self, what: str, exc: BaseException) -> None:
        log.error("ledger writer: unexpected error %s (the writer goes on): %s: %s", what, type(exc).__name__, exc,
                  exc_info=exc)
        self._count("errors", 1)

    def _replay_guarded(self) -> None:
        try:
            self._replay_own_spill()
        except Exception as exc:           # e.g. EMFILE opening the file: kept, tried again after replay_interval_s
            self._spill_pending = True
            self._error("replaying the spill file", exc)

    def _replay_own_spill(self) -> None:
        """On the writer thread: commit this process's spill file (claimed by rename first, so a concurrent
        startup replay cannot take it too). Records that fail again are spilled again, records that can never be
        written go to the dead letter; none is dropped. A claimed file whose replay failed is kept and retried."""
        self._spill_pending = False
        path = self.spill_path
        claimed = f"{path[:-6]}.claimed-{os.getpid()}-{time.monotonic_ns()}.jsonl"
        try:
            os.rename(path, claimed)
            self._claims.append(claimed)
        except FileNotFoundError:
            pass
        for claimed in list(self._claims):
            self._replay_file(claimed, path)
            self._claims.remove(claimed)

    def _replay_file(self, claimed: str, path: str) -> None:
        records, unreadable = _read_spill(claimed)
        for line_no, line, why in unreadable:
            self._dead_letter_raw(f"unreadable spill line {line_no} of {os.path.basename(claimed)}: {why}", line)
        replayed = 0
        for i in range(0, len(records), self.batch_max):
            chunk = [(r, concurrent.futures.Future()) for r in records[i:i + self.batch_max]]
            self._commit(chunk)
            replayed += sum(1 for _, f in chunk if f.done() and f.exception() is None)
        self._count("replayed", replayed)
        try:
            os.unlink(claimed)
        except FileNotFoundError:
            pass
        log.warning("ledger: replayed %d of %d spilled record(s)%s", replayed, len(records),
                    "" if replayed == len(records) else f" (the rest spilled again to {path} or dead-lettered to "
                                                        f"{self.dead_letter_path})")

    def _commit(self, batch: list[tuple[LedgerRecord, concurrent.futures.Future]]) -> bool:
        """Write a batch: invalid records to the dead letter, the rest to the store (retries with backoff, then
        spill; a batch the store refuses is split to find the records it refuses). True when the store took some."""
        valid = []
        for record, fut in batch:          # a record that can never be written goes aside, the batch goes on
            try:
                record.validate()
                valid.append((record, fut))
            except Exception as exc:       # noqa: BLE001 - ValueError, or not a record at all
                self._dead_letter([(record, fut)], f"invalid: {exc}")
        if not valid:
            return False
        refused: list = []
        took = self._write(valid, refused)
        record_errors = _RECORD_ERRORS + tuple(getattr(self.store, "record_errors", ()))
        for item, exc in refused:          # each failed alone with a non-transient error
            if took or isinstance(exc, record_errors):  # the store works (or blames the record): it is the record
                self._dead_letter([item], f"refused by the store: {type(exc).__name__}: {exc}")
            else:                          # nothing was taken: maybe the store is broken -- keep it for replay
                self._fail([item], exc)
        return took

    def _write(self, batch: list, refused: list) -> bool:
        """Write ``batch``; a non-transient failure splits it in halves (down to single records, added to
        ``refused`` with their error). True when the store took any part."""
        outcome, value, latency = self._attempt([r for r, _ in batch])
        if outcome == "ok":
            self._committed(latency, batch, value)
            return True
        if outcome == "transient":
            self._fail(batch, value)
            return False
        if len(batch) == 1:
            refused.append((batch[0], value))
            return False
        mid = len(batch) // 2
        first = self._write(batch[:mid], refused)
        return self._write(batch[mid:], refused) or first

    def _attempt(self, records: list[LedgerRecord]) -> tuple[str, Any, float]:
        """("ok", flags, latency), ("transient", error, 0) after the retries, or ("refused", error, 0)."""
        transient = getattr(self.store, "transient_errors", (OSError,))
        for attempt in range(self.retries + 1):
            t0 = self._busy_since = time.monotonic()
            try:
                results = self.store.write_batch_flags(records)
                if len(results) != len(records):
                    raise RuntimeError(f"the store answered {len(results)} flags for {len(records)} records")
            except transient as exc:
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                return "transient", exc, 0.0
            except Exception as exc:       # not transient: no retry
                return "refused", exc, 0.0
            finally:
                self._busy_since = None
            return "ok", results, time.monotonic() - t0
        raise AssertionError("unreachable")

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
            _resolve(fut, result=bool(n))

    def _append(self, path: str, lines: list[str], lock_timeout: float) -> str:
        """Append lines under the file lock; if it cannot be had in time (the writer thread is stuck in a write),
        to a file of its own next to ``path``. Returns the file written."""
        if self._file_lock.acquire(timeout=lock_timeout):
            try:
                _append_lines(path, lines)
                return path
            finally:
                self._file_lock.release()
        other = f"{path[:-6]}-{time.monotonic_ns()}.jsonl"
        _append_lines(other, lines)
        return other

    def _fail(self, batch, error: BaseException, store_failed: bool = True, lock_timeout: float = -1) -> None:
        """Spill ``batch`` (the store did not take it) and fail its futures with :class:`LedgerWriteError`."""
        if not batch:
            return
        self._count("failed", len(batch))
        if store_failed and self.on_failure is not None:
            try:
                self.on_failure(error)
            except Exception:
                log.exception("ledger writer: on_failure callback failed")
        path: str | None = self.spill_path
        try:
            lines = [_dumps(_record_dict(r)) for r, _ in batch]
            path = self._append(path, lines, lock_timeout)
            self._count("spilled", len(batch))
            self._spill_pending = True
            self.last_spill_at = time.monotonic()
            log.error("ledger: %d record(s) could not be written to %s (%s); spilled to %s -- replayed when the "
                      "store answers again (or at the next start)", len(batch), getattr(self.store, "url", "?"),
                      error, path)
        except Exception as spill_exc:     # noqa: BLE001 - OSError, mostly; the records go to the log at least
            log.critical("ledger: %d record(s) could not be written (%s) NOR spilled to %s (%s): %s",
                         len(batch), error, path, spill_exc, [_record_dict(r) for r, _ in batch])
            path = None
        exc = LedgerWriteError(f"ledger write failed ({type(error).__name__}: {error}); "
                               + (f"spilled to {path}" if path else "spill failed too"), path)
        exc.__cause__ = error
        for _, fut in batch:
            _resolve(fut, exc=exc)

    def _dead_letter(self, items: list, reason: str) -> None:
        """Records that can never be written: to the dead-letter file with ``reason``; their futures fail with
        :class:`LedgerDeadLettered`."""
        path = self._write_dead_letter([{"record": _record_dict(r)} for r, _ in items], reason)
        exc = LedgerDeadLettered(f"ledger record not written ({reason}); "
                                 + (f"kept in the dead letter {path}" if path else "the dead letter failed too"),
                                 path, reason)
        for _, fut in items:
            _resolve(fut, exc=exc)

    def _dead_letter_raw(self, reason: str, line: str) -> None:
        self._write_dead_letter([{"line": line}], reason)

    def _write_dead_letter(self, entries: list[dict], reason: str) -> str | None:
        self._count("failed", len(entries))
        now, path = time.time(), self.dead_letter_path
        lines = [_dumps({"reason": reason, "at": now, "pid": os.getpid(), **e}) for e in entries]
        try:
            path = self._append(path, lines, -1)
        except Exception as exc:           # noqa: BLE001
            log.critical("ledger: %d record(s) can never be written (%s) and the dead letter %s failed (%s): %s",
                         len(entries), reason, path, exc, entries)
            return None
        self._count("dead_lettered", len(entries))
        log.error("ledger: %d record(s) can never be written to the store (%s); kept in the dead letter %s",
                  len(entries), reason, path)
        return path

    def replay_spill(self, timeout: float | None = 60.0) -> int:
        """Re-submit every record of ``<spill_dir>/ledger-spill-*.jsonl`` (any pid: call it at startup).

        Each file is first claimed by an atomic rename (so concurrent processes never replay the same file
        twice) and deleted once each of its records is committed, spilled again (to this process's spill file) or
        dead-lettered (it can never be written: see :attr:`dead_letter_path`); lines that cannot be read go to
        the dead letter too. A file whose replay did not finish within ``timeout`` is kept for the next replay.
        Returns the number of records newly recorded (records already in the store are skipped).
        """
        newly = 0
        for path in sorted(glob.glob(os.path.join(self.spill_dir, SPILL_GLOB))):
            claimed = f"{path[:-6]}.claimed-{os.getpid()}-{time.monotonic_ns()}.jsonl"
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                continue                   # another process claimed it
            records, unreadable = _read_spill(claimed)
            for line_no, line, why in unreadable:
                self._dead_letter_raw(f"unreadable spill line {line_no} of {os.path.basename(path)}: {why}", line)
            futures = [self.submit(r) for r in records]
            done, pending = concurrent.futures.wait(futures, timeout)
            kept = [f for f in done if f.exception() is None or _kept_on_disk(f.exception())]
            newly += sum(1 for f in done if f.exception() is None and f.result())
            self._count("replayed", sum(1 for f in done if f.exception() is None))
            if not pending and len(kept) == len(futures):
                os.unlink(claimed)
            else:
                log.error("ledger: replay of %s incomplete; the file is kept for the next replay", claimed)
        return newly


def _kept_on_disk(exc: BaseException) -> bool:
    """The record of a failed future is in a file that is replayed or inspected later (spill or dead letter)."""
    return isinstance(exc, LedgerWriteError) and exc.spilled_to is not None


def _resolve(fut: concurrent.futures.Future, result: Any = None, exc: BaseException | None = None) -> None:
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except concurrent.futures.InvalidStateError:   # cancelled by the caller (or resolved by close): still handled
        pass


def _record_dict(record: Any) -> dict[str, Any]:
    """A record as a dict for the files: JSON-able whatever its fields hold (an invalid record may hold anything)."""
    try:
        return record.to_dict()
    except Exception:                              # noqa: BLE001
        return {"repr": repr(record)}


def _dumps(obj: Any) -> str:
    """One JSON line: ASCII only (lone surrogates survive as ``\\ud800`` escapes), ``repr`` for what JSON lacks."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, default=repr)


def _append_lines(path: str, lines: list[str]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    new = not os.path.exists(path)
    data = "".join(line + "\n" for line in lines).encode("ascii")
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


def _read_spill(path: str) -> tuple[list[LedgerRecord], list[tuple[int, str, str]]]:
    """The records of a spill file, and its lines that are not records: (line number, text, why) -- a torn last
    line after a crash mid-spill, or a record of the wrong shape. Records that fail :meth:`LedgerRecord.validate`
    are returned: the writer dead-letters them with the reason."""
    out, bad = [], []
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.decode("utf-8", errors="backslashreplace").rstrip("\n")
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError(f"a JSON {type(data).__name__}, not a record")
                out.append(LedgerRecord.from_dict(data))
            except (ValueError, TypeError) as exc:
                log.warning("ledger: unreadable line %d of %s (to the dead letter): %s", n, path, exc)
                bad.append((n, line, f"{type(exc).__name__}: {exc}"))
    return out, bad


def read_dead_letter(path: str) -> list[dict[str, Any]]:
    """The entries of a dead-letter file: ``{"reason", "at", "pid", "record": {...}}`` (or ``"line"``: a spill line
    that could not be read)."""
    with open(path, encoding="ascii", errors="backslashreplace") as fh:
        return [json.loads(line) for line in fh if line.strip()]
