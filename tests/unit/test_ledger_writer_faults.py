"""The ledger writer cannot die: records SQLite cannot store go to the dead letter while the rest of their batch is
written, errors inside the writer thread (EMFILE during a spill replay) are survived, a thread that ends all the
same releases every caller, close() is bounded and spills what it could not commit, /health fails on a stopped
writer and /qwen_ext/health reports the spill. Real SQLite throughout; wrappers only inject the faults."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
import threading
import time

import pytest

from qwen_vllm_ext.usage.ledger import (LedgerDeadLettered, LedgerRecord, LedgerWriteError, LedgerWriter,
                                        SqliteLedgerStore)
from qwen_vllm_ext.usage.ledger import writer as writer_module
from qwen_vllm_ext.usage.ledger.writer import read_dead_letter
from tests.helpers.ledger import make


class Unchecked(LedgerRecord):
    """A record whose strings are not checked before the store (what every record was before validate() refused
    lone surrogates and NULs): SQLite itself refuses it when it binds the string."""

    def validate(self) -> None:
        self._check_shape()


class Faulty:
    """A real SQLite store with injectable faults: ``fail`` (an exception to raise on the next calls), ``hang`` (an
    event the next call waits for)."""

    def __init__(self, store: SqliteLedgerStore):
        self.store, self.url, self.default_spill_dir = store, store.url, store.default_spill_dir
        self.transient_errors, self.record_errors = store.transient_errors, store.record_errors
        self.fail: BaseException | None = None
        self.fail_times = 0
        self.hang: threading.Event | None = None
        self.entered = threading.Event()
        self.calls = 0

    def write_batch_flags(self, records):
        self.calls += 1
        self.entered.set()
        if self.hang is not None:
            self.hang.wait(30)
        if self.fail is not None and self.fail_times > 0:
            self.fail_times -= 1
            raise self.fail
        return self.store.write_batch_flags(records)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.fixture
def store(tmp_path):
    s = SqliteLedgerStore(str(tmp_path / "ledger.sqlite3"))
    yield s
    s.close()


def spill_files(d) -> list[str]:
    return sorted(p for p in os.listdir(d) if p.startswith("ledger-spill-"))


def wait_until(cond, timeout=10.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field", ["request_id", "instance_id", "model", "endpoint", "api_key_id", "conversation_id"])
@pytest.mark.parametrize("bad", ["x\ud800y", "x\x00y"])
def test_validate_refuses_lone_surrogates_and_nul_in_every_string_field(field, bad):
    record = make("ok", 1, **{field: bad})  # construction checks the shape only: such a record exists...
    with pytest.raises(ValueError, match=field):
        record.validate()                    # ...and is refused before any store sees it
    make("ok", 1, **{field: "ünïcödé 模型 🙂"}).validate()


# ------------------------------------------------------------------------------------------- dead letter
def test_a_record_sqlite_cannot_store_goes_to_the_dead_letter_and_the_rest_of_its_batch_is_written(store, tmp_path):
    w = LedgerWriter(store, spill_dir=str(tmp_path), linger_s=0.2)
    good = [make(f"g-{i}", i) for i in range(6)]
    bad = [make("bad-surrogate", 1, model="\ud800"), make("bad-nul", 2, conversation_id="a\x00b"),
           Unchecked(**{**make("bad-unchecked", 3).to_dict(), "api_key_id": "k\udcff"})]
    futures = [w.submit(r) for r in good[:3] + bad + good[3:]]  # one batch (linger 0.2 s)
    assert [f.result(10) for f in futures[:3] + futures[6:]] == [True] * 6
    for f, why in zip(futures[3:6], ("model", "conversation_id", "refused by the store: UnicodeEncodeError")):
        with pytest.raises(LedgerDeadLettered, match=why) as err:
            f.result(10)
        assert err.value.spilled_to == w.dead_letter_path and isinstance(err.value, ValueError)
    assert store.totals()["requests"] == 6 and w.batches_total >= 1
    assert spill_files(tmp_path) == [] and w.spilled_total == 0 and w.dead_lettered_total == 3
    entries = read_dead_letter(w.dead_letter_path)
    assert [e["record"]["request_id"] for e in entries] == ["bad-surrogate", "bad-nul", "bad-unchecked"]
    assert entries[0]["record"]["model"] == "\ud800"            # the lone surrogate survives (as a JSON escape)
    assert entries[2]["record"]["api_key_id"] == "k\udcff"
    assert all(e["reason"] and e["pid"] == os.getpid() and e["at"] > 0 for e in entries)
    assert open(w.dead_letter_path, "rb").read().isascii()
    assert w.close(5)


def test_a_store_that_refuses_everything_is_not_taken_for_bad_records(store, tmp_path):
    """A non-transient error on every record (a broken store, not bad records): spilled for replay, not
    dead-lettered."""
    faulty = Faulty(store)
    faulty.fail, faulty.fail_times = RuntimeError("the store is broken"), 10**6
    w = LedgerWriter(faulty, spill_dir=str(tmp_path), linger_s=0.1)
    futures = [w.submit(make(f"b-{i}", i)) for i in range(4)]
    for f in futures:
        with pytest.raises(LedgerWriteError) as err:
            f.result(10)
        assert not isinstance(err.value, LedgerDeadLettered) and err.value.spilled_to == w.spill_path
    assert w.dead_lettered_total == 0 and not os.path.exists(w.dead_letter_path)
    faulty.fail_times = 0
    w.close(5)
    again = LedgerWriter(store, spill_dir=str(tmp_path))
    assert again.replay_spill() == 4 and spill_files(tmp_path) == []
    again.close(5)


def test_replaying_a_spill_with_a_poison_record_dead_letters_it_instead_of_spilling_it_forever(store, tmp_path):
    """What the writer used to spill for a record SQLite cannot store (and a torn last line): the next start
    replays the rest and dead-letters those, once; the spill file is gone."""
    spill = tmp_path / "ledger-spill-4242.jsonl"
    good = [make(f"p-{i}", i) for i in range(5)]
    lines = [json.dumps(r.to_dict()) for r in good[:2]]
    lines.append(json.dumps({**make("poison", 9).to_dict(), "model": "\ud800"}))  # escaped as the spill writes it
    lines += [json.dumps(r.to_dict()) for r in good[2:]]
    spill.write_text("\n".join(lines) + '\n{"request_id": "torn", "inst')
    w = LedgerWriter(store, spill_dir=str(tmp_path))
    assert w.replay_spill() == 5
    assert spill_files(tmp_path) == [] and store.totals()["requests"] == 5
    (torn,), (poison,) = [[e for e in read_dead_letter(w.dead_letter_path) if key in e] for key in ("line", "record")]
    assert poison["record"]["request_id"] == "poison" and "model" in poison["reason"]
    assert torn["line"].startswith('{"request_id": "torn"') and "unreadable" in torn["reason"]
    assert w.replay_spill() == 0 and len(read_dead_letter(w.dead_letter_path)) == 2
    w.close(5)


def test_the_idle_replay_of_its_own_spill_dead_letters_records_the_store_refuses(store, tmp_path):
    """The running writer's own replay (every replay_interval_s): a poison record spilled during an outage is
    dead-lettered when the store is back, the others are written, nothing is spilled again."""
    faulty = Faulty(store)
    faulty.fail, faulty.fail_times = sqlite3.OperationalError("database is locked"), 10**6
    w = LedgerWriter(faulty, spill_dir=str(tmp_path), retries=0, linger_s=0.1, replay_interval_s=0.2)
    recs = [make(f"i-{i}", i) for i in range(4)] + [Unchecked(**{**make("i-poison", 7).to_dict(), "model": "\ud800"})]
    for f in [w.submit(r) for r in recs]:
        with pytest.raises(LedgerWriteError):
            f.result(10)
    assert spill_files(tmp_path) == [os.path.basename(w.spill_path)]
    faulty.fail_times = 0                                   # the store answers again
    wait_until(lambda: store.totals()["requests"] == 4 and not spill_files(tmp_path), what="the replay")
    time.sleep(0.5)                                         # a few more replay intervals: nothing comes back
    assert spill_files(tmp_path) == [] and w.dead_lettered_total == 1 and w.replayed_total == 4
    (entry,) = read_dead_letter(w.dead_letter_path)
    assert entry["record"]["request_id"] == "i-poison" and "model" in entry["reason"]
    assert w.alive and w.close(5)


# ------------------------------------------------------------------------------------------- the thread survives
def test_too_many_open_files_during_the_idle_replay_does_not_kill_the_writer(store, tmp_path, monkeypatch):
    counted = []
    faulty = Faulty(store)
    faulty.fail, faulty.fail_times = sqlite3.OperationalError("database is locked"), 1
    w = LedgerWriter(faulty, spill_dir=str(tmp_path), retries=0, replay_interval_s=0.2,
                     on_count=lambda name, n: counted.append(name))
    with pytest.raises(LedgerWriteError):
        w.submit(make("e-0", 0)).result(10)                # spilled: the idle replay is due in 0.2 s
    real_read, failures = writer_module._read_spill, []

    def emfile(path):
        if len(failures) < 2:
            failures.append(path)
            raise OSError(errno.EMFILE, "Too many open files", path)
        return real_read(path)

    monkeypatch.setattr(writer_module, "_read_spill", emfile)
    wait_until(lambda: len(failures) == 2, what="two failed replays")
    wait_until(lambda: store.get("e-0") is not None, what="the replay after the fd shortage")
    assert w.alive and w.stopped_reason is None and w.errors_total == 2 and counted.count("errors") == 2
    wait_until(lambda: not spill_files(tmp_path), what="the claimed file removed")
    assert w.submit(make("e-1", 1)).result(10) is True
    assert w.close(5) and not w.alive and w.stopped_reason == "closed"


def test_a_writer_thread_that_ends_anyway_releases_every_caller_and_loses_nothing(store, tmp_path):
    class Fatal(BaseException):
        pass

    faulty, stops = Faulty(store), []
    faulty.hang = threading.Event()
    faulty.fail, faulty.fail_times = Fatal("out of the loop"), 1
    w = LedgerWriter(faulty, spill_dir=str(tmp_path), on_stop=stops.append)
    first = w.submit(make("d-0", 0))
    assert faulty.entered.wait(10)
    queued = [w.submit(make(f"d-{i}", i)) for i in range(1, 6)]
    faulty.hang.set()                                        # the store call ends with a BaseException
    wait_until(lambda: not w.alive and stops, what="the thread's end and its on_stop call")  # alive turns False first
    assert "Fatal" in w.stopped_reason and stops == [w.stopped_reason]
    for f in [first, *queued]:
        with pytest.raises(LedgerWriteError) as err:
            f.result(1)
        assert err.value.spilled_to == w.spill_path
    t0 = time.monotonic()
    late = w.submit(make("d-late", 7))                        # no thread: spilled at once, never a hang
    assert late.done() and isinstance(late.exception(), LedgerWriteError) and time.monotonic() - t0 < 1
    assert w.flush(1) and w.queue_depth() == 0 and w.close(1)
    assert len(open(w.spill_path).readlines()) == 7
    faulty.hang = None
    again = LedgerWriter(store, spill_dir=str(tmp_path))
    assert again.replay_spill() == 7 and store.totals()["requests"] == 7
    again.close(5)


def test_close_is_bounded_with_a_hung_store_and_spills_what_it_could_not_commit(store, tmp_path):
    faulty = Faulty(store)
    w = LedgerWriter(faulty, spill_dir=str(tmp_path), batch_max=4)
    assert w.submit(make("h-0", 0)).result(10) is True
    faulty.hang, faulty.entered = threading.Event(), threading.Event()
    futures = [w.submit(make(f"h-{i}", i)) for i in range(1, 22)]
    assert faulty.entered.wait(10)                          # a batch is in the store's hands, the rest queued
    t0 = time.monotonic()
    assert w.close(1.0) is False
    assert time.monotonic() - t0 < 2.5
    for f in futures:
        with pytest.raises(LedgerWriteError, match="closed before the store answered"):
            f.result(0)
    spilled = [json.loads(x)["request_id"] for p in spill_files(tmp_path) for x in open(tmp_path / p)]
    assert sorted(spilled) == sorted(f"h-{i}" for i in range(1, 22))
    faulty.hang.set()                                       # the store answers after all: counted once anyway
    wait_until(lambda: not w._thread.is_alive(), what="the thread's exit")
    faulty.hang = None
    again = LedgerWriter(store, spill_dir=str(tmp_path))
    again.replay_spill()
    assert spill_files(tmp_path) == [] and store.totals()["requests"] == 22
    again.close(5)


def test_close_defaults_to_a_bound():
    import inspect

    assert inspect.signature(LedgerWriter.close).parameters["timeout"].default == writer_module.CLOSE_TIMEOUT_S <= 5


# ------------------------------------------------------------------------------------------- health and metrics
def _asgi_get(app, path: str, method: str = "GET"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": []}, receive, send))
    return sent


def test_vllm_health_fails_while_the_ledger_writer_is_stopped(store, tmp_path):
    from qwen_vllm_ext.usage.health import LedgerHealthGate

    async def vllm(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    w = LedgerWriter(store, spill_dir=str(tmp_path))
    gate = LedgerHealthGate(vllm, w)
    assert _asgi_get(gate, "/health")[0]["status"] == 200
    w.close(5)                                              # (a crashed thread looks the same: alive is False)
    start, body = _asgi_get(gate, "/health")
    assert start["status"] == 503 and json.loads(body["body"])["error"]["code"] == "ledger_writer_stopped"
    assert _asgi_get(gate, "/health", "HEAD")[0]["status"] == 503
    assert _asgi_get(gate, "/v1/models")[0]["status"] == 200  # nothing else is touched


def test_qwen_ext_health_reports_the_spill_as_not_ready_and_metrics_count_dead_letters(store, tmp_path):
    from prometheus_client import REGISTRY

    from qwen_vllm_ext.usage.metrics import LedgerCollector, observe_writer

    def sample(name):
        return REGISTRY.get_sample_value(name) or 0.0

    before = {n: sample(n) for n in ("qwen_ext_ledger_dead_lettered_records_total",
                                      "qwen_ext_ledger_spilled_records_total")}
    faulty = Faulty(store)
    w = LedgerWriter(faulty, spill_dir=str(tmp_path), retries=0, replay_interval_s=3600, on_count=observe_writer)
    collector = LedgerCollector(w, faulty, "me")
    collector.refresh()
    health = collector.health()
    assert health["ready"] and health["writer_alive"] and health["spill_pending_records"] == 0
    assert sample("qwen_ext_ledger_writer_up") == 1
    with pytest.raises(LedgerDeadLettered):
        w.submit(make("m-bad", 1, model="\ud800")).result(10)
    faulty.fail, faulty.fail_times = sqlite3.OperationalError("database is locked"), 1
    with pytest.raises(LedgerWriteError):
        w.submit(make("m-spilled", 2)).result(10)
    collector.refresh()
    health = collector.health()
    assert not health["ready"] and health["spill_growing"] and health["writer_alive"]
    assert health["spill_pending_records"] == 1 and health["spill_pending_bytes"] > 0
    assert health["dead_letter_records"] == 1 and health["dead_lettered_total"] == 1
    assert sample("qwen_ext_ledger_dead_lettered_records_total") == before[
        "qwen_ext_ledger_dead_lettered_records_total"] + 1
    assert sample("qwen_ext_ledger_spilled_records_total") == before["qwen_ext_ledger_spilled_records_total"] + 1
    w.close(5)
    collector.refresh()
    assert not collector.health()["writer_alive"] and sample("qwen_ext_ledger_writer_up") == 0


SIGTERM_CHILD = """
import signal, sys, threading, time
sys.path.insert(0, sys.argv[2])
from tests.helpers.ledger import make
from qwen_vllm_ext.usage.ledger import LedgerWriter, SqliteLedgerStore

