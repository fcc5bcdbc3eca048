"""The gateway's rate limiter: sliding-window-log limits, concurrency slots and quotas (pure Python).

**Limits** (RPM/TPM): a *descriptor* such as ``"key:k_1:tpm"``, ``"model:qwen3:tpm"`` or ``"global:rpm"``
allows ``limit`` units per ``window_s`` seconds. It keeps a log of reservations ``(id, time, cost)``; a
reservation counts while ``time > now - window_s`` (it expires at ``time + window_s``). No fixed windows
(no 2x bursts at window edges) and no GCRA: the log makes refunds and ``Retry-After`` exact.

* :meth:`reserve` takes items ``(descriptor, limit, window_s, cost)`` and is all-or-nothing and atomic
  across every descriptor: it is allowed iff ``sum(active costs) + cost <= limit`` for each of them, and then
  logs the cost under one reservation id in each. A denied request changes nothing.
  Guarantee: in every interval of length ``window_s`` the admitted cost is ``<= limit``.
* :class:`Decision` says ``allowed``, the ``reservation_id``, per descriptor ``limit``/``remaining``/``reset_s``
  (remaining after this reservation when allowed; ``reset_s`` = until the newest active reservation expires,
  i.e. the window is fully free), ``blocking`` (the descriptors that denied) and ``retry_after_s``: the
  exact earliest time at which this same request fits if nothing else arrives (when enough of the oldest
  reservations expire), or ``None`` with ``too_large=True`` when ``cost > limit`` (it can never fit).
* :meth:`adjust` reconciles after the response: it sets the reservation's cost per descriptor to the actual
  (a refund when lower; negative counts as 0; higher is charged too, so the limit reflects real usage).
  Unknown or expired reservations, and descriptors the reservation did not charge, are a no-op; so a
  refund can never push the remaining capacity above the limit. :meth:`release` = adjust everything to 0.
  A cost of 0 is not logged.
* :meth:`status` reports the same per-descriptor state without reserving (for rate-limit headers).

**Concurrency slots**: :meth:`acquire_slot` leases one of ``max_slots`` slots for ``lease_s`` seconds
(renew with :meth:`renew_slot` while the request runs, free with :meth:`release_slot`). A lease that ran out
(its process died) frees the slot by itself, so slots cannot leak.

**Quotas** (calendar budgets): :meth:`reserve_quota` takes items ``(descriptor, limit, ttl_s, cost)``, e.g.
``("budget:k_1:day:2026-11-30", 5_000_000, 2 * 86400, 1200)``; all-or-nothing, allowed iff
``used + cost <= limit`` for each. The counter is created by its first reservation and expires ``ttl_s``
after that (``reset_s``). Denied quota decisions have ``retry_after_s=None`` (waiting does not help).
:meth:`adjust_quota` reconciles a quota reservation with the actual cost (never below 0 used).

Backends with identical semantics (one test suite runs against each):

* :class:`MemoryLimiter` -- one process (tests, single-process servers); a lock around every operation.
* :class:`SqliteLimiter` -- the embedded backend, one file shared by several API-server processes on one
  host: one ``BEGIN IMMEDIATE`` transaction per operation, WAL, ``synchronous=NORMAL`` (limiter state need
  not survive a crash); expired rows are pruned as they are met and by a periodic sweep. A running sum per
  descriptor (``rl_sum``, kept in the same transactions) makes a reservation cost O(log n) plus the expired
  rows it prunes, not a scan of the window (a 15-minute spike window at 30 req/s holds 27,000 rows).
* :class:`RedisLimiter` -- shared by replicas: one Lua script call per operation, timed with Redis ``TIME``
  (or an injected clock, for tests). Per descriptor a sorted set (member = reservation id, score = time in
  microseconds), a hash of costs and a maintained running sum, so a reservation is O(log n) plus the
  expired entries it prunes. Every Redis failure raises :class:`LimiterUnavailable`; fail-open or
  fail-closed is the caller's decision. (An injected clock is read by each client before its script runs,
  so concurrent clients are not time-ordered: inject one only in single-client tests.)

Time is integer microseconds internally, so ``retry_after_s`` is exact: the request fits at
``now + retry_after_s`` and not one microsecond earlier. A descriptor should always be used with the same
window (the memory backend's log is kept in arrival order). All costs and limits are integers.
"""
from __future__ import annotations

