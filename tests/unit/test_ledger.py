"""The usage ledger on real SQLite and a real redis-server (no mocks): identical assertions for both stores."""
from __future__ import annotations

import collections
import csv
from decimal import Decimal
import io
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from qwen_vllm_ext.usage import __main__ as cli
from qwen_vllm_ext.usage.ledger import (STATUSES, LedgerRecord, LedgerUnavailable, LedgerWriteError,
                                        LedgerWriter, RedisLedgerStore, SqliteLedgerStore, open_store, utc_day)
from tests.helpers.ledger import DAY0, KEYS, make
from tests.redis_server import RedisServer, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------- fixtures
class Target:
    """Where a backend's ledger lives; ``open()`` gives a fresh store (as another process would)."""

    def __init__(self, backend: str, location: str):
        self.backend, self.location = backend, location

    def open(self):
        return open_store(self.backend, self.location)


@pytest.fixture(params=["sqlite", "redis"])
def target(request, tmp_path):
    if request.param == "sqlite":
        return Target("sqlite", str(tmp_path / "ledger.sqlite3"))
    server = request.getfixturevalue("redis_server")
    server.flush()
    return Target("redis", server.url)


@pytest.fixture
def store(target):
    s = target.open()
    yield s
    s.close()


def expected_totals(records):
    out = {"requests": len(records), "by_status": {s: 0 for s in STATUSES}}
    for f in ("prompt_tokens", "engine_prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens"):
        out[f] = sum(getattr(r, f) for r in records)
    out["billed_micro"] = sum(r.billed_total_micro for r in records)
    out["cost_pico_usd"] = sum(r.cost_pico_usd for r in records)
    for r in records:
        out["by_status"][r.status] += 1
    return out


# ------------------------------------------------------------------------------------------- records
def test_record_validation_names_the_field():
    make("ok")
    for field, bad in [("status", "done"), ("prompt_tokens", -1), ("cached_tokens", 1.5),
                       ("completion_tokens", True), ("billed_completion_micro", 2**63), ("finished_at", float("nan")),
                       ("ttft_s", -0.1), ("streamed", 1), ("request_id", ""), ("api_key_id", 7)]:
        with pytest.raises(ValueError, match=field):
            make("bad", **{field: bad})
    r = make("x", 3)
    assert r.billed_total_micro == r.billed_prompt_micro + r.billed_completion_micro
    assert LedgerRecord.from_dict({**r.to_dict(), "future_field": 1}) == r


def test_round_trip(store):
    recs = [make("r-1", 1), make("r-2", 2, api_key_id=None, ttft_s=None), make("r-3", 3, finished_at=DAY0 + 0.1)]
    assert store.write_batch(recs) == 3
    for r in recs:
        assert store.get(r.request_id) == r
    assert store.get("missing") is None
    assert store.records() == sorted(recs, key=lambda r: (r.finished_at, r.request_id))
    assert store.records(instance_id="inst-1") == [r for r in store.records() if r.instance_id == "inst-1"]
    assert [r.request_id for r in store.records(since=recs[0].finished_at, until=recs[1].finished_at)] == ["r-1"]
    assert [r.request_id for r in store.records(since=recs[1].finished_at)] == ["r-2"]


def test_duplicates_are_recorded_once(store):
    recs = [make(f"d-{i}", i) for i in range(20)]
    assert store.write_batch(recs) == 20
    before = (store.totals(), store.report("key"), store.daily("key-a", utc_day(DAY0)), store.records())
    assert store.write_batch(recs) == 0
    assert store.write_batch_flags([make("d-3", 3), make("d-new", 99), make("d-new", 99)]) == [False, True, False]
    assert store.write_batch([make("d-5", 5, completion_tokens=10_000)]) == 0   # first write wins
    after = (store.totals(), store.report("key"), store.daily("key-a", utc_day(DAY0)), store.records())
    assert after[0] == expected_totals(recs + [make("d-new", 99)])
    assert store.get("d-5") == recs[5]
    assert after[2] == before[2]


