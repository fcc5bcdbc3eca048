"""Batch counting over threads: count_tokens_batch / encode_batch give exactly the one-at-a-time results, in order,
for every thread count; bad input is named; the GIL is released; concurrent callers and forked children work."""
import multiprocessing
import os
import random
import sys
import threading
import time

import pytest

import qwen_v3_calculator as qc
from qwen_v3_calculator import Calculator, count_tokens, count_tokens_batch, encode, encode_batch
from qwen_v3_calculator.tokenizer import Tokenizer, cgroup_cpu_limit, resolve_threads

MIN_PARALLEL = 65536  # code points (_core.pyx): smaller batches run in the calling thread


def _texts(seed: int, n: int) -> list[str]:
    """Every representation CPython has (1-byte ASCII and Latin-1, 2-byte CJK, 4-byte emoji), added tokens,
    empty strings and a few long texts, shuffled."""
    rnd = random.Random(seed)
    words = ["hello", " world", "def", " f(x):", "\n    return", " 1234", "café", " naïve", "北京", "的", "财报",
             "净利润", "😀", "🚀🚀", " <|im_start|>", "<|im_end|>\n", "<think>", "\t", "  ", "'s", "'ll", "Ω≈ç",
             "한국어", "\u0301e", "Ａ１"]
    out = []
    for i in range(n):
        k = 0 if i % 97 == 0 else rnd.randint(1, 60) if i % 31 else rnd.randint(2000, 6000)
        out.append("".join(rnd.choice(words) for _ in range(k)))
    return out


@pytest.fixture(scope="module")
def texts():
    t = _texts(20261202, 3000)
    assert sum(map(len, t)) > 4 * MIN_PARALLEL  # the threaded path, not the small-batch shortcut
    return t


@pytest.fixture(scope="module")
def one_at_a_time(texts):
    return [count_tokens(t) for t in texts], [encode(t) for t in texts]


def _pool_threads():
    return [t for t in threading.enumerate() if t.name.startswith("qwen_v3_calculator")]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_batches_equal_one_at_a_time_in_order(texts, one_at_a_time, threads):
    counts, ids = one_at_a_time
    assert count_tokens_batch(texts, threads=threads) == counts
    assert encode_batch(texts, threads=threads) == ids
    if threads > 1:  # the work went to the pool, sized for the helpers asked for; its threads start on demand (a
        # helper that finds the work taken goes idle and is reused), so on a busy host fewer than that may exist
        from qwen_v3_calculator import _core

        assert _pool_threads() and _core._POOL._max_workers >= threads - 1


def test_default_threads_are_the_cores_this_process_may_use(texts, one_at_a_time):
    limit = cgroup_cpu_limit()
    cores = len(os.sched_getaffinity(0))
    assert resolve_threads(None) == (min(cores, limit) if limit else cores)
    assert count_tokens_batch(texts) == one_at_a_time[0]
    assert Calculator().count_tokens_batch(tuple(texts)) == one_at_a_time[0]  # any sequence, any calculator
    assert Tokenizer.bundled().encode_batch(iter(texts[:50]), threads=2) == one_at_a_time[1][:50]


def test_a_container_cpu_quota_caps_the_default(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(v2)) == 2                  # 1.5 CPUs -> 2 threads
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2)) is None               # no quota
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(str(v1)) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None
    import qwen_v3_calculator.tokenizer as tk
    monkeypatch.setattr(tk, "cgroup_cpu_limit", lambda: 1)
    assert resolve_threads(None) == 1


def test_small_and_empty_batches(texts, one_at_a_time):
    assert count_tokens_batch([]) == [] and encode_batch([], threads=4) == []
    assert count_tokens_batch(texts[:5], threads=4) == one_at_a_time[0][:5]
    assert count_tokens_batch(["hello world"] * 3, threads=2) == [2, 2, 2]


@pytest.mark.parametrize("threads", [1, 2])
def test_bad_input_is_named(texts, threads):
    big = texts + [7]
    with pytest.raises(TypeError, match=rf"texts\[{len(texts)}\] must be str, not int"):
        count_tokens_batch(big, threads=threads)
    with pytest.raises(TypeError, match=r"texts\[1\] must be str, not bytes"):
        encode_batch(["ok", b"no"], threads=threads)
    with pytest.raises(TypeError, match="texts must be a sequence of str, not a single str"):
        count_tokens_batch("one string", threads=threads)
    with pytest.raises(TypeError, match="not iterable"):
        count_tokens_batch(5, threads=threads)


