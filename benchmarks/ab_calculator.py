"""Two builds of the calculator's engine side by side: is a change to ``_core.pyx`` faster, per slice, cold and warm?

    .venv/bin/python -m benchmarks.ab_calculator --a HEAD~1 --b HEAD --vocab qwen3.6 --rounds 11
    .venv/bin/python -m benchmarks.ab_calculator --a HEAD --b HEAD          # A/A: how big a difference this run sees

Each side is a git revision (or ``worktree``: the files as they are now) of ``calculator_cython/qwen_v3_calculator``
(its ``_core.pyx`` and Python modules; the vocabulary data of the working tree), compiled out of tree with the
flags of ``setup.py``. Then ``--rounds`` rounds of one fresh process per side, the two sides in alternating order,
each pinned to the same core: load, a warm-up over held-out text, then every slice of ``bench_calculator``'s corpus
in its order (later slices see what earlier ones left in the caches, as a long-running gateway does), the first
pass over a slice ("cold") and a second ("warm"), timed by the thread's CPU time. Counts are checked equal
between the sides on every slice. Printed per slice: the best MB/s of each side and B/A, best against best and the
median of the paired ratios (round k against round k). The per-slice differences this machine can see are those
an A/A run does not show (``--a X --b X``): on 0.1 MB slices a few percent.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.calculator_bench.common import SLICES
from benchmarks.calculator_bench.workers import VOCAB_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "calculator_cython/qwen_v3_calculator"
BUILD = """from Cython.Build import cythonize
from setuptools import Extension, setup
setup(ext_modules=cythonize([Extension("qwen_v3_calculator._core", ["qwen_v3_calculator/_core.pyx"],
                                       extra_compile_args=["-O3"])], compiler_directives={"language_level": "3"}),
      script_args=["build_ext", "--inplace", "-q"])
"""


def _files(rev: str) -> dict[str, bytes]:
    """The package's .py and .pyx files at a git revision (``worktree``: as they are now)."""
    if rev == "worktree":
        return {f: open(os.path.join(ROOT, PACKAGE, f), "rb").read() for f in sorted(os.listdir(os.path.join(ROOT, PACKAGE)))
                if f.endswith((".py", ".pyx"))}
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", f"{rev}:{PACKAGE}"], check=True,
                           capture_output=True, text=True).stdout.split()
    return {f: subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{PACKAGE}/{f}"], check=True,
                              capture_output=True).stdout for f in names if f.endswith((".py", ".pyx"))}


def build(rev: str, where: str) -> str:
    """Compile ``rev``'s engine into ``where``; returns the directory to put first on PYTHONPATH."""
    pkg = os.path.join(where, "qwen_v3_calculator")
    os.makedirs(pkg)
    for name, data in _files(rev).items():
        with open(os.path.join(pkg, name), "wb") as f:
            f.write(data)
    os.symlink(os.path.join(ROOT, PACKAGE, "data"), os.path.join(pkg, "data"))
    out = subprocess.run([sys.executable, "-c", BUILD], cwd=where, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"building {rev} failed:\n{out.stderr[-3000:]}")
    return where


def worker(corpus_path: str, vocab: str, cpu: int) -> dict:
    """One side, one round (in a fresh process): {slice: [cold_s, warm_s, tokens]}."""
    os.sched_setaffinity(0, {cpu})
    import gc
    import qwen_v3_calculator as q
    with open(corpus_path, encoding="utf-8") as f:
        corpus = json.load(f)
    count = q.default_calculator(vocab).tokenizer._engine.count
    for text in corpus["warmup"]:
        count(text)
    out = {}
    for sl in SLICES:
        docs = corpus["slices"][sl]
        gc.collect()
        gc.disable()
        t0 = time.thread_time()
        tokens = sum(count(d) for d in docs)
        t1 = time.thread_time()
        for d in docs:
            count(d)
        t2 = time.thread_time()
        gc.enable()
        out[sl] = [t1 - t0, t2 - t1, tokens]
    return out


