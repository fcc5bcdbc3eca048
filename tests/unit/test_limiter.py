"""The gateway's rate limiter: one suite, identical assertions, run against the memory, SQLite and Redis
backends (a real throw-away ``redis-server``). Time is an injected clock except in the concurrency tests."""
from __future__ import annotations

import multiprocessing
import os
import random
import sqlite3
import threading
import time
import uuid

import pytest

from qwen_vllm_ext.gateway.limiter import (US, Decision, LimiterUnavailable, MemoryLimiter, RedisLimiter,
                                           SqliteLimiter, open_limiter)
from tests.redis_server import RedisServer, free_port

T0 = 1_700_000_000 * US


class Clock:
    """Injected clock; holds integer microseconds so tests can step exactly 1 µs."""

    def __init__(self, t_us: int = T0):
        self.us = t_us

    def __call__(self) -> float:
        return self.us / US

    def advance(self, seconds: float) -> None:
        self.us += round(seconds * US)


@pytest.fixture(params=["memory", "sqlite", "redis"])
def backend(request, tmp_path):
    """Factory ``new(clock)``: another client of one shared store per test (memory: the same object)."""
    kind = request.param
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    prefix, made = f"t{uuid.uuid4().hex[:8]}:", []

    def new(clock=None):   # None: the real clock (Redis: its TIME, which orders all clients)
        if kind == "memory":
            if not made:
                made.append(MemoryLimiter(clock or time.time))
            return made[0]
        lim = (SqliteLimiter(str(tmp_path / "limiter.db"), clock=clock or time.time) if kind == "sqlite"
               else RedisLimiter(url, prefix=prefix, clock=clock))
        made.append(lim)
        return lim

    new.kind, new.path, new.url, new.prefix = kind, str(tmp_path / "limiter.db"), url, prefix
    yield new
    for lim in made:
        lim.close()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def lim(backend, clock):
    return backend(clock)


def remaining(lim, d, limit, window=60):
    return lim.status([(d, limit, window)])[d].remaining


# ------------------------------------------------------------------------------------------------ basics
def test_allow_deny_remaining_reset(lim, clock):
    k = [("key:k_1:tpm", 10, 60, 4)]
    d = lim.reserve(k)
    assert d.allowed and d.reservation_id and d.retry_after_s is None and d.blocking == () and not d.too_large
    assert d.descriptors["key:k_1:tpm"].limit == 10
    assert d.descriptors["key:k_1:tpm"].remaining == 6 and d.descriptors["key:k_1:tpm"].reset_s == 60.0
    clock.advance(10)
    d = lim.reserve([("key:k_1:tpm", 10, 60, 5)])
    assert d.allowed and d.descriptors["key:k_1:tpm"].remaining == 1
    d = lim.reserve([("key:k_1:tpm", 10, 60, 2)])
    assert not d.allowed and d.reservation_id is None and d.blocking == ("key:k_1:tpm",)
    assert d.descriptors["key:k_1:tpm"].remaining == 1 and d.descriptors["key:k_1:tpm"].reset_s == 60.0
    assert d.retry_after_s == 50.0 and not d.too_large   # the 4 from t=0 expires at t=60
    assert lim.status([("key:k_1:tpm", 10, 60)])["key:k_1:tpm"].remaining == 1   # denial changed nothing
    clock.advance(50)
    st = lim.status([("key:k_1:tpm", 10, 60)])["key:k_1:tpm"]
    assert (st.remaining, st.reset_s) == (5, 10.0)
    assert lim.reserve([("key:k_1:tpm", 10, 60, 2)]).descriptors["key:k_1:tpm"].remaining == 3
    clock.advance(60)
    st = lim.status([("key:k_1:tpm", 10, 60, 99)])["key:k_1:tpm"]   # a cost in status is ignored
    assert (st.limit, st.remaining, st.reset_s) == (10, 10, 0.0)
    assert lim.status([]) == {}
    d = lim.reserve([])
    assert d.allowed and d.descriptors == {}