def test_batch_is_all_or_nothing(store):
    recs = [make(f"a-{i}", i) for i in range(5)]
    recs[3].status = "bogus"            # invalid after construction: the whole batch is refused
    with pytest.raises(ValueError, match="status"):
        store.write_batch(recs)
    assert store.records() == [] and store.totals()["requests"] == 0 and store.report("day") == []
    recs[3].status = "stop"
    assert store.write_batch(recs) == 5


def test_daily_aggregates_exact(store):
    recs = [make(f"x-{i}", i) for i in range(3000)]      # ~3.4 days, 4 keys, 2 models, fractional billing
    for i in range(0, len(recs), 250):
        store.write_batch(recs[i:i + 250])
    days = sorted({r.day for r in recs})
    assert len(days) == 4
    for key in KEYS:
        for day in days:
            mine = [r for r in recs if r.api_key_id == key and r.day == day]
            assert store.daily(key, day) == {
                "requests": len(mine), "prompt_tokens": sum(r.prompt_tokens for r in mine),
                "cached_tokens": sum(r.cached_tokens for r in mine),
                "completion_tokens": sum(r.completion_tokens for r in mine),
                "billed_micro": sum(r.billed_total_micro for r in mine),
                "cost_pico_usd": sum(r.cost_pico_usd for r in mine)}
    assert store.daily("nobody", days[0]) == dict.fromkeys(store.daily("nobody", days[0]), 0)
    # the exact figure, where summing floats (INCRBYFLOAT) would drift
    exact = sum(r.billed_total_micro for r in recs)
    assert store.totals()["billed_micro"] == exact
    assert sum(r.completion_tokens * 1.35 for r in recs) * 10**6 != sum(r.billed_completion_micro for r in recs)


def test_totals_by_status_instance_and_since(store):
    recs = [make(f"t-{i}", i) for i in range(101)]
    store.write_batch(recs)
    assert store.totals() == expected_totals(recs)
    assert store.totals()["by_status"] == {s: sum(r.status == s for r in recs) for s in STATUSES}
    assert store.totals(instance_id="inst-0") == expected_totals([r for r in recs if r.instance_id == "inst-0"])
    assert store.totals(instance_id="none") == expected_totals([])
    cut = recs[40].finished_at
    assert store.totals(since=cut) == expected_totals(recs[40:])
    assert store.totals(instance_id="inst-1", since=cut) == expected_totals(
        [r for r in recs[40:] if r.instance_id == "inst-1"])