import importlib.resources
import itertools
import os
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from ..store.redis import connect, safe_url
from ..store.sqlite import Database, apply_schema, is_busy

US = 1_000_000
_SLACK_MS = 60_000   # extra real-time TTL on Redis keys (keys then vanish on their own); semantics never use TTLs
_SWEEP_EVERY = 500   # local backends: drop all expired state every this many operations

Clock = Callable[[], float]


class LimiterUnavailable(RuntimeError):
    """The limiter's store cannot be reached or used (Redis down, SQLite locked for too long)."""


class LimiterBusy(LimiterUnavailable):
    """SQLite's write lock is held by another connection and this one does not wait (see ``nonblocking``)."""


@dataclass(frozen=True)
class DescriptorState:
    limit: int
    remaining: int   # never negative
    reset_s: float   # seconds until the window (or quota) is fully free again; 0.0 when it is


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reservation_id: str | None                 # set iff allowed
    retry_after_s: float | None                # set iff denied and waiting helps (always None for quotas)
    too_large: bool                            # some cost > its limit: can never be admitted
    blocking: tuple[str, ...]                  # descriptors that denied (empty iff allowed)
    descriptors: dict[str, DescriptorState]    # per descriptor, in the order given


_Items = list  # of (descriptor, limit, span_us, cost)


def _items(items: Iterable[Sequence], status: bool = False) -> _Items:
    """Validate ``(descriptor, limit, window_or_ttl_s, cost)`` items (``status``: the cost may be left out)."""
    out, seen = [], set()
    for it in items:
        it = tuple(it)
        if status and len(it) == 3:
            it += (0,)
        if len(it) != 4:
            raise ValueError(f"limiter item {it!r}: expected (descriptor, limit, seconds, cost)")
        d, limit, span_s, cost = it
        span = round(float(span_s) * US)
        if not isinstance(d, str) or not d or d in seen:
            raise ValueError(f"limiter descriptor {d!r}: must be a non-empty string, once per call")
        if int(limit) != limit or int(cost) != cost or limit < 0 or cost < 0 or span <= 0:
            raise ValueError(f"limiter item {it!r}: limit and cost must be integers >= 0, seconds > 0")
        seen.add(d)
        out.append((d, int(limit), span, 0 if status else int(cost)))
    return out


def _now_us(clock: Clock) -> int:
    return round(clock() * US)


_id_state: tuple = (None, "", itertools.count())   # (pid, random prefix, counter): replaced as one value
_id_lock = threading.Lock()


def _new_id() -> str:
    """A unique id (32 hex chars): a random per-process prefix and a counter (cheaper than a uuid4 per call)."""
    global _id_state
    pid, prefix, count = _id_state
    if pid != os.getpid():   # first call, or a forked child: a fresh prefix with its own counter
        with _id_lock:
            if _id_state[0] != os.getpid():
                _id_state = (os.getpid(), uuid.uuid4().hex[:16], itertools.count())
            pid, prefix, count = _id_state
    return f"{prefix}{next(count):016x}"


def _window_decision(its: _Items, now: int, rid: str, rows: Sequence[tuple[int, int, int]]) -> Decision:
    """rows: per item (active sum, newest expiry or 0, earliest expiry at which it fits or -1), before."""
    blocking = tuple(d for (d, lim, _w, c), (s, _n, _f) in zip(its, rows) if s + c > lim)
    too_large = any(c > lim for _d, lim, _w, c in its)
    allowed = not blocking
    states = {}
    for (d, lim, w, c), (s, n, _f) in zip(its, rows):
        if allowed and c:
            s, n = s + c, max(n, now + w)
        states[d] = DescriptorState(lim, max(0, lim - s), max(0, n - now) / US)
    retry = None
    if blocking and not too_large:
        retry = max(f for (d, *_), (_s, _n, f) in zip(its, rows) if d in blocking) - now
        retry = max(0, retry) / US
    return Decision(allowed, rid if allowed else None, retry, too_large, blocking, states)


def _quota_decision(its: _Items, now: int, rid: str, rows: Sequence[tuple[int, int]]) -> Decision:
    """rows: per item (used, expiry or 0 when the counter does not exist), before."""
    blocking = tuple(d for (d, lim, _t, c), (u, _e) in zip(its, rows) if u + c > lim)
    allowed = not blocking
    states = {}
    for (d, lim, ttl, c), (u, e) in zip(its, rows):
        if allowed:
            u, e = u + c, e or now + ttl
        states[d] = DescriptorState(lim, max(0, lim - u), max(0, e - now) / US)
    return Decision(allowed, rid if allowed else None, None, any(c > lim for _d, lim, _t, c in its),
                    blocking, states)