def summarize(a: list[dict], b: list[dict], nbytes: dict[str, int]) -> list[dict]:
    """Per slice: best cold/warm MB/s of each side, B/A best against best and the median of the paired ratios."""
    rows = []
    for sl in nbytes:
        row = {"slice": sl}
        for k, name in ((0, "cold"), (1, "warm")):
            ta, tb = [r[sl][k] for r in a], [r[sl][k] for r in b]
            row[f"a_{name}"] = nbytes[sl] / min(ta) / 1e6
            row[f"b_{name}"] = nbytes[sl] / min(tb) / 1e6
            row[f"{name}_best"] = min(ta) / min(tb)
            row[f"{name}_paired"] = statistics.median(x / y for x, y in zip(ta, tb))
        rows.append(row)
    return rows


def table(rows: list[dict], a: str, b: str) -> str:
    lines = [f"A = {a}, B = {b}; MB/s = 10^6 UTF-8 bytes per CPU second, best over the rounds; B/A = A's time over "
             "B's (> 1: B faster), best against best (paired median)",
             f"{'slice':9} {'A cold':>8} {'B cold':>8} {'B/A cold':>16} {'A warm':>8} {'B warm':>8} {'B/A warm':>16}"]
    for r in rows:
        lines.append(f"{r['slice']:9} {r['a_cold']:8.1f} {r['b_cold']:8.1f} {r['cold_best']:7.3f} ({r['cold_paired']:.3f})"
                     f" {r['a_warm']:8.1f} {r['b_warm']:8.1f} {r['warm_best']:7.3f} ({r['warm_paired']:.3f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="HEAD~1", help="git revision of side A, or 'worktree' (default HEAD~1)")
    ap.add_argument("--b", default="worktree", help="git revision of side B, or 'worktree' (default)")
    ap.add_argument("--vocab", choices=("qwen3", "qwen3.6"), default="qwen3.6")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the last allowed one)")
    ap.add_argument("--json", default=None, help="write the rows and every round's timings here")
    ap.add_argument("--_worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        print(json.dumps(worker(args._worker[0], args._worker[1], int(args._worker[2]))))
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    os.environ[VOCAB_ENV] = args.vocab
    from benchmarks.calculator_bench.corpus import build_corpus
    tmp = tempfile.mkdtemp(prefix="ab_calculator-")
    try:
        corpus = build_corpus(4.0, 10000)
        corpus_path = os.path.join(tmp, "corpus.json")
        with open(corpus_path, "w", encoding="utf-8") as f:
            json.dump({"slices": corpus["slices"], "warmup": corpus["warmup"]}, f, ensure_ascii=False)
        nbytes = {sl: sum(len(d.encode("utf-8")) for d in corpus["slices"][sl]) for sl in SLICES}
        paths = {side: build(rev, os.path.join(tmp, side)) for side, rev in (("a", args.a), ("b", args.b))}
        runs: dict[str, list] = {"a": [], "b": []}
        for k in range(args.rounds):
            for side in (("a", "b") if k % 2 == 0 else ("b", "a")):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([paths[side], ROOT]))
                out = subprocess.run([sys.executable, "-m", "benchmarks.ab_calculator", "--_worker", corpus_path,
                                      args.vocab, str(cpu)], env=env, cwd=tmp, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"side {side} failed:\n{out.stderr[-3000:]}")
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        bad = [sl for sl in SLICES if any(r[sl][2] != runs["a"][0][sl][2] for r in runs["a"] + runs["b"])]
        if bad:
            print(f"the sides count differently on: {', '.join(bad)}", file=sys.stderr)
            return 1
        rows = summarize(runs["a"], runs["b"], nbytes)
        print(f"vocabulary {args.vocab}, {args.rounds} rounds, core {cpu}, corpus sha256 {corpus['sha256']}")
        print(table(rows, args.a, args.b))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"a": args.a, "b": args.b, "vocab": args.vocab, "rounds": args.rounds, "rows": rows,
                           "runs": runs, "corpus_sha256": corpus["sha256"]}, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