def _report(by, recs):
    field = {"key": lambda r: r.api_key_id or "", "model": lambda r: r.model, "day": lambda r: r.day,
             "instance": lambda r: r.instance_id}[by]
    out = {}
    for r in recs:
        g = out.setdefault(field(r), {by: field(r), "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                      "completion_tokens": 0, "billed_micro": 0, "cost_pico_usd": 0})
        g["requests"] += 1
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_pico_usd"):
            g[f] += getattr(r, f)
        g["billed_micro"] += r.billed_total_micro
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize("by", ["key", "model", "day", "instance"])
def test_report(store, by):
    recs = [make(f"p-{i}", i) for i in range(2000)]
    for i in range(0, len(recs), 256):        # in the writer's batches: one 2,000-record script can outlast the
        store.write_batch(recs[i:i + 256])    # client's socket timeout while CI's e2e engines hold both cores
    assert store.report(by) == _report(by, recs)
    day1, mid = DAY0 + 86400, DAY0 + 86400 + 3600.5
    # whole days come from the daily aggregates, other bounds from the records: same answers
    assert store.report(by, since=day1) == _report(by, [r for r in recs if r.finished_at >= day1])
    assert store.report(by, since=day1, until=day1 + 86400) == _report(
        by, [r for r in recs if day1 <= r.finished_at < day1 + 86400])
    assert store.report(by, since=mid) == _report(by, [r for r in recs if r.finished_at >= mid])
    with pytest.raises(ValueError):
        store.report("user")


# --------------------------------------------------------------------------------------- concurrency
def _proc_writer(backend, location, p, n, use_writer):
    store = open_store(backend, location)
    recs = [make(f"p{p}-{i}", i) for i in range(n - 100)] + [make(f"shared-{i}", i) for i in range(100)]
    random.Random(p).shuffle(recs)
    if use_writer:
        w = LedgerWriter(store, batch_max=64, spill_dir=os.path.dirname(location) if backend == "sqlite" else "/tmp")
        futures = [w.submit(r) for r in recs]
        assert w.close(60)
        assert all(f.exception() is None for f in futures)
    else:
        for i in range(0, len(recs), 20):
            store.write_batch(recs[i:i + 20])
    store.close()


def test_several_processes_write_the_same_ledger(target):
    target.open().close()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_proc_writer, args=(target.backend, target.location, p, 500, p % 2 == 0))
             for p in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    expected = [make(f"p{p}-{i}", i) for p in range(4) for i in range(400)] + \
               [make(f"shared-{i}", i) for i in range(100)]
    store = target.open()
    try:
        got = store.records()
        assert len(got) == 1700 and len({r.request_id for r in got}) == 1700
        assert store.totals() == expected_totals(expected)
        assert store.report("key") == _report("key", expected)
        assert store.report("day") == _report("day", expected)
    finally:
        store.close()


def test_a_new_ledger_file_opens_while_another_connection_switches_it(tmp_path):
    """API-server processes start together on a fresh data dir and race to switch the new ledger file to WAL.
    SQLite answers the loser "database is locked" at once, without waiting (a CI run saw one of two API servers
    die of it). Made deterministic: another connection holds a write transaction on the new file for 0.5 s; the
    store waits for it and opens."""
    path = tmp_path / "ledger.sqlite3"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE t (x)")
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO t VALUES (1)")
    timer = threading.Timer(0.5, other.execute, ("COMMIT",))
    timer.start()
    began = time.monotonic()
    try:
        store = SqliteLedgerStore(str(path))
    finally:
        timer.join()
        other.close()
    assert time.monotonic() - began >= 0.4  # it waited for the other connection instead of failing
    store.write_batch([make("after-race", 1)])
    assert store.get("after-race") is not None
    store.close()


# --------------------------------------------------------------------------------------------- writer
def test_writer_resolves_futures_after_commit(target, store, tmp_path):
    other = target.open()          # a separate connection: what another process would see
    seen, batches = [], []

    def check(fut, rid):
        seen.append(other.get(rid) is not None and fut.result() is True)

    w = LedgerWriter(store, batch_max=50, linger_s=0.002, spill_dir=str(tmp_path),
                     on_batch=lambda latency, new: batches.append((latency, len(new))))
    recs = [make(f"w-{i}", i) for i in range(300)]
    futures = []
    for r in recs:
        f = w.submit(r)
        f.add_done_callback(lambda f, rid=r.request_id: check(f, rid))
        futures.append(f)
    assert w.flush(30) and w.queue_depth() == 0
    assert all(f.done() for f in futures) and len(seen) == 300 and all(seen)
    assert w.submit(make("w-0", 0)).result(10) is False                       # duplicate
    assert w.committed_total == 300 and w.duplicates_total == 1 and w.failed_total == 0
    assert dict(w.committed_by_status) == {s: 60 for s in STATUSES}
    assert sum(n for _, n in batches) == 300 and max(n for _, n in batches) <= 50 and w.last_batch_latency_s > 0
    bad = make("w-bad", 1)
    bad.prompt_tokens = -5                      # can never be written: fails alone, the batch goes on
    f_bad, f_ok = w.submit(bad), w.submit(make("w-ok", 1))
    with pytest.raises(ValueError, match="prompt_tokens"):
        f_bad.result(10)
    assert f_ok.result(10) is True and w.spilled_total == 0
    assert w.close(10) and w.close(10)
    with pytest.raises(RuntimeError):
        w.submit(make("late", 1))
    assert other.totals() == expected_totals(recs + [make("w-ok", 1)])
    other.close()


def test_writer_spills_on_outage_and_replay_loses_nothing(target, tmp_path):
    spill = tmp_path / "spill"
    if target.backend == "redis":           # a dedicated server we can crash and restart
        server = RedisServer().start()
        location = server.url
        outage, recover = (lambda: server.stop(kill=True)), server.start
    else:
        server, location = None, target.location
        locker = sqlite3.connect(location, isolation_level=None)

        def outage():               # another process holds the write lock for too long
            locker.execute("BEGIN EXCLUSIVE")

        def recover():
            locker.execute("COMMIT")
    try:
        store = SqliteLedgerStore(location, busy_timeout_s=0.05) if server is None else RedisLedgerStore(location)
        counted: collections.Counter = collections.Counter()
        w = LedgerWriter(store, retries=2, backoff_s=0.01, spill_dir=str(spill),
                         on_count=lambda name, n: counted.update({name: n}))
        first = [make(f"s-{i}", i) for i in range(50)]
        assert all(f.result(10) for f in [w.submit(r) for r in first])
        outage()
        second = [make(f"s-{i}", i) for i in range(50, 100)] + first[:10]
        futures = [w.submit(r) for r in second]
        assert w.flush(30)
        for f in futures:
            with pytest.raises(LedgerWriteError) as err:
                f.result()
            assert err.value.spilled_to == w.spill_path
        assert w.failed_total == w.spilled_total == 60
        assert counted == {"failed": 60, "spilled": 60}  # what /metrics counts (qwen_ext_ledger_*_total)
        assert len(open(w.spill_path).readlines()) == 60
        w.close(10)  # the process dies during the outage, its spill file stays
        store.close()
        recover()
        # "restart": a new store and writer replay the spill file
        store = SqliteLedgerStore(location) if server is None else RedisLedgerStore(location)
        w = LedgerWriter(store, spill_dir=str(spill), on_count=lambda name, n: counted.update({name: n}))
        assert w.replay_spill() == 50
        assert counted["replayed"] == 60 and w.replayed_total == 60  # 50 new + 10 already there: all taken
        assert os.listdir(spill) == []
        assert w.replay_spill() == 0
        w.close(10)
        everything = first + second[:50]
        assert store.totals() == expected_totals(everything)
        assert store.report("day") == _report("day", everything)
        store.close()
    finally:
        if server is not None:
            server.cleanup()
        else:
            locker.close()



@pytest.mark.parametrize("trigger", ["next-record", "idle"])
def test_the_same_writer_replays_its_spill_when_redis_is_back(tmp_path, trigger):
    """Redis stops and starts while the server keeps running: the records spilled meanwhile reach the store
    without a restart -- with the next committed batch, or on the idle timer when no request comes."""
    server = RedisServer().start()
    try:
        store = RedisLedgerStore(server.url)
        w = LedgerWriter(store, retries=1, backoff_s=0.01, spill_dir=str(tmp_path), replay_interval_s=0.5)
        assert w.submit(make("r-0", 0)).result(10) is True
        server.stop(kill=True)
        spilled = [make(f"r-{i}", i) for i in range(1, 21)]
        for f in [w.submit(r) for r in spilled]:
            with pytest.raises(LedgerWriteError):
                f.result(30)
        server.start()
        extra = []
        if trigger == "next-record":
            extra = [make("r-after", 99)]
            assert w.submit(extra[0]).result(10) is True
        deadline = time.monotonic() + 20
        # Replayed = committed to the store *and* the claimed spill file removed (the writer unlinks it right after
        # the commit, so the store can answer a moment before the file is gone).
        while store.totals()["requests"] < 21 + len(extra) or os.listdir(tmp_path):
            assert time.monotonic() < deadline, (f"spilled records not replayed: {store.totals()['requests']}, "
                                                 f"files {os.listdir(tmp_path)}")
            time.sleep(0.1)
        assert store.totals() == expected_totals([make("r-0", 0), *spilled, *extra])
        assert os.listdir(tmp_path) == [] and w.replay_spill() == 0
        w.close(10)
        store.close()
    finally:
        server.cleanup()

KILL_CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, sys.argv[4])
    from tests.helpers.ledger import make
    from qwen_vllm_ext.usage.ledger import LedgerWriter, open_store
    w = LedgerWriter(open_store(sys.argv[1], sys.argv[2]), batch_max=16, linger_s=0.001, spill_dir=sys.argv[3])
    lock = threading.Lock()
    def done(fut, rid):
        if fut.exception() is None:
            with lock:
                sys.stdout.write(rid + "\\n")
                sys.stdout.flush()
    i = 0
    while True:
        rid = f"k9-{i:07d}"
        w.submit(make(rid, i)).add_done_callback(lambda f, rid=rid: done(f, rid))
        i += 1
        if i % 20 == 0:
            time.sleep(0.0005)