def test_validation(lim):
    for bad in ([("", 1, 60, 1)], [("a", 1, 60, 1), ("a", 1, 60, 1)], [("a", -1, 60, 1)], [("a", 1, 0, 1)],
                [("a", 1, 60, -1)], [("a", 1.5, 60, 1)], [("a", 1, 60)]):
        with pytest.raises(ValueError):
            lim.reserve(bad)


def test_all_or_nothing_across_descriptors(lim):
    a, b, g = ("key:k_1:tpm", 10), ("model:qwen3:tpm", 5), ("global:rpm", 100)
    items = lambda ca, cb: [(a[0], a[1], 60, ca), (b[0], b[1], 60, cb), (g[0], g[1], 60, 1)]   # noqa: E731
    assert lim.reserve(items(4, 4)).allowed
    d = lim.reserve(items(4, 4))
    assert not d.allowed and d.blocking == ("model:qwen3:tpm",) and d.retry_after_s == 60.0
    assert {k: s.remaining for k, s in d.descriptors.items()} == {a[0]: 6, b[0]: 1, g[0]: 99}
    st = lim.status([(a[0], a[1], 60), (b[0], b[1], 60), (g[0], g[1], 60)])
    assert {k: s.remaining for k, s in st.items()} == {a[0]: 6, b[0]: 1, g[0]: 99}   # nothing partial
    d = lim.reserve(items(7, 6))
    assert set(d.blocking) == {a[0], b[0]} and d.too_large
    d = lim.reserve(items(4, 1))
    assert d.allowed and {k: s.remaining for k, s in d.descriptors.items()} == {a[0]: 2, b[0]: 0, g[0]: 98}


def test_retry_after_is_exact(lim, clock):
    items = lambda c: [("key:k:tpm", 100, 60, c), ("global:rpm", 3, 10, 1)]   # noqa: E731
    for t, c in ((0, 20), (1, 20), (2, 20), (3, 30)):        # 90 tokens; the rpm is full after t=2
        clock.us = T0 + t * US
        assert lim.reserve(items(c)[:1] if t == 3 else items(c)).allowed
    # tpm needs 35 freed: 20 (t=0) + 20 (t=1) -> fits at t=61; rpm needs 1: t=0 + 10 -> 10. Max: 61.
    d = lim.reserve(items(45))
    assert set(d.blocking) == {"key:k:tpm", "global:rpm"} and d.retry_after_s == 58.0
    d = lim.reserve(items(5))                                  # only the rpm blocks
    assert d.blocking == ("global:rpm",) and d.retry_after_s == 7.0
    clock.advance(7 - 1e-6)
    d = lim.reserve(items(5))
    assert not d.allowed and d.retry_after_s == 1e-6
    clock.advance(1e-6)
    d = lim.reserve(items(5))
    assert d.allowed
    clock.us = T0 + 61 * US - 1
    d = lim.reserve(items(45)[:1])
    assert not d.allowed and d.retry_after_s == 1e-6
    clock.advance(1e-6)
    assert lim.reserve(items(45)[:1]).allowed


def test_too_large(lim):
    d = lim.reserve([("key:k:tpm", 10, 60, 11), ("global:rpm", 5, 60, 1)])
    assert not d.allowed and d.too_large and d.retry_after_s is None and d.blocking == ("key:k:tpm",)
    assert d.descriptors["key:k:tpm"].remaining == 10 and d.descriptors["global:rpm"].remaining == 5
    assert remaining(lim, "global:rpm", 5) == 5
    d = lim.reserve([("key:k:tpm", 10, 60, 10)])
    assert d.allowed and not d.too_large and d.descriptors["key:k:tpm"].remaining == 0