class Hung(SqliteLedgerStore):
    calls = 0
    def write_batch_flags(self, records):
        Hung.calls += 1
        if Hung.calls > 1:
            time.sleep(3600)          # the store stops answering
        return super().write_batch_flags(records)

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # what uvicorn does: the interpreter exits, atexit runs
w = LedgerWriter(Hung(sys.argv[1] + "/ledger.sqlite3"), spill_dir=sys.argv[1], batch_max=8)
w.submit(make("t-0", 0)).result(10)
futures = [w.submit(make(f"t-{i}", i)) for i in range(1, 41)]
print("ready", flush=True)
time.sleep(3600)
"""


def test_sigterm_exits_within_the_bound_and_spills_what_a_hung_store_holds(tmp_path):
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, str(tmp_path), root], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=root)
    try:
        assert proc.stdout.readline().strip() == b"ready", proc.stderr.read().decode()[-2000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.communicate()
    assert took < writer_module.CLOSE_TIMEOUT_S + 3, took
    spilled = {json.loads(x)["request_id"] for p in spill_files(tmp_path) for x in open(tmp_path / p)}
    assert spilled == {f"t-{i}" for i in range(1, 41)}      # nothing admitted is lost
    store = SqliteLedgerStore(str(tmp_path / "ledger.sqlite3"))
    try:
        again = LedgerWriter(store, spill_dir=str(tmp_path))
        assert again.replay_spill() == 40 and store.totals()["requests"] == 41
        again.close(5)
    finally:
        store.close()
