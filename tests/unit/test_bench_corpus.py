"""The calculator benchmark's corpus: a pinned, seeded recipe over package data only (benchmarks/bench_calculator.py).

Builds the quick corpus (what ``--quick`` times) twice: the same documents and the same sha256 both times, every
document traced to a file of a pinned source (nothing else on the machine), and non-empty zh, en and code slices.
"""
import importlib.metadata
import os

import pytest

from benchmarks import bench_calculator as bench
from benchmarks.bench_calculator import build_corpus, corpus_recipe, corpus_sha256

QUICK = (0.3, 1500)  # --quick: --size-mb 0.3, --chat 1500


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(*QUICK)


def test_the_recipe_is_deterministic(corpus):
    again = build_corpus(*QUICK)
    assert again["sha256"] == corpus["sha256"]
    assert again["slices"] == corpus["slices"] and again["warmup"] == corpus["warmup"]
    assert again["origins"] == corpus["origins"]
    # the printed hash is over the exact documents, in order
    assert corpus["sha256"] == corpus_sha256(corpus["slices"], corpus["warmup"])
    assert len(corpus["sha256"]) == 64
    changed = dict(corpus["slices"], mixed=corpus["slices"]["mixed"][1:] + corpus["slices"]["mixed"][:1])
    assert corpus_sha256(changed, corpus["warmup"]) != corpus["sha256"]
    # versions and pins are recorded with it; on the pinned sources it is the recorded hash
    assert corpus["recipe"] == bench.RECIPE and corpus["seed"] == bench.SEED
    assert set(bench.PINNED) <= set(corpus["versions"]) and set(bench.PINNED) <= set(corpus["pinned"])
    if not corpus["warnings"]:
        assert corpus["sha256"] == bench.RECORDED_SHA256[QUICK], "same pinned sources, another corpus"


def _allowed_files() -> set[str]:
    """Every file the pinned recipe may read: the RECORD-listed files of the pinned distributions, the llama.cpp
    reference files from the pinned sdist, and this project's corpus.txt."""
    from qwen_vllm_ext.common import assets
    allowed = set()
    for name in bench.PINNED:
        dist, _, _ = bench._find_dist(name)
        if dist is not None:
            allowed |= {os.path.realpath(dist.locate_file(f)) for f in dist.files or ()}
    ref = assets.reference_dir()
    allowed |= {os.path.realpath(ref / rel) for rel in assets.CHAT_TEMPLATES.values()}
    allowed |= {os.path.realpath(ref / inp) for inp, _ in assets.TEST_VECTORS.values()}
    allowed.add(os.path.realpath(os.path.join(bench.ROOT, bench.CORPUS_TXT_REL)))
    return allowed


def test_every_document_comes_from_a_pinned_source(corpus):
    files = [os.path.realpath(p) for p in corpus["files"]]
    assert files
    for p in files:
        assert not p.startswith(("/work/shared", "/usr/share", "/usr/local/share", "/etc")), p
        assert ".rustup" not in p and "/field-reports/" not in p, p
    outside = set(files) - _allowed_files()
    assert not outside, f"read from outside the pinned sources: {sorted(outside)[:5]}"
    # every document (and warm-up text, and chat message) names a pinned source
    from qwen_vllm_ext.common import assets
    found = [bench._find_dist(name) for name in bench.PINNED]
    prefixes = [f"{found_name}=={version}/" for dist, found_name, version in found if dist is not None]
    prefixes += [f"{bench.REFS_PINNED[0]}=={assets.SDIST_VERSION}/vendor/llama.cpp/models/",
                 f"qwen-vllm-ext/{bench.CORPUS_TXT_REL}"]
    for name, docs in (*corpus["slices"].items(), ("warmup", corpus["warmup"])):
        assert len(corpus["origins"][name]) == len(docs), name
        if name in bench.LANG_SLICES:  # generated from word lists in calculator_bench/languages.py, read nothing
            assert set(corpus["origins"][name]) == {f"generated:{name}"}, name
            continue
        bad = [o for o in corpus["origins"][name] if not o.startswith(tuple(prefixes))]
        assert not bad, (name, bad[:3])


def test_slices_are_non_empty_and_disjoint(corpus):
    sl = corpus["slices"]
    for kind in ("mixed", "zh", "en", "code", "chat"):
        assert sl[kind] and all(d.strip() for d in sl[kind]), kind
    by_kind = corpus["stats"]["mixed"]["by_kind"]
    assert all(by_kind[k]["docs"] > 0 for k in ("zh", "en", "code")), by_kind
    assert corpus["stats"]["zh"]["cjk_char_share"] > 0.5  # Chinese, not Latin text with a few characters
    assert corpus["stats"]["en"]["cjk_char_share"] < 0.01
    assert not set(sl["mixed"]) & (set(sl["zh"]) | set(sl["en"]) | set(sl["code"]))
    assert not set(sl["zh"]) & set(sl["en"]) and not set(sl["en"]) & set(sl["code"])
    assert all(len(m) <= 300 for m in sl["chat"])
    # the generated language slices: non-empty, disjoint from the rest, deterministic (own sha256)
    for kind in bench.LANG_SLICES:
        assert sl[kind] and all(d.strip() for d in sl[kind]), kind
        assert not set(sl[kind]) & (set(sl["mixed"]) | set(sl["chat"])), kind
    assert all(len(m) <= 300 for m in sl["mixchat"])
    assert corpus["languages_sha256"] == corpus_sha256(sl, corpus["warmup"], bench.LANG_SLICES)
    # the llama.cpp test vectors ride along as chat messages; zh's shortfall is reported, not hidden
    assert corpus["stats"]["chat"]["mix"]["llama.cpp test vectors"] > 0
    short = [n for n in corpus["notes"] if n.startswith("zh:")]
    assert not short or "prose" in short[0]


def test_a_version_other_than_the_pin_is_warned_and_strict_refuses(monkeypatch):
    name = "pycountry"
    assert importlib.metadata.version(name)
    monkeypatch.setitem(bench.PINNED, name, "0.0.0")
    recipe = corpus_recipe()
    warned = [w for w in recipe["warnings"] if name in w]
    assert warned and "0.0.0" in warned[0] and "sha256" in warned[0]
    with pytest.raises(bench.CorpusMismatch):
        build_corpus(*QUICK, strict=True)