def test_bad_thread_counts_are_named():
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        count_tokens_batch(["a"], threads=0)
    for bad in ("2", 1.5, True):
        with pytest.raises(TypeError, match="threads must be an int or None"):
            encode_batch(["a"], threads=bad)


@pytest.mark.parametrize("threads", [1, 2])
def test_lone_surrogates_name_the_first_bad_text(texts, one_at_a_time, threads):
    bad = list(texts)
    bad[2000] = "北京\ud800x"     # 2-byte representation
    bad[1500] = "😀ab\udfff"      # 4-byte representation
    with pytest.raises(ValueError, match=r"texts\[1500\] contains a lone surrogate at index 3 \(U\+DFFF\)"):
        count_tokens_batch(bad, threads=threads)
    with pytest.raises(ValueError, match=r"texts\[1500\] contains a lone surrogate"):
        encode_batch(bad, threads=threads)
    assert count_tokens_batch(texts, threads=threads) == one_at_a_time[0]  # nothing left behind
    with pytest.raises(ValueError, match=r"text contains a lone surrogate at index 2 \(U\+D800\)"):
        count_tokens("北京\ud800x")


def test_the_gil_is_released_while_threads_count(texts):
    """With a two-second switch interval, a batch holding the GIL (as threads=1 does, like count_tokens) would keep
    this thread from waking up until it ends; with threads=2 it wakes up every half millisecond meanwhile."""
    long_batch = texts * 10  # long enough (~0.1-0.5 s here) that the count does not hinge on how fast the host is today
    started, done = threading.Event(), threading.Event()

    def work():
        started.set()
        count_tokens_batch(long_batch, threads=2)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    wakeups = 0
    t0 = time.perf_counter()
    try:
        th = threading.Thread(target=work)
        th.start()
        started.wait(60)
        while not done.is_set():
            time.sleep(0.0005)
            wakeups += 1
        th.join()
    finally:
        sys.setswitchinterval(old)
    elapsed = time.perf_counter() - t0
    # holding the GIL would allow one or two wakeups in all; released, there is one every few milliseconds at worst
    assert wakeups >= 50, (wakeups, elapsed)


def test_concurrent_callers_share_one_tokenizer(texts, one_at_a_time):
    calc = qc.default_calculator()
    results, errors = {}, []

    def caller(k):
        try:
            results[k] = calc.count_tokens_batch(texts, threads=2)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ths = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for th in ths:
        th.start()
    singles = [calc.count_tokens(t) for t in texts[:300]]  # the engine itself, meanwhile
    for th in ths:
        th.join()
    assert not errors and all(results[k] == one_at_a_time[0] for k in range(3))
    assert singles == one_at_a_time[0][:300]


def test_a_batch_does_not_wait_for_a_helper_that_cannot_start(texts, one_at_a_time):
    """Every thread of the batch pool is kept busy (as by other tokenizers' batches): a threaded batch is then
    drained by the calling thread alone, closed, and returned -- it does not wait for its helper's turn in the
    pool. The helper's late turn finds the batch closed and leaves it alone; later batches are exact."""
    from qwen_v3_calculator import _core

    pool = _core._thread_pool(1)
    busy = pool._max_workers
    release, started = threading.Event(), threading.Semaphore(0)

    def block():
        started.release()
        release.wait(60)

    blockers = [pool.submit(block) for _ in range(busy)]
    for _ in range(busy):
        assert started.acquire(timeout=30)
    safety = threading.Timer(30, release.set)  # the old behaviour would wait until this fires
    safety.start()
    try:
        t0 = time.monotonic()
        got_counts = count_tokens_batch(texts, threads=2)
        got_ids = encode_batch(texts, threads=2)
        elapsed = time.monotonic() - t0
        assert not release.is_set(), f"the batch waited for the busy pool ({elapsed:.1f} s)"
    finally:
        release.set()
        safety.cancel()
    for f in blockers:
        f.result(timeout=30)
    pool.submit(int).result(timeout=30)  # the pool runs again (stale helper turns included)
    assert got_counts == one_at_a_time[0] and got_ids == one_at_a_time[1]
    assert count_tokens_batch(texts, threads=2) == one_at_a_time[0]
    assert encode_batch(texts, threads=2) == one_at_a_time[1]


