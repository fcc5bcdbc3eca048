"""The calculator benchmark's --peers mode (benchmarks/bench_calculator.py): how a peer's exactness is decided
(real tokenizers: HF tokenizers is the reference, tiktoken on the Qwen3.5/3.6 ranks is a real inexact peer), the
multi-turn workload, the tables, the pins and the installer's bookkeeping."""
import random
import unicodedata

import pytest

from benchmarks import bench_calculator as bench
from benchmarks.calculator_bench import report, runner, workers
from benchmarks.calculator_bench.corpus import GENERATION_PROMPT, add_multiturn, conversation_starts

# 加拿大 and " سبيل" are tokens of the Qwen3.5/3.6 vocabulary that no merge makes: rank-order BPE over the ranks
# (tiktoken) emits them, HF tokenizers (merges) does not -- docs/results/calculator.md
SLICES = {
    "zh": ["中国\n加拿大\n日本\n", "你好，世界"],
    "ar": ["مرحبا بكم", "هذا مهم، على سبيل المثال في مصر.", "شكرا"],
    "en": ["hello world", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"],
}


@pytest.fixture(scope="module")
def outputs(qwen36_tokenizer_dir, tmp_path_factory):
    """Every slice through HF tokenizers (the reference), ours and tiktoken, written as the workers write them."""
    import tokenizers
    from qwen_v3_calculator.tokenizer import Tokenizer
    from qwen_v3_calculator.vocab import vocabulary_ranks

    hf = tokenizers.Tokenizer.from_file(str(qwen36_tokenizer_dir / "tokenizer.json"))
    impls = {"hf.encode": lambda t: hf.encode(t).ids, "ours.encode_fn": Tokenizer.bundled("qwen3.6").encode,
             "tiktoken": workers.tiktoken_exact(vocabulary_ranks("qwen3.6"), "qwen3.6")}
    d = tmp_path_factory.mktemp("ids")
    merged = {}
    for name, fn in impls.items():
        merged[name] = {"impl": name, "slices": {}}
        for sl, docs in SLICES.items():
            ids = [fn(doc) for doc in docs]
            prefix = str(d / f"{name}-{sl}")
            workers.write_ids(prefix, ids)
            merged[name]["slices"][sl] = {"counts": [len(x) for x in ids], "ids": prefix, "warm_same": True,
                                          "hashes": [workers._hash_ids(x) for x in ids]}
    return merged, {"tokenizer_json": str(qwen36_tokenizer_dir / "tokenizer.json")}


def test_a_peer_with_one_wrong_document_is_inexact_and_shows_where(outputs):
    merged, paths = outputs
    verdicts = runner.verify_peers({"slices": SLICES}, merged, paths, list(SLICES))
    assert set(verdicts) == {"ours.encode_fn", "tiktoken"}  # the reference is not judged against itself
    ours, tt = verdicts["ours.encode_fn"], verdicts["tiktoken"]
    assert ours["status"] == "exact" and ours["by"] == "ids" and ours["docs"] == {"zh": 2, "ar": 3, "en": 2}
    assert ours["wrong_docs"] == 0 and "example" not in ours
    assert tt["status"] == "inexact" and tt["wrong"] == {"zh": 1, "ar": 1} and tt["wrong_docs"] == 2
    assert tt["first"] == ["zh", 0]
    ex = tt["example"]
    (ro, ri), (go, gi) = (workers.read_ids(merged[i]["slices"]["zh"]["ids"]) for i in ("hf.encode", "tiktoken"))
    want, got = ri[ro[0]:ro[1]].tolist(), gi[go[0]:go[1]].tolist()
    j = ex["first_diff_token"]
    assert j > 0 and want[:j] == got[:j] and want[j] != got[j]
    assert (ex["ref_ids"], ex["ids"]) == (want[j:j + 4], got[j:j + 4])
    assert ex["excerpt"].startswith("'中国\\n加拿大")  # the text where they part, by HF's offsets
    assert ex["count"] < ex["ref_count"]  # one token where HF has several


def test_exactness_by_counts_and_the_ranking_leave_the_inexact_out(outputs):
    merged, paths = outputs
    counts_only = {"impl": "ours.count_tokens", "slices": {sl: {"counts": r["counts"], "hashes": None}
                                                           for sl, r in merged["ours.encode_fn"]["slices"].items()}}
    verdicts = runner.verify_peers({"slices": SLICES}, {**merged, "ours.count_tokens": counts_only}, paths,
                                   list(SLICES))
    assert verdicts["ours.count_tokens"]["status"] == "exact" and verdicts["ours.count_tokens"]["by"] == "counts"
    verdicts["hf.encode"] = {"status": "reference"}
    # tiktoken the fastest on paper: still not ranked
    summary = {"hf.encode": {"mixed": {"MB_s": 2.0}}, "ours.count_tokens": {"mixed": {"MB_s": 100.0}},
               "tiktoken": {"mixed": {"MB_s": 500.0}}, "ours.encode_fn": {"mixed": {"MB_s": 80.0}}}
    assert bench.ranked(summary, verdicts) == ["ours.count_tokens", "ours.encode_fn", "hf.encode"]


def test_classify_exactness_rules():
    ok = {"docs": 3, "wrong": [], "by": "ids"}
    assert runner.classify_exactness({"a": ok, "b": ok})["status"] == "exact"
    v = runner.classify_exactness({"a": ok, "b": {"docs": 4, "wrong": [3, 1], "by": "ids"}})
    assert (v["status"], v["wrong"], v["first"], v["wrong_docs"]) == ("inexact", {"b": 2}, ["b", 1], 2)
    # right on the checked first pass, other ids on a warm pass or another trial: inexact
    v = runner.classify_exactness({"a": {**ok, "unstable": True}})
    assert v["status"] == "inexact" and v["unstable"] == ["a"] and v["wrong_docs"] == 0
    # a slice that could not be checked: not exact, not inexact
    v = runner.classify_exactness({"a": ok, "b": {"error": "worker exit 1"}})
    assert v["status"] == "unverified" and v["unverified"] == {"b": "worker exit 1"}
    assert runner.classify_exactness({"a": {"error": "not run"}})["status"] == "unverified"
    # something wrong anywhere wins over a slice that could not be checked
    assert runner.classify_exactness({"a": {"docs": 1, "wrong": [0], "by": "counts"},
                                      "b": {"error": "x"}})["status"] == "inexact"
    assert runner.classify_exactness({"a": ok, "b": {**ok, "by": "counts"}})["by"] == "ids/counts"


def test_ids_files_round_trip_and_compare(tmp_path):
    import numpy as np

    seqs = [[1, 2, 3], [], np.array([7, 8], dtype=np.uint32), [2 ** 32 - 1]]
    workers.write_ids(str(tmp_path / "a"), seqs)
    off, ids = workers.read_ids(str(tmp_path / "a"))
    assert list(off) == [0, 3, 3, 5, 6] and ids.tolist() == [1, 2, 3, 7, 8, 2 ** 32 - 1]
    workers.write_ids(str(tmp_path / "b"), [[1, 2, 3], [5], [7, 8], [2 ** 32 - 1]])
    assert runner.compare_docs((off, ids), workers.read_ids(str(tmp_path / "b"))) == [1]
    assert workers._hash_ids([7, 8]) == workers._hash_ids(np.array([7, 8], dtype=np.uint32))
    assert runner.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert runner.first_difference([1, 2], [1, 2, 3]) == 2
    assert runner.first_difference([1, 2], [1, 2]) == -1


def test_added_tokens_split_before_nfc():
    """NFC per segment between added tokens, as HF does: NFC of the whole text would compose the ">" closing an
    added token with a combining mark after it (U+0338: ">" + it = "≯") and lose the token."""
    added = workers.AddedTokens({"<|im_end|>": 9, "<|im_start|>": 8})
    text = "e\u0301<|im_end|>\u0338x"
    assert "<|im_end|>" not in unicodedata.normalize("NFC", text)
    assert added.normalize(text) == "\u00e9<|im_end|>\u0338x"
    enc = added.wrap(lambda s: [ord(c) for c in s])
    assert enc(text) == [0xE9, 9, 0x338, ord("x")] and enc("e\u0301") == [0xE9]


def test_the_multiturn_workload_repeats_each_conversation():
    rnd = random.Random(3)
    messages = [f"message {i} " + "词" * rnd.randint(0, 30) for i in range(200)]
    reqs = bench.multiturn_workload(messages, 60_000, seed=5)
    assert reqs == bench.multiturn_workload(messages, 60_000, seed=5)  # seeded
    assert reqs != bench.multiturn_workload(messages, 60_000, seed=6)
    assert sum(len(r.encode()) for r in reqs) >= 60_000
    starts = conversation_starts(reqs)
    assert starts[0] == 0 and len(starts) >= 2
    for a, b in zip(starts, starts[1:] + [len(reqs)]):
        conv = reqs[a:b]
        assert 2 <= len(conv) <= 8
        for prev, cur in zip(conv, conv[1:]):  # request k = request k-1 (without its prompt) + its answer + one turn
            assert cur.startswith(prev[:-len(GENERATION_PROMPT)]) and len(cur) > len(prev)
            assert cur[len(prev) - len(GENERATION_PROMPT):].startswith("<|im_start|>assistant\n")
        for r in conv:
            assert r.endswith("<|im_end|>\n" + GENERATION_PROMPT)
            assert r.count("<|im_start|>user\n") == conv.index(r) + 1
    users = [u.split("<|im_end|>")[0] for r in reqs for u in r.split("<|im_start|>user\n")[1:]]
    assert set(users) <= set(messages)
    with pytest.raises(ValueError):
        bench.multiturn_workload([], 10, seed=1)


def test_add_multiturn_takes_the_chat_and_mixchat_messages():
    corpus = {"slices": {"chat": ["hi there", "what is 2+2?"], "mixchat": ["привет 👍", "谢谢"]},
              "stats": {"chat": {"bytes": 3000}}, "warmup": []}
    add_multiturn(corpus, seed=1)
    docs = corpus["slices"][bench.MULTITURN]
    st = corpus["stats"][bench.MULTITURN]
    assert st["docs"] == len(docs) and st["bytes"] >= 3000 and st["conversations"] == len(conversation_starts(docs))
    assert len(corpus["multiturn_sha256"]) == 64 and "谢谢" in "".join(docs) and "hi there" in "".join(docs)
    assert bench.MULTITURN in bench.PEER_SLICES and bench.PEER_SLICES[:len(bench.SLICES)] == bench.SLICES


def test_tables():
    md = bench.markdown_table(["name", "MB/s"], [["a", "1.0"], ["longer", "12.5"]])
    assert md.splitlines() == ["| name   | MB/s |", "|--------|-----:|", "| a      |  1.0 |", "| longer | 12.5 |"]
    summary = {"tiktoken": {"mixed": {"MB_s": 10.0}, "zh": {"MB_s": 5.0}},
               "fastpeer": {"mixed": {"MB_s": 40.0}, "zh": {"MB_s": 20.0}},
               "ours": {"mixed": {"MB_s": 80.0}, "zh": {"MB_s": 25.0}},
               "broken": {"error": "ModuleNotFoundError: x"}}
    checks = lambda wrong: {"mixed": {"docs": 4, "wrong": [], "by": "ids"},  # noqa: E731
                            "zh": {"docs": 2, "wrong": wrong, "by": "ids"}}
    exactness = {"tiktoken": runner.classify_exactness(checks([])),
                 "fastpeer": runner.classify_exactness(checks([1])), "ours": runner.classify_exactness(checks([]))}
    header, rows = bench.peer_slice_table(summary, exactness, ["mixed", "zh"])
    assert header == ["slice", "tiktoken", "fastpeer", "ours"]  # the one that did not run has no column
    assert rows[0] == ["mixed", "10.0 (1.00x)", "40.0 (4.00x)", "80.0 (8.00x)"]
    assert rows[1] == ["zh", "5.0 (1.00x)", "20.0 (4.00x) ✗", "25.0 (5.00x)"]  # ✗: a wrong document there
    assert rows[2] == ["rank (mixed)", "2", "inexact", "1"]
    res = {"summary": summary, "exactness": exactness,
           "load_memory": {"ours": {"import_s": {"median": 0.02}, "load_s": {"median": 0.2},
                                    "rss_mb": {"median": 21.0}}},
           "peers": {"tiktoken": {"version": "0.14.0"}, "fastpeer": {"version": "1.0"}, "ours": {"version": "0.2.0"},
                     "broken": {"version": None, "why": "not installed: ERROR: No matching distribution"}}}
    header, rows = report.peer_summary_table(res)
    by = {r[0]: dict(zip(header, r)) for r in rows}
    assert by["ours"]["rank"] == "1" and by["tiktoken"]["rank"] == "2" and by["fastpeer"]["rank"] == "not ranked"
    assert by["fastpeer"]["ids vs HF tokenizers"] == "**inexact**: 1/6 docs wrong (zh 1/2)"
    assert by["broken"]["ids vs HF tokenizers"] == "**unavailable**: not installed (below)"
    assert by["ours"]["ids vs HF tokenizers"] == "exact (6 docs, by ids)"
    assert (by["ours"]["load s"], by["ours"]["RSS MB"], by["ours"]["mixed cold MB/s"]) == ("0.200", "21.0",
                                                                                            "80.0 (8.00x)")


def test_the_pins_and_the_installer_bookkeeping():
    pins = dict(runner.read_requirements())
    assert pins == {"fastokens": "0.3.5", "gigatoken": "0.10.0", "riptoken": "0.2.4", "tokie": "0.1.4",
                    "bpe-qwen": "0.1.5", "runtoken": "0.1.2", "huggingface_hub": None}
    assert {d for d, *_ in bench.PEERS.values() if d} - {"tiktoken", "tokenizers"} <= set(pins)
    log = []
    st = runner.pip_install([("tiktoken", "0.0.1")], log)  # installed already: kept, no pip call, the pin noted
    assert st["tiktoken"]["action"] == "already installed" and st["tiktoken"]["version"] != "0.0.1"
    assert "pinned" in st["tiktoken"]["note"] and "pinned: 0.0.1" in log[0]


def test_the_written_all_cores_results_keep_timings_and_drop_per_document_data():
    """The committed JSON holds the timings and the exactness verdict, not every document's count and ids digest
    (which made it 3.5 MB)."""
    ac = {"fastokens": {"cores": [0, 1], "load": {"load_s": 1.0},
                        "workloads": {"chat": {"texts": 2, "cold_wall_s": 0.5, "warm_wall_s": [0.4, 0.3],
                                               "counts": [3, 4], "hashes": [1, 2], "ids": "/tmp/x"}}},
          "tokie": {"error": "not installed"}}
    slim = runner.without_per_document(ac)
    assert slim["fastokens"]["workloads"]["chat"] == {"texts": 2, "cold_wall_s": 0.5, "warm_wall_s": [0.4, 0.3]}
    assert slim["fastokens"]["cores"] == [0, 1] and slim["tokie"] == {"error": "not installed"}
    assert "counts" in ac["fastokens"]["workloads"]["chat"]  # the check's input is left as it was