class _Limiter:
    """Public API shared by all backends."""

    def reserve(self, items: Iterable[Sequence]) -> Decision:
        """All-or-nothing reservation of ``(descriptor, limit, window_s, cost)`` items."""
        raise NotImplementedError

    def adjust(self, reservation_id: str, actual_costs: Mapping[str, int]) -> None:
        """Set the reservation's cost per descriptor to the actual (unknown/expired: no-op)."""
        raise NotImplementedError

    def release(self, reservation_id: str) -> None:
        """Refund the whole reservation (e.g. the request was rejected before reaching the engine)."""
        raise NotImplementedError

    def status(self, items: Iterable[Sequence]) -> dict[str, DescriptorState]:
        """Per-descriptor state for ``(descriptor, limit, window_s[, cost])`` items, without reserving."""
        raise NotImplementedError

    def release_quota(self, reservation_id: str) -> None:
        self.adjust_quota(reservation_id, 0)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ local backends
class _LocalLimiter(_Limiter):
    """Operation logic of the memory and SQLite backends over storage primitives run inside ``_txn()``."""

    def _txn(self):  # context manager yielding now (µs) with the store locked
        raise NotImplementedError

    def reserve(self, items):
        its, rid = _items(items), _new_id()
        with self._txn() as now:
            rows = []
            for d, lim, _w, c in its:
                s, n = self._w_state(d, now)
                rows.append((s, n, self._w_free_at(d, s + c - lim) if c <= lim < s + c else -1))
            dec = _window_decision(its, now, rid, rows)
            if dec.allowed:
                for d, _lim, w, c in its:
                    if c:
                        self._w_add(d, rid, now + w, c)
        return dec

    def adjust(self, reservation_id, actual_costs):
        with self._txn() as now:
            current = self._w_get(reservation_id, now)
            for d, cost in actual_costs.items():
                if d in current:
                    self._w_set(d, reservation_id, current[d], max(0, int(cost)))

    def release(self, reservation_id):
        with self._txn() as now:
            for d, old in self._w_get(reservation_id, now).items():
                self._w_set(d, reservation_id, old, 0)

    def status(self, items):
        its = _items(items, status=True)
        with self._txn() as now:
            rows = [self._w_state(d, now) + (-1,) for d, *_ in its]
        return _window_decision(its, now, "", rows).descriptors if its else {}

    # slots
    def acquire_slot(self, descriptor: str, max_slots: int, lease_s: float) -> str | None:
        """Lease a slot for ``lease_s`` seconds; None when all ``max_slots`` are held."""
        sid = _new_id()
        with self._txn() as now:
            if self._s_count(descriptor, now) >= max_slots:
                return None
            self._s_put(descriptor, sid, now + round(lease_s * US))
        return sid

    def renew_slot(self, descriptor: str, slot_id: str, lease_s: float) -> bool:
        """Extend the lease to ``now + lease_s``; False when the slot is no longer held (lease ran out)."""
        with self._txn() as now:
            exp = self._s_exp(descriptor, slot_id)
            if exp is None or exp <= now:
                self._s_del(descriptor, slot_id)
                return False
            self._s_put(descriptor, slot_id, now + round(lease_s * US))
        return True

    def release_slot(self, descriptor: str, slot_id: str) -> None:
        with self._txn():
            self._s_del(descriptor, slot_id)

    def slots_used(self, descriptor: str) -> int:
        with self._txn() as now:
            return self._s_count(descriptor, now)

    # quotas
    def reserve_quota(self, items: Iterable[Sequence]) -> Decision:
        """All-or-nothing reservation of ``(descriptor, limit, ttl_s, cost)`` quota items."""
        its, rid = _items(items), _new_id()
        with self._txn() as now:
            rows = [self._q_get(d, now) for d, *_ in its]
            dec = _quota_decision(its, now, rid, rows)
            if dec.allowed:
                for (d, _lim, ttl, c), (used, exp) in zip(its, rows):
                    exp = exp or now + ttl
                    self._q_put(d, used + c, exp)
                    self._qr_put(rid, d, c, exp)
        return dec

    def adjust_quota(self, reservation_id: str, actual: int | Mapping[str, int]) -> None:
        """Set the quota reservation's cost to ``actual`` (an int for every descriptor, or per descriptor)."""
        with self._txn() as now:
            for d, (cost, exp) in self._qr_get(reservation_id, now).items():
                new = actual.get(d) if isinstance(actual, Mapping) else actual
                used, qexp = self._q_get(d, now)
                if new is not None and qexp == exp:   # same counter (not expired and recreated)
                    new = max(0, int(new))
                    self._q_put(d, max(0, used + new - cost), exp)
                    self._qr_put(reservation_id, d, new, exp)

    def quota_used(self, descriptor: str) -> int:
        with self._txn() as now:
            return self._q_get(descriptor, now)[0]