def test_adjust_release_and_refund_bounds(lim, clock):
    k, g = "key:k:tpm", "global:tpm"
    items = lambda c: [(k, 100, 60, c), (g, 1000, 60, c)]     # noqa: E731
    rem = lambda: (remaining(lim, k, 100), remaining(lim, g, 1000))   # noqa: E731
    r = lim.reserve(items(80)).reservation_id
    lim.adjust(r, {k: 30, g: 30})
    assert rem() == (70, 970)
    lim.adjust(r, {k: -5, "other:tpm": 5})      # never below 0; descriptors not reserved are ignored
    assert rem() == (100, 970)
    lim.adjust(r, {k: 50})                        # a refunded-to-0 descriptor is gone: no re-charge
    assert rem() == (100, 970)
    lim.release(r)
    lim.release(r)
    lim.adjust("no-such-reservation", {k: 0})
    lim.release("no-such-reservation")
    assert rem() == (100, 1000)
    # A refund of an expired reservation must not credit the new window.
    r2 = lim.reserve(items(60)).reservation_id
    clock.advance(60)
    r3 = lim.reserve(items(100)).reservation_id
    assert rem() == (0, 900)
    lim.release(r2)
    lim.adjust(r2, {k: 0, g: 0})
    assert rem() == (0, 900)
    # Release of the newest entry: reset falls back to the older one; an increase is charged.
    clock.advance(30)
    r4 = lim.reserve([(g, 1000, 60, 100)]).reservation_id
    assert lim.status([(g, 1000, 60)])[g].reset_s == 60.0
    lim.release(r4)
    assert lim.status([(g, 1000, 60)])[g].reset_s == 30.0
    lim.adjust(r3, {g: 150})
    assert rem() == (0, 850)
    clock.advance(30)
    assert rem() == (100, 1000)


def test_sliding_window_property_against_a_model(lim, clock):
    """Seeded random arrivals, refunds and releases, checked decision by decision against an independent
    model of the sliding-window log; then every window of every descriptor holds <= its limit."""
    limits = {"key:a:tpm": (100, 60), "key:b:tpm": (80, 60), "global:tpm": (150, 60), "global:rpm": (12, 10)}
    rng = random.Random(20261130)
    log = []                                   # admitted: [rid, t_us, {descriptor: current cost}]

    def active(d, now):
        return [(t, cs[d]) for _, t, cs in log if cs.get(d, 0) > 0 and t > now - limits[d][1] * US]

    def used(d, now):
        return sum(c for _, c in active(d, now))

    def fits(req, now):
        return all(used(d, now) + c <= limits[d][0] for d, c in req.items())

    def expect_state(d, now, add=0):
        ts = [t for t, _ in active(d, now)] + ([now] if add else [])
        reset = (max(ts) + limits[d][1] * US - now) / US if ts else 0.0
        return limits[d][0], max(0, limits[d][0] - used(d, now) - add), reset

    admitted = denied = refunds = 0
    for _ in range(600):
        r = rng.random()
        if r < 0.15 and log:                   # jump exactly onto an expiry boundary
            _, t, cs = rng.choice(log)
            clock.us = max(clock.us, t + limits[rng.choice(list(cs))][1] * US)
        elif r > 0.3:
            clock.us += round(rng.expovariate(1 / 1.5) * US)
        now = clock.us
        op = rng.random()
        if op < 0.65:
            cost = rng.choice([0, rng.randint(1, 40), rng.randint(1, 40), rng.randint(30, 90), 200])
            req = {f"key:{rng.choice('ab')}:tpm": cost, "global:tpm": cost, "global:rpm": 1}
            dec = lim.reserve([(d, limits[d][0], limits[d][1], c) for d, c in req.items()])
            ok = fits(req, now)
            assert dec.allowed == ok
            assert dec.too_large == any(c > limits[d][0] for d, c in req.items())
            for d, c in req.items():
                st = dec.descriptors[d]
                assert (st.limit, st.remaining, st.reset_s) == expect_state(d, now, c if ok else 0)
            if ok:
                admitted += 1
                log.append([dec.reservation_id, now, dict(req)])
                assert all(used(d, now) <= limits[d][0] for d in req)
            elif dec.too_large:
                assert dec.retry_after_s is None
            else:
                denied += 1
                assert set(dec.blocking) == {d for d, c in req.items() if used(d, now) + c > limits[d][0]}
                candidates = sorted({t + limits[d][1] * US for d in req for t, _ in active(d, now)})
                fit_at = next(t for t in candidates if fits(req, t))
                assert dec.retry_after_s == (fit_at - now) / US
                assert not fits(req, fit_at - 1)
        elif op < 0.9 and log:
            rid, t, cs = rng.choice(log[-12:] if rng.random() < 0.8 else log)   # mostly still active
            if rng.random() < 0.2:
                lim.release(rid)
                new = {d: 0 for d in cs}
            else:
                new = {d: rng.randint(-2, c) for d, c in cs.items() if rng.random() < 0.7}
                lim.adjust(rid, new)
            for d, c in new.items():
                if cs[d] > 0 and t > now - limits[d][1] * US:
                    refunds += 1
                    cs[d] = max(0, c)
        st = lim.status([(d, lim_, w) for d, (lim_, w) in limits.items()])
        for d in limits:
            assert (st[d].limit, st[d].remaining, st[d].reset_s) == expect_state(d, now)
            assert st[d].remaining <= limits[d][0]
    assert admitted > 150 and denied > 50 and refunds > 50
    for d, (limit, w) in limits.items():       # every window (they peak where one ends on an admission)
        for _, end, _ in log:
            assert sum(cs.get(d, 0) for _, t, cs in log if end - w * US < t <= end) <= limit