def _child(conn, texts):
    conn.send(count_tokens_batch(texts, threads=2))
    conn.close()


def test_a_forked_child_counts_with_threads_too(texts, one_at_a_time):
    count_tokens_batch(texts, threads=2)  # the parent's pool exists; the child gets a copy without threads
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child, texts))
    p.start()
    assert parent.poll(120), "forked child did not answer"
    assert parent.recv() == one_at_a_time[0]
    p.join(30)
    assert p.exitcode == 0


def test_helpers_follow_the_engines_options_and_added_tokens():
    tok = Tokenizer.bundled()
    texts = ["hello <|im_end|> 北京 café"] * 8000
    with_added = tok.count_batch(texts, threads=2)       # creates the helper engines
    tok._engine.set_added_tokens([])                     # then the engine changes
    assert tok.count_batch(texts, threads=2) == tok.count_batch(texts, threads=1) == [tok.count(texts[0])] * 8000
    assert tok.count(texts[0]) > with_added[0]           # "<|im_end|>" is plain text now


def test_batch_helpers_share_the_engines_piece_cache():
    """The helper engines of a threaded batch use their engine's piece cache: after a batch on two threads, one
    pass of the engine itself over the same texts finds nearly every piece cached (with caches of their own
    it would find none of them: the engine never saw these texts)."""
    rnd = random.Random(7)
    words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(3, 9))) for _ in range(4000)]
    texts = [" ".join(rnd.choice(words) for _ in range(40)) for _ in range(3000)]
    assert sum(map(len, texts)) > MIN_PARALLEL
    fresh = Tokenizer.bundled()
    fresh.count_batch(texts, threads=1)
    cold = fresh._engine.piece_cache_misses              # a cold cache misses every distinct piece once
    fresh.count_batch(texts, threads=1)
    floor = fresh._engine.piece_cache_misses - cold      # a warm one: pieces of more ids than an entry holds
    assert cold - floor >= 4000
    tok = Tokenizer.bundled()
    engine = tok._engine
    counts = tok.count_batch(texts, threads=2)           # the helpers tokenize every text (the engine: none)
    before = engine.piece_cache_misses
    assert tok.count_batch(texts, threads=1) == counts   # now the engine itself, in this thread
    assert engine.piece_cache_misses - before <= floor + 40   # warm, but for a few pieces evicted meanwhile


def test_a_shared_cache_under_concurrent_writers_gives_exact_results():
    """More distinct pieces than the piece cache holds, counted by a batch on two threads (two writers into one
    cache) while a third thread counts on the engine itself (a third writer): every result of every round equals
    the counts (ids) of a tokenizer used by one thread only. A reader that kept a cache entry another thread was
    rewriting would miscount."""
    rnd = random.Random(11)
    words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyzäöü北京的") for _ in range(rnd.randint(2, 12)))
             for _ in range(300_000)]  # 147,840 words used; the cache: 131,072 entries
    texts = [" ".join(rnd.choice(words) for _ in range(60)) for _ in range(4000)]
    single_threaded = Tokenizer.bundled()
    want, want_ids = single_threaded.count_batch(texts, threads=1), single_threaded.encode_batch(texts, threads=1)
    tok = Tokenizer.bundled()
    stop, errors, singles = threading.Event(), [], []

    def single():
        k = 0
        while not stop.is_set():
            got = tok.count(texts[k % len(texts)])
            if got != want[k % len(texts)]:
                errors.append((k, got))
            singles.append(k)
            k += 1

    th = threading.Thread(target=single)
    th.start()
    try:
        for r in range(12):   # counting reads an entry's id count, encoding its ids too
            if r % 3:
                assert tok.count_batch(texts, threads=2) == want
            else:
                assert tok.encode_batch(texts, threads=2) == want_ids
    finally:
        stop.set()
        th.join()
    assert not errors and singles
