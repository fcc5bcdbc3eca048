"""The ledger writer: group commit on a thread, retries, spill files and their replay."""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import glob
import json
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

from .record import LedgerRecord, LedgerWriteError
from .report import LedgerStore

log = logging.getLogger("qwen_vllm_ext.usage.ledger")
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