# ------------------------------------------------------------------------------------------- concurrency
def _items(i):
    return [(f"key:{'ab'[i % 2]}:tpm", 250, 60, 5), ("global:tpm", 400, 60, 5), ("global:rpm", 10_000, 60, 1)]


def _check_concurrent(outcomes, lim):
    """outcomes: (i, allowed, retry_after_s). 200 x 5 tokens demanded, 400 allowed globally."""
    admitted = [i for i, ok, _ in outcomes if ok]
    assert len(outcomes) == 200
    assert 5 * len(admitted) == 400                               # never more, and exactly the limit
    assert all(5 * sum(1 for i in admitted if i % 2 == p) <= 250 for p in (0, 1))
    assert all(r is not None and 0 < r <= 60 for _, ok, r in outcomes if not ok)
    st = lim.status([("global:tpm", 400, 60), ("global:rpm", 10_000, 60)])
    assert st["global:tpm"].remaining == 0 and st["global:rpm"].remaining == 10_000 - 80


def test_barrier_concurrency_threads(backend):
    clients = [backend() for _ in range(200)]       # separate connections (memory: one shared object)
    barrier, out = threading.Barrier(200), []

    def work(i):
        barrier.wait(timeout=60)
        d = clients[i].reserve(_items(i))
        out.append((i, d.allowed, d.retry_after_s))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _check_concurrent(out, clients[0])