class MemoryLimiter(_LocalLimiter):
    """Single-process limiter (tests, one API-server process). The clock never goes backwards here."""

    def __init__(self, clock: Clock = time.time):
        self._clock, self._lock, self._last, self._ops = clock, threading.Lock(), 0, 0
        self._log: dict[str, dict[str, list[int]]] = {}     # descriptor -> rid -> [expiry, cost], oldest first
        self._sum: dict[str, int] = {}                      # descriptor -> running sum of its log
        self._res: dict[str, set[str]] = {}                 # rid -> descriptors it is logged in
        self._quota: dict[str, list[int]] = {}              # descriptor -> [used, expiry]
        self._qres: dict[str, dict[str, list[int]]] = {}    # rid -> descriptor -> [cost, counter expiry]
        self._slots: dict[str, dict[str, int]] = {}         # descriptor -> slot id -> lease expiry

    @contextmanager
    def _txn(self) -> Iterator[int]:
        with self._lock:
            self._last = now = max(self._last, _now_us(self._clock))
            self._ops += 1
            if self._ops % _SWEEP_EVERY == 0:
                self._sweep(now)
            yield now

    def _sweep(self, now: int) -> None:
        for d in list(self._log):
            self._w_state(d, now)
        for d in [d for d, (_u, e) in self._quota.items() if e <= now]:
            del self._quota[d]
        for rid in [r for r, m in self._qres.items() if all(e <= now for _c, e in m.values())]:
            del self._qres[rid]
        for d in list(self._slots):
            self._s_count(d, now)

    def _w_state(self, d, now):
        log = self._log.get(d)
        while log:
            rid = next(iter(log))
            exp, cost = log[rid]
            if exp > now:
                return self._sum[d], next(reversed(log.values()))[0]
            del log[rid]
            self._sum[d] -= cost
            self._unlink(rid, d)
        self._log.pop(d, None)
        self._sum.pop(d, None)
        return 0, 0

    def _w_free_at(self, d, need):
        freed = 0
        for exp, cost in self._log[d].values():
            freed += cost
            if freed >= need:
                return exp
        raise AssertionError("unreachable: need <= active sum")

    def _w_add(self, d, rid, exp, cost):
        self._log.setdefault(d, {})[rid] = [exp, cost]
        self._sum[d] = self._sum.get(d, 0) + cost
        self._res.setdefault(rid, set()).add(d)

    def _w_get(self, rid, now):
        return {d: self._log[d][rid][1] for d in self._res.get(rid, ()) if self._log[d][rid][0] > now}

    def _w_set(self, d, rid, old, cost):
        self._sum[d] += cost - old
        if cost:
            self._log[d][rid][1] = cost
        else:
            del self._log[d][rid]
            self._unlink(rid, d)

    def _unlink(self, rid, d):
        ds = self._res.get(rid)
        if ds is not None:
            ds.discard(d)
            if not ds:
                del self._res[rid]

    def _s_count(self, d, now):
        slots = self._slots.get(d, {})
        for sid in [s for s, e in slots.items() if e <= now]:
            del slots[sid]
        if not slots:
            self._slots.pop(d, None)
        return len(slots)

    def _s_exp(self, d, sid):
        return self._slots.get(d, {}).get(sid)

    def _s_put(self, d, sid, exp):
        self._slots.setdefault(d, {})[sid] = exp

    def _s_del(self, d, sid):
        self._slots.get(d, {}).pop(sid, None)

    def _q_get(self, d, now):
        v = self._quota.get(d)
        if v is None or v[1] <= now:
            self._quota.pop(d, None)
            return 0, 0
        return v[0], v[1]

    def _q_put(self, d, used, exp):
        self._quota[d] = [used, exp]

    def _qr_get(self, rid, now):
        return {d: (c, e) for d, (c, e) in self._qres.get(rid, {}).items() if e > now}

    def _qr_put(self, rid, d, cost, exp):
        self._qres.setdefault(rid, {})[d] = [cost, exp]


