"""The calculator benchmark's batch section (benchmarks/bench_calculator.py): its workloads, its measurement (real
threads, every result checked against one call per text) and how the report judges the target."""
import random

from benchmarks import bench_calculator as bench


def _corpus():
    rnd = random.Random(7)
    words = ["alpha", " beta", " 北京", "财报", " def f():", "\n", "😀", " café"]
    doc = lambda n: "".join(rnd.choice(words) for _ in range(n))  # noqa: E731
    return {"slices": {"chat": [doc(rnd.randint(1, 40)) for _ in range(3000)],
                       "mixed": [doc(rnd.randint(200, 800)) for _ in range(64)]},
            "warmup": [doc(500) for _ in range(40)]}


def test_workloads_are_the_chat_messages_and_sixteen_long_documents():
    corpus = _corpus()
    w = bench.batch_inputs(corpus)
    assert w["chat"] == corpus["slices"]["chat"]
    assert len(w["docs"]) == bench.BATCH_DOCS and "\n".join(w["docs"]) == "\n".join(corpus["slices"]["mixed"])


def test_the_batch_worker_checks_every_result_and_the_report_judges_the_target(monkeypatch):
    from benchmarks.calculator_bench import workers

    monkeypatch.setattr(workers, "BATCH_ROUNDS", 2)
    out = bench.batch_worker(_corpus(), "")
    assert out["threads"] >= 1 and out["rounds"] == 2
    for w in out["workloads"].values():
        for fn in ("count_tokens_batch", "encode_batch"):
            for state in ("first_pass", "warm"):
                r = w[fn][state]
                assert r["identical"] is True and len(r["speedups"]) == 2 and r["speedup_median"] > 0
                # what the machine gave the same threads right after (probe loop), and the host's steal meanwhile
                assert len(r["machine_speedups"]) == 2 and all(x > 0 for x in r["machine_speedups"])
                assert r["steal_s"] is None or r["steal_s"] >= 0
    summary = {bench.HEADLINE: {}, "tiktoken": {}}
    corpus = {"stats": {sl: {"docs": 0, "bytes": 0, "chars": 0, "cjk_char_share": 0, "by_kind": {}, "mix": {}}
                        for sl in bench.SLICES}, "makeup": {}, "notes": [], "warnings": [], "recipe": "r", "seed": 1,
              "sha256": "x"}
    meta = {"cpu": 0, "python": "3", "quick": True, "trials": 1, "clock": "cpu", "loadavg_start": "", "loadavg": ""}
    text, extra = bench.report(corpus, summary, {}, {}, meta, out)
    assert "Batch calls over threads" in text
    m = out["workloads"]["chat"]["count_tokens_batch"]["warm"]["machine_speedup_median"]
    assert f"machine {m:.2f}x" in text
    rows = {t["target"].split(" (")[0]: t for t in extra["targets"]}
    speedup = next(t for name, t in rows.items() if "count_tokens_batch throughput" in name)
    if out["threads"] > 1:
        medians = [w["count_tokens_batch"][s]["speedup_median"] for w in out["workloads"].values()
                   for s in ("first_pass", "warm")]
        assert speedup["pass"] is (min(medians) >= bench.TARGETS["batch_speedup"])
    else:
        assert speedup["pass"] is None
    assert rows["batch results identical to one call per text, in order"]["pass"] is True


def test_the_machine_probe_and_the_steal_counter():
    from qwen_v3_calculator import _core

    a, sec = _core._probe(0, 200_000)
    assert (a, sec > 0) == (_core._probe(0, 200_000)[0], True)  # arithmetic only: a fixed checksum
    b, sec = _core._probe(1 << 20, 200_000)                      # plus reads of a zeroed table, touched first
    assert sec > 0 and isinstance(b, int)
    probe = bench.MachineProbe(2)
    try:
        assert probe.round(True) > 0 and probe.round(False) > 0
    finally:
        probe.close()
    steal = bench._steal_s()
    assert steal is None or steal >= 0