def _process_worker(path, barrier, first, n, queue):
    clients = [SqliteLimiter(path) for _ in range(n)]
    out = []

    def work(i):
        barrier.wait(timeout=60)
        d = clients[i - first].reserve(_items(i))
        out.append((i, d.allowed, d.retry_after_s))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(first, first + n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(out)


def test_barrier_concurrency_sqlite_processes(tmp_path):
    """4 processes x 50 threads, each thread with its own connection, released by one barrier."""
    path, ctx = str(tmp_path / "limiter.db"), multiprocessing.get_context("spawn")
    SqliteLimiter(path).close()
    barrier, queue = ctx.Barrier(200), ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=(path, barrier, 50 * p, 50, queue)) for p in range(4)]
    for p in procs:
        p.start()
    out = [x for _ in procs for x in queue.get(timeout=120)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    _check_concurrent(out, SqliteLimiter(path))


# ------------------------------------------------------------------------------------------------- slots
def test_slots_and_lease_expiry(backend, clock):
    a, b = backend(clock), backend(clock)
    s1, s2 = a.acquire_slot("conc:k", 2, 30), a.acquire_slot("conc:k", 2, 30)
    assert s1 and s2 and s1 != s2 and b.acquire_slot("conc:k", 2, 30) is None
    assert b.slots_used("conc:k") == 2 and b.slots_used("conc:other") == 0
    b.release_slot("conc:k", s2)
    b.release_slot("conc:k", s2)
    b.release_slot("conc:k", "no-such-slot")
    s3 = b.acquire_slot("conc:k", 2, 30)
    assert s3 and b.acquire_slot("conc:k", 2, 30) is None
    # The holder of s1 "dies": it never releases nor renews. s3's holder keeps renewing.
    clock.advance(20)
    assert b.renew_slot("conc:k", s3, 30)
    clock.advance(10 - 1e-6)
    assert b.slots_used("conc:k") == 2
    clock.advance(1e-6)                             # s1's lease has run out: its slot is free again
    assert b.slots_used("conc:k") == 1
    assert not a.renew_slot("conc:k", s1, 30)       # a lost lease cannot be renewed
    s4 = b.acquire_slot("conc:k", 2, 30)
    assert s4 and b.acquire_slot("conc:k", 2, 30) is None
    clock.advance(30)                               # s4's lease (from t=30) ends at 60; s3's (renewed at 20) at 50
    assert b.slots_used("conc:k") == 0 and not b.renew_slot("conc:k", s3, 30)


def _die_holding_a_slot(kind, location, prefix, at):
    clock = lambda: at                              # noqa: E731 - the lease starts at `at`, however late this runs
    lim = SqliteLimiter(location, clock=clock) if kind == "sqlite" else RedisLimiter(location, prefix=prefix,
                                                                                     clock=clock)
    assert lim.acquire_slot("conc:dead", 1, 1.0)
    os._exit(0)                                     # no release, no cleanup


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_slot_of_a_dead_process_expires(kind, tmp_path, request):
    """Both processes read injected clocks: a starved machine (the suite's other xdist worker runs at nice 19) once
    took more than the 1 s lease between the child's acquire and this process's first look, on wall clocks."""
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    location, prefix = (str(tmp_path / "l.db") if kind == "sqlite" else url), f"d{uuid.uuid4().hex[:8]}:"
    at = time.time()
    proc = multiprocessing.get_context("fork").Process(target=_die_holding_a_slot, args=(kind, location, prefix, at))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    now = [at + 0.5]                                # half-way through the dead process's lease
    clock = lambda: now[0]                          # noqa: E731
    lim = SqliteLimiter(location, clock=clock) if kind == "sqlite" else RedisLimiter(location, prefix=prefix,
                                                                                     clock=clock)
    assert lim.slots_used("conc:dead") == 1 and lim.acquire_slot("conc:dead", 1, 1.0) is None
    now[0] = at + 1.05                              # the lease is over
    assert lim.acquire_slot("conc:dead", 1, 1.0) is not None
    lim.close()


# ------------------------------------------------------------------------------------------------ quotas
def test_quotas(lim, clock):
    day, month = "budget:k_1:day:2026-11-30", "budget:k_1:month:2026-11"
    items = lambda c: [(day, 100, 86400, c), (month, 150, 30 * 86400, c)]   # noqa: E731
    used = lambda: (lim.quota_used(day), lim.quota_used(month))              # noqa: E731
    assert used() == (0, 0)
    r1 = lim.reserve_quota(items(30))
    assert r1.allowed and r1.reservation_id and r1.retry_after_s is None
    assert r1.descriptors[day].remaining == 70 and r1.descriptors[day].reset_s == 86400.0
    assert r1.descriptors[month].remaining == 120
    clock.advance(100)
    r2, r3 = lim.reserve_quota(items(30)), lim.reserve_quota(items(30))
    assert r3.descriptors[day].reset_s == 86300.0 and used() == (90, 90)
    d = lim.reserve_quota(items(20))
    assert not d.allowed and d.blocking == (day,) and d.retry_after_s is None and not d.too_large
    assert d.descriptors[day].remaining == 10 and used() == (90, 90)     # all-or-nothing
    d = lim.reserve_quota(items(101))
    assert not d.allowed and d.too_large and d.retry_after_s is None
    lim.adjust_quota(r1.reservation_id, 10)
    assert used() == (70, 70)
    lim.adjust_quota(r2.reservation_id, {day: 0})
    assert used() == (40, 70)
    lim.adjust_quota(r3.reservation_id, -5)
    assert used() == (10, 40)
    lim.adjust_quota("no-such-reservation", 0)
    lim.release_quota(r3.reservation_id)
    assert used() == (10, 40)
    d = lim.reserve_quota([(month, 150, 30 * 86400, 110)])
    assert d.allowed and d.descriptors[month].remaining == 0 and used() == (10, 150)
    clock.advance(86400 - 100)                   # the day counter expires (ttl from its first reservation)
    assert used() == (0, 150)
    lim.adjust_quota(r1.reservation_id, 0)       # the day part is stale: no effect; the month part refunds 10
    assert used() == (0, 140)
    d = lim.reserve_quota([(day, 100, 86400, 100)])
    assert d.allowed and d.descriptors[day].reset_s == 86400.0 and used() == (100, 140)
    lim.adjust_quota(r2.reservation_id, 0)       # its day counter is gone; the month part refunds 30
    assert used() == (100, 110)


# ---------------------------------------------------------------------------------------- backend specifics
def test_open_limiter_and_unreachable_redis(tmp_path, redis_server):
    assert isinstance(open_limiter("memory", ""), MemoryLimiter)
    with open_limiter("sqlite", str(tmp_path / "x" / "l.db")) as s:
        assert isinstance(s, SqliteLimiter) and s.reserve([("a", 1, 1, 1)]).allowed
    with open_limiter("redis", redis_server.url, prefix="o:") as r:
        assert isinstance(r, RedisLimiter) and r.reserve([("a", 1, 1, 1)]).allowed
    with pytest.raises(ValueError):
        open_limiter("etcd", "x")
    with pytest.raises(LimiterUnavailable):
        open_limiter("redis", "")
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    with pytest.raises(LimiterUnavailable, match=f"127.0.0.1:{url.rsplit(':', 1)[1][:-2]}") as e:
        open_limiter("redis", url)
    assert "secret" not in str(e.value)


def test_redis_runtime_errors_raise_limiter_unavailable():
    with RedisServer() as srv:
        lim = RedisLimiter(srv.url, clock=Clock())
        assert lim.reserve([("a", 10, 60, 1)]).allowed
        srv.stop()
        for call in (lambda: lim.reserve([("a", 10, 60, 1)]), lambda: lim.status([("a", 10, 60)]),
                     lambda: lim.acquire_slot("s", 1, 1), lambda: lim.quota_used("q")):
            with pytest.raises(LimiterUnavailable, match=str(srv.port)):
                call()
        srv.start()                                        # AOF reloaded; the client reconnects
        for attempt in range(3):                           # (a call may still meet a stale connection)
            try:
                assert lim.reserve([("a", 10, 60, 1)]).allowed
                break
            except LimiterUnavailable:
                assert attempt < 2
        assert remaining(lim, "a", 10) == 8
        lim.close()


def test_redis_running_sum_and_key_expiry(redis_server, clock):
    import redis
    lim, prefix = RedisLimiter(redis_server.url, prefix="rs:", clock=clock), "rs:"
    rids = [lim.reserve([("k", 1000, 60, c)]).reservation_id for c in (5, 7, 11)]
    lim.adjust(rids[1], {"k": 3})
    lim.release(rids[2])
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert int(r.get(prefix + "w:k:s")) == sum(map(int, r.hvals(prefix + "w:k:c"))) == 8
    assert r.zcard(prefix + "w:k:z") == 2 and 60_000 < r.pttl(prefix + "w:k:z") <= 120_000
    clock.advance(60)
    assert remaining(lim, "k", 1000) == 1000 and not r.exists(prefix + "w:k:z", prefix + "w:k:s", prefix + "w:k:c")
    lim.close()


def test_sqlite_prunes_expired_rows(tmp_path, clock):
    path = str(tmp_path / "l.db")
    lim = SqliteLimiter(path, clock=clock)
    for i in range(5):
        lim.reserve([(f"d{i}", 10, 1, 1)])
    lim.reserve_quota([("q", 10, 1, 1)])
    lim.acquire_slot("s", 1, 1)
    rows = lambda: [sqlite3.connect(path).execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]   # noqa: E731
                    for t in ("rl_log", "rl_quota", "rl_quota_res", "rl_slot")]
    assert rows() == [5, 1, 1, 1]
    clock.advance(1)
    lim.reserve([("d0", 10, 1, 1)])                 # prunes its own descriptor as it goes
    assert rows()[0] == 5
    for _ in range(500):                            # and a periodic sweep prunes everything else
        lim.status([("d0", 10, 1)])
    assert rows() == [1, 0, 0, 0]
    lim.close()