_SUM_TABLE = "CREATE TABLE IF NOT EXISTS rl_sum (d TEXT PRIMARY KEY, total INTEGER NOT NULL) WITHOUT ROWID"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS rl_log (rid TEXT NOT NULL, d TEXT NOT NULL, exp INTEGER NOT NULL,
    cost INTEGER NOT NULL, PRIMARY KEY (rid, d)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS rl_log_d ON rl_log (d, exp, cost);
CREATE INDEX IF NOT EXISTS rl_log_exp ON rl_log (exp);
CREATE TABLE IF NOT EXISTS rl_quota (d TEXT PRIMARY KEY, used INTEGER NOT NULL, exp INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rl_quota_res (rid TEXT NOT NULL, d TEXT NOT NULL, cost INTEGER NOT NULL,
    exp INTEGER NOT NULL, PRIMARY KEY (rid, d)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rl_slot (d TEXT NOT NULL, sid TEXT NOT NULL, exp INTEGER NOT NULL,
    PRIMARY KEY (d, sid)) WITHOUT ROWID;
"""


class SqliteLimiter(_LocalLimiter):
    """The embedded limiter: one SQLite file; every process (and thread, if it likes) opens its own."""

    def __init__(self, path: str, clock: Clock = time.time, busy_timeout_s: float = 30.0):
        self.path, self._clock = os.path.abspath(path), clock
        self._ops, self._maintain = 0, True
        try:
            self._sql = Database(self.path, synchronous="NORMAL", busy_timeout_s=busy_timeout_s)
            with self._txn():
                apply_schema(self._sql.conn, _SCHEMA)
                if not self._x("SELECT 1 FROM sqlite_master WHERE name = 'rl_sum'").fetchone():
                    # a file from before the running sums: build them once from the log
                    self._x(_SUM_TABLE)
                    self._x("INSERT INTO rl_sum (d, total) SELECT d, SUM(cost) FROM rl_log GROUP BY d")
        except (sqlite3.Error, OSError) as exc:
            raise LimiterUnavailable(f"cannot open the SQLite limiter {self.path}: {exc}") from exc

    def nonblocking(self) -> "SqliteLimiter":
        """A second connection to the same file for calls made on an event loop: it never waits for SQLite's
        write lock (when another connection holds it, :class:`LimiterBusy` at once: retry with this instance on a
        worker thread) and never checkpoints the WAL (fsyncs) or sweeps expired rows: this instance does both."""
        twin = SqliteLimiter.__new__(SqliteLimiter)
        twin.path, twin._clock, twin._ops, twin._maintain = self.path, self._clock, 0, False
        try:
            twin._sql = self._sql.twin(blocking=False)
        except sqlite3.Error as exc:
            raise LimiterUnavailable(f"cannot open the SQLite limiter {self.path}: {exc}") from exc
        return twin

    @contextmanager
    def _txn(self) -> Iterator[int]:
        try:
            with self._sql.transaction():
                now = _now_us(self._clock)   # read under the write lock: ordered across processes
                self._ops += 1
                if self._maintain and self._ops % _SWEEP_EVERY == 0:
                    self._sweep(now)
                yield now
        except sqlite3.Error as exc:
            if is_busy(exc):
                raise LimiterBusy(f"SQLite limiter {self.path}: {exc}") from exc
            raise LimiterUnavailable(f"SQLite limiter {self.path}: {exc}") from exc

    def _x(self, sql, *args):
        return self._sql.conn.execute(sql, args)

    def _sweep(self, now):
        self._x("UPDATE rl_sum SET total = total - (SELECT COALESCE(SUM(cost), 0) FROM rl_log "
                "WHERE rl_log.d = rl_sum.d AND exp <= ?)", now)
        for table in ("rl_log", "rl_quota", "rl_quota_res", "rl_slot"):
            self._x(f"DELETE FROM {table} WHERE exp <= ?", now)
        self._x("DELETE FROM rl_sum WHERE NOT EXISTS (SELECT 1 FROM rl_log WHERE rl_log.d = rl_sum.d)")

    def _w_state(self, d, now):
        # index range scans only: the expired rows (pruned, subtracted from the running sum) and the newest row
        expired, count = self._x("SELECT COALESCE(SUM(cost), 0), COUNT(*) FROM rl_log WHERE d = ? AND exp <= ?",
                                 d, now).fetchone()
        if count:
            self._x("DELETE FROM rl_log WHERE d = ? AND exp <= ?", d, now)
            self._x("UPDATE rl_sum SET total = total - ? WHERE d = ?", expired, d)
        newest = self._x("SELECT MAX(exp) FROM rl_log WHERE d = ?", d).fetchone()[0]
        if newest is None:
            self._x("DELETE FROM rl_sum WHERE d = ?", d)
            return 0, 0
        return self._x("SELECT total FROM rl_sum WHERE d = ?", d).fetchone()[0], newest

    def _w_free_at(self, d, need):
        freed = 0
        for exp, cost in self._x("SELECT exp, cost FROM rl_log WHERE d = ? ORDER BY exp", d):
            freed += cost
            if freed >= need:
                return exp
        raise AssertionError("unreachable: need <= active sum")

    def _w_add(self, d, rid, exp, cost):
        self._x("INSERT INTO rl_log (rid, d, exp, cost) VALUES (?, ?, ?, ?)", rid, d, exp, cost)
        self._x("INSERT INTO rl_sum (d, total) VALUES (?, ?) ON CONFLICT (d) DO UPDATE SET total = total + "
                "excluded.total", d, cost)

    def _w_get(self, rid, now):
        return dict(self._x("SELECT d, cost FROM rl_log WHERE rid = ? AND exp > ?", rid, now).fetchall())

    def _w_set(self, d, rid, old, cost):
        if cost:
            self._x("UPDATE rl_log SET cost = ? WHERE rid = ? AND d = ?", cost, rid, d)
        else:
            self._x("DELETE FROM rl_log WHERE rid = ? AND d = ?", rid, d)
        self._x("UPDATE rl_sum SET total = total + ? WHERE d = ?", cost - old, d)

    def _s_count(self, d, now):
        self._x("DELETE FROM rl_slot WHERE d = ? AND exp <= ?", d, now)
        return self._x("SELECT COUNT(*) FROM rl_slot WHERE d = ?", d).fetchone()[0]

    def _s_exp(self, d, sid):
        row = self._x("SELECT exp FROM rl_slot WHERE d = ? AND sid = ?", d, sid).fetchone()
        return row and row[0]

    def _s_put(self, d, sid, exp):
        self._x("INSERT OR REPLACE INTO rl_slot (d, sid, exp) VALUES (?, ?, ?)", d, sid, exp)

    def _s_del(self, d, sid):
        self._x("DELETE FROM rl_slot WHERE d = ? AND sid = ?", d, sid)

    def _q_get(self, d, now):
        row = self._x("SELECT used, exp FROM rl_quota WHERE d = ?", d).fetchone()
        if row is None or row[1] <= now:
            self._x("DELETE FROM rl_quota WHERE d = ?", d)
            return 0, 0
        return row

    def _q_put(self, d, used, exp):
        self._x("INSERT OR REPLACE INTO rl_quota (d, used, exp) VALUES (?, ?, ?)", d, used, exp)

    def _qr_get(self, rid, now):
        return {d: (c, e) for d, c, e in self._x("SELECT d, cost, exp FROM rl_quota_res WHERE rid = ? AND exp > ?",
                                                 rid, now)}

    def _qr_put(self, rid, d, cost, exp):
        self._x("INSERT OR REPLACE INTO rl_quota_res (rid, d, cost, exp) VALUES (?, ?, ?, ?)", rid, d, cost, exp)

    def close(self) -> None:
        self._sql.close()


# --------------------------------------------------------------------------------------------------- Redis
# One script, dispatched on ARGV[1]; ARGV[2] = key prefix, ARGV[3] = now in µs ('' = use Redis TIME).
# Keys: <P>w:<d>:z (zset rid -> time), <P>w:<d>:c (hash rid -> cost), <P>w:<d>:s (running sum),
# <P>rr:<rid> (hash descriptor -> 1: where a reservation is logged), <P>q:<d> (hash used, exp),
# <P>qr:<rid> (hash descriptor -> "cost:exp"), <P>sl:<d> (zset slot id -> lease expiry).
_LUA = (importlib.resources.files(__package__) / "limiter.lua").read_text()  # package data


class RedisLimiter(_Limiter):
    """The limiter on a (single, non-cluster) Redis server, shared by every process and replica."""

    def __init__(self, url: str, prefix: str = "qvl:", clock: Clock | None = None, socket_timeout_s: float = 5.0):
        import redis

        self.url, self.prefix, self._clock = url, prefix, clock
        self._errors = (redis.exceptions.RedisError, OSError)
        # No client retries: a reservation must not be applied twice; the caller decides open/closed.
        self._r = connect(url, LimiterUnavailable, "limiter", socket_timeout_s)
        self._script = self._r.register_script(_LUA)

    def _call(self, op: str, *args) -> object:
        now = "" if self._clock is None else str(_now_us(self._clock))
        try:
            return self._script(args=[op, self.prefix, now, *args])
        except self._errors as exc:
            raise LimiterUnavailable(f"Redis limiter at {safe_url(self.url)} failed: {exc}") from exc

    @staticmethod
    def _rows(reply, width: int) -> tuple[bool, int, list[tuple[int, ...]]]:
        rows = [tuple(int(x) for x in reply[i:i + width]) for i in range(2, len(reply), width)]
        return bool(reply[0]), int(reply[1]), rows

    def reserve(self, items):
        its, rid = _items(items), _new_id()
        _allowed, now, rows = self._rows(self._call("reserve", rid, *[x for it in its for x in it]), 3)
        return _window_decision(its, now, rid, rows)

    def status(self, items):
        its = _items(items, status=True)
        if not its:
            return {}
        _allowed, now, rows = self._rows(self._call("reserve", "", *[x for it in its for x in it]), 3)
        return _window_decision(its, now, "", rows).descriptors

    def adjust(self, reservation_id, actual_costs):
        pairs = [x for d, c in actual_costs.items() for x in (d, max(0, int(c)))]
        if pairs:
            self._call("adjust", reservation_id, *pairs)

    def release(self, reservation_id):
        self._call("adjust", reservation_id)

    def acquire_slot(self, descriptor: str, max_slots: int, lease_s: float) -> str | None:
        sid = _new_id()
        return sid if self._call("slot", descriptor, "acquire", sid, max_slots, round(lease_s * US)) else None

    def renew_slot(self, descriptor: str, slot_id: str, lease_s: float) -> bool:
        return bool(self._call("slot", descriptor, "renew", slot_id, 0, round(lease_s * US)))

    def release_slot(self, descriptor: str, slot_id: str) -> None:
        self._call("slot", descriptor, "release", slot_id)

    def slots_used(self, descriptor: str) -> int:
        return int(self._call("slot", descriptor, "count", ""))

    def reserve_quota(self, items):
        its, rid = _items(items), _new_id()
        _allowed, now, rows = self._rows(self._call("quota", rid, *[x for it in its for x in it]), 2)
        return _quota_decision(its, now, rid, rows)

    def adjust_quota(self, reservation_id, actual):
        if isinstance(actual, Mapping):
            self._call("adjust_quota", reservation_id, "each",
                       *[x for d, c in actual.items() for x in (d, max(0, int(c)))])
        else:
            self._call("adjust_quota", reservation_id, "all", max(0, int(actual)))

    def quota_used(self, descriptor: str) -> int:
        return int(self._call("quota_used", descriptor))

    def close(self) -> None:
        self._r.close()


def open_limiter(backend: str, location: str = "", **kwargs) -> MemoryLimiter | SqliteLimiter | RedisLimiter:
    """``memory`` (location ignored), ``sqlite`` (file path) or ``redis`` (URL); raises :class:`LimiterUnavailable`
    when the store cannot be opened or reached. ``kwargs`` go to the backend (``clock``, ``prefix``, ...)."""
    if backend == "memory":
        return MemoryLimiter(**kwargs)
    if backend == "sqlite":
        return SqliteLimiter(location, **kwargs)
    if backend == "redis":
        if not location:
            raise LimiterUnavailable("the Redis limiter backend needs a URL")
        return RedisLimiter(location, **kwargs)
    raise ValueError(f"unknown limiter backend {backend!r}; expected 'memory', 'sqlite' or 'redis'")