""")


def test_kill_9_loses_no_acknowledged_record(target, tmp_path):
    target.open().close()
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, target.backend, target.location, str(tmp_path), ROOT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    acked = []
    try:
        for line in proc.stdout:
            acked.append(line)
            if len(acked) >= 800:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        # the rest through the same buffered readers: communicate() reads the raw pipes, after what the loop above
        # read ahead, and a line cut at its head ("000996" of "k9-0000996") read as an acknowledged record lost
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.wait(30)
    acked += io.BytesIO(out).readlines()
    acked = [x.decode().strip() for x in acked if x.endswith(b"\n")]
    assert len(acked) >= 800, err.decode()[-2000:]
    store = target.open()
    try:
        present = {r.request_id for r in store.records()}
        missing = [rid for rid in acked if rid not in present]
        assert missing == []
        assert store.totals()["requests"] == len(present)        # aggregates agree with the records
    finally:
        store.close()


def test_redis_unreachable_is_named():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(LedgerUnavailable, match=url.replace("/", ".")):
        open_store("redis", url)
    with pytest.raises(LedgerUnavailable, match="URL"):
        open_store("redis", "")


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_report(target, store, capsys):
    recs = [make(f"c-{i}", i) for i in range(40)]
    store.write_batch(recs)
    where = ["--db", target.location] if target.backend == "sqlite" else ["--redis-url", target.location]

    assert cli.main(["report", *where]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["key", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "billed",
                                "cost_usd"]
    assert [line.split()[0] for line in table[2:-2]] == ["-", "key-a", "key-b", "key:c"]
    total_billed = sum(r.billed_total_micro for r in recs)
    assert table[-1].split() == ["TOTAL", "40", *(str(sum(getattr(r, f) for r in recs)) for f in
                                 ("prompt_tokens", "cached_tokens", "completion_tokens")),
                                 f"{total_billed // 10**6}.{total_billed % 10**6:06d}",
                                 str(round(Decimal(sum(r.cost_pico_usd for r in recs)) / 10**12, 6))]
    assert len({len(line) for line in table}) == 1                     # aligned columns

    assert cli.main(["report", "--by", "model", "--json", *where]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"] == _report("model", recs) and data["total"]["requests"] == 40

    assert cli.main(["report", "--by", "day", "--csv", "--since", "2025-03-01T00:30:00", *where]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    want = _report("day", [r for r in recs if r.finished_at >= DAY0 + 1800])
    assert [{k: int(v) for k, v in row.items() if k not in ("day", "billed", "cost_usd")} for row in rows] == \
           [{k: v for k, v in w.items() if k != "day"} for w in want]

    assert cli.main(["report", "--days", "1", *where]) == 0            # 2025 is long gone: empty, totals 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["TOTAL", "0"]


def test_cli_module_and_clear_errors(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    s = SqliteLedgerStore(str(path))
    s.write_batch([make("m-1", 1)])
    s.close()
    env = {**os.environ, "QWEN_VLLM_EXT_DATA_DIR": str(tmp_path), "PYTHONPATH": ROOT}
    env.pop("QWEN_VLLM_EXT_SETTINGS", None)
    run = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "report", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["rows"] == _report("key", [make("m-1", 1)])
    assert cli.main(["report", "--db", str(tmp_path / "none.sqlite3")]) == 2
    assert not (tmp_path / "none.sqlite3").exists()
    assert cli.main(["report", "--redis-url", f"redis://127.0.0.1:{free_port()}/0"]) == 2


def test_instance_tokens_and_the_metrics_collector(target, tmp_path):
    """The store's per-instance token totals (what vLLM's counters of that server count) reach /metrics through
    the ledger collector, with the spill backlog; on SQLite, records deleted behind the server's back show at the
    next refresh (the drift alert's test case)."""
    from qwen_vllm_ext.usage.metrics import LedgerCollector

    store = target.open()
    writer = LedgerWriter(store, spill_dir=str(tmp_path))
    try:
        for i, inst in enumerate(("me", "me", "other")):
            writer.submit(make(f"r{i}", i, instance_id=inst, engine_prompt_tokens=100 + i,
                               completion_tokens=10 + i)).result(10)
        assert store.instance_tokens("me") == {"engine_prompt_tokens": 201, "completion_tokens": 21}
        assert store.instance_tokens("nobody") == {"engine_prompt_tokens": 0, "completion_tokens": 0}
        (tmp_path / "ledger-spill-1.jsonl").write_text('{"a": 1}\n{"b": 2}\n\n')
        collector = LedgerCollector(writer, store, "me")
        collector.refresh()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in collector.collect() for s in family.samples}
        assert samples[("qwen_ext_ledger_instance_tokens", (("kind", "engine_prompt"),))] == 201
        assert samples[("qwen_ext_ledger_instance_tokens", (("kind", "completion"),))] == 21
        assert samples[("qwen_ext_ledger_spill_pending_records", ())] == 2
        if target.backend == "sqlite":
            with sqlite3.connect(target.location) as db:
                db.execute("DELETE FROM requests WHERE request_id = 'r1'")
            collector.refresh()
            assert collector.totals == {"engine_prompt_tokens": 100, "completion_tokens": 10}
        class Down:
            def instance_tokens(self, instance_id):
                raise OSError("connection refused")

        collector.store = Down()
        collector.refresh()  # a store that cannot answer: the totals go missing, the scrape still works
        assert collector.totals is None
        names = {f.name for f in collector.collect()}
        assert "qwen_ext_ledger_instance_tokens" in names
    finally:
        writer.close()
        store.close()


def test_health_probes_count_in_the_instance_totals_but_not_in_daily_aggregates_or_reports(store):
    from qwen_vllm_ext.usage.ledger import PROBE_PREFIX

    real = make("real-1", 0, instance_id="me", api_key_id="key-a")
    probe = make(PROBE_PREFIX + "abc", 0, instance_id="me", api_key_id="key-a")
    assert probe.probe and not real.probe
    assert store.write_batch_flags([real, probe]) == [True, True]
    # the engine did the probe's work: the drift signal must see it
    assert store.instance_tokens("me") == {
        "engine_prompt_tokens": real.engine_prompt_tokens + probe.engine_prompt_tokens,
        "completion_tokens": real.completion_tokens + probe.completion_tokens}
    assert store.get(probe.request_id) is not None
    assert store.daily("key-a", real.day)["requests"] == 1
    for by in ("key", "day", "model"):
        (row,) = store.report(by)
        assert row["requests"] == 1 and row["prompt_tokens"] == real.prompt_tokens, (by, row)
        (row,) = store.report(by, include_probes=True)
        assert row["requests"] == 2, (by, row)
    assert sum(r["requests"] for r in store.report("instance")) == 1