def test_sqlite_shared_by_two_clients(tmp_path, clock):
    a, b = SqliteLimiter(str(tmp_path / "l.db"), clock=clock), SqliteLimiter(str(tmp_path / "l.db"), clock=clock)
    r = a.reserve([("k", 10, 60, 7)])
    assert not b.reserve([("k", 10, 60, 4)]).allowed
    b.release(r.reservation_id)
    assert isinstance(a.reserve([("k", 10, 60, 10)]), Decision) and remaining(b, "k", 10) == 0


def test_sqlite_running_sums_match_the_log_and_old_files_migrate(tmp_path, clock):
    """The SQLite backend keeps a running sum per descriptor (no scan of the window per reservation); it always
    equals the sum of the descriptor's logged costs, through reserve/adjust/release/expiry/sweep, and a file
    written before the sums existed gets them built from its log when opened."""
    path = str(tmp_path / "l.db")
    lim = SqliteLimiter(path, clock=clock)
    rng = random.Random(7)
    rids = []

    def check():
        db = sqlite3.connect(path)
        logged = dict(db.execute("SELECT d, SUM(cost) FROM rl_log GROUP BY d").fetchall())
        sums = dict(db.execute("SELECT d, total FROM rl_sum").fetchall())
        db.close()
        assert {d: t for d, t in sums.items() if t} == {d: t for d, t in logged.items() if t}

    for i in range(1200):
        d = f"k{rng.randrange(3)}"
        op = rng.random()
        if op < 0.6:
            dec = lim.reserve([(d, 10_000, 30, rng.randint(1, 50)), ("g", 10_000, 60, 3)])
            if dec.allowed:
                rids.append(dec.reservation_id)
        elif op < 0.85 and rids:
            lim.adjust(rng.choice(rids[-20:]), {d: rng.randint(0, 60), "g": rng.randint(0, 5)})
        elif rids:
            lim.release(rng.choice(rids[-20:]))
        clock.advance(rng.random() * 0.5)
        if i % 100 == 0:
            check()
    check()
    used = 10_000 - remaining(lim, "g", 10_000)
    lim.close()
    db = sqlite3.connect(path)          # an old file: no rl_sum table
    db.execute("DROP TABLE rl_sum")
    db.commit()
    db.close()
    lim = SqliteLimiter(path, clock=clock)
    check()
    assert 10_000 - remaining(lim, "g", 10_000) == used > 0
    lim.close()


def test_sqlite_nonblocking_twin_never_waits_and_shares_state(tmp_path, clock):
    """The connection the gateway uses on its event loop: same state, LimiterBusy at once (no wait) while another
    connection holds the write lock, and no WAL checkpoints (fsyncs) of its own."""
    from qwen_vllm_ext.gateway.limiter import LimiterBusy

    path = str(tmp_path / "l.db")
    lim = SqliteLimiter(path, clock=clock)
    fast = lim.nonblocking()
    assert fast.reserve([("k", 10, 60, 7)]).allowed and remaining(lim, "k", 10) == 3
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    with pytest.raises(LimiterBusy):
        fast.reserve([("k", 10, 60, 1)])
    assert time.monotonic() - started < 0.5
    holder.execute("ROLLBACK")
    holder.close()
    assert fast.reserve([("k", 10, 60, 3)]).allowed and not lim.reserve([("k", 10, 60, 1)]).allowed
    assert fast._sql.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    assert lim._sql.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] > 0
    fast.close()
    lim.close()
