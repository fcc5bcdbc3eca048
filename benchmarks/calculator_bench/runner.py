"""The parent process: pinning, spawning the workers, agreement checks, the summary."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from .common import REFERENCE, SCRIPT, SLICES
from .workers import _load_bpe_qwen, bench_vocab, tiktoken_exact


def _idlest_cpu(allowed: list[int], seconds: float = 0.5) -> int:
    def idle():
        out = {}
        with open("/proc/stat") as f:
            for ln in f:
                m = re.match(r"cpu(\d+) (.*)", ln)
                if m:
                    v = [int(x) for x in m.group(2).split()]
                    out[int(m.group(1))] = v[3] + (v[4] if len(v) > 4 else 0)
        return out
    try:
        a = idle()
        time.sleep(seconds)
        b = idle()
        return max(allowed, key=lambda c: (b.get(c, 0) - a.get(c, 0), c))
    except OSError:
        return allowed[-1]


def pin_one_core(cpu: int | None) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    cpu = _idlest_cpu(allowed) if cpu is None else cpu
    os.sched_setaffinity(0, {cpu})
    return cpu


def maybe_install_bpe_qwen(log: list[str]) -> None:
    try:
        import importlib.util
        if importlib.util.find_spec("bpe_qwen") is not None:
            log.append("bpe-qwen already installed")
            return
    except Exception:
        pass
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "bpe-qwen"], capture_output=True, text=True)
    log.append("pip install bpe-qwen: " + ("ok" if r.returncode == 0 else "failed: " + (r.stderr or r.stdout)[-300:]))


def _spawn(impl: str, slices: list[str], corpus_path: str, passes: int, tmpdir: str, timeout: float,
           tag: str = "", cpus: str = "") -> dict:
    out = os.path.join(tmpdir, f"w-{impl}-{'+'.join(slices)}{tag}.json")
    cmd = [sys.executable, SCRIPT, "--_worker", impl, "--_slices", ",".join(slices),
           "--_corpus", corpus_path, "--_out", out, "--_passes", str(passes), "--_cpus", cpus]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="true", PYTHONHASHSEED="0")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"timed out after {timeout:.0f} s", "slices": {}}
    if r.returncode != 0 or not os.path.exists(out):
        return {"impl": impl, "error": f"worker exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}", "slices": {}}
    with open(out) as f:
        return json.load(f)


def excerpt(text: str, at: int, width: int = 60) -> str:
    s = text[max(0, at - 20):at + width - 20]
    return repr(s)[:width + 12]


def find_mismatches(corpus: dict, results: dict, paths: dict, limit: int = 5) -> dict:
    """Per implementation and slice: documents whose count (or ids, where available) differ from HF encode."""
    ref = results.get(REFERENCE, {})
    out: dict = {}
    hf_tok = None
    for impl, r in results.items():
        if impl == REFERENCE or r.get("error"):
            continue
        per: dict = {}
        for sl, sr in r.get("slices", {}).items():
            rr = ref.get("slices", {}).get(sl)
            if not rr or "counts" not in rr or "counts" not in sr:
                continue
            bad = [i for i, (a, b) in enumerate(zip(sr["counts"], rr["counts"])) if a != b]
            bad_ids = []
            if sr.get("hashes") and rr.get("hashes"):
                bad_ids = [i for i, (a, b) in enumerate(zip(sr["hashes"], rr["hashes"]))
                           if a != b and sr["counts"][i] == rr["counts"][i]]
            items = []
            for i in (bad + bad_ids)[:limit]:
                doc = corpus["slices"][sl][i]
                item = {"doc": i, "count": sr["counts"][i], "ref_count": rr["counts"][i],
                        "ids_only": i in bad_ids, "excerpt": excerpt(doc, 0)}
                try:  # locate the first differing token with the reference's offsets
                    import tokenizers
                    if hf_tok is None:
                        hf_tok = tokenizers.Tokenizer.from_file(paths["tokenizer_json"])
                    enc = hf_tok.encode(doc)
                    other = _diag_ids(impl, doc, paths)
                    if other is not None:
                        j = next((k for k, (a, b) in enumerate(zip(other, enc.ids)) if a != b),
                                 min(len(other), len(enc.ids)))
                        at = enc.offsets[j][0] if j < len(enc.offsets) else len(doc)
                        item["first_diff_token"] = j
                        item["excerpt"] = excerpt(doc, at)
                        item["ours_ids"] = other[j:j + 4]
                        item["ref_ids"] = enc.ids[j:j + 4]
                except Exception as exc:  # diagnostics only
                    item["diag_error"] = str(exc)
                items.append(item)
            per[sl] = {"docs": len(sr["counts"]), "count_mismatches": len(bad), "id_only_mismatches": len(bad_ids),
                       "examples": items}
        out[impl] = per
    return out


_DIAG: dict = {}


def _diag_ids(impl: str, doc: str, paths: dict):
    if impl.startswith("ours."):
        if "ours" not in _DIAG:
            from qwen_v3_calculator.tokenizer import Tokenizer
            _DIAG["ours"] = Tokenizer.bundled(bench_vocab()).encode
        return _DIAG["ours"](doc)
    if impl == "tiktoken":
        if "tt" not in _DIAG:
            from qwen_v3_calculator.vocab import vocabulary_ranks
            _DIAG["tt"] = tiktoken_exact(vocabulary_ranks(bench_vocab()), bench_vocab())
        return _DIAG["tt"](doc)
    if impl == "hf.encode_batch":
        return None
    if impl == "bpe-qwen":
        if "bq" not in _DIAG:
            _DIAG["bq"] = _load_bpe_qwen()[0].QwenTokenizer(paths["tokenizer_dir"]).encode
        return _DIAG["bq"](doc)
    return None


def summarize(corpus: dict, results: dict, clock: str = "cpu") -> dict:
    st = corpus["stats"]
    summary: dict = {}
    for impl, r in results.items():
        row: dict = {"error": r.get("error")}
        for sl in SLICES:
            sr = r.get("slices", {}).get(sl)
            if not sr or "first_cpu_s" not in sr:
                row[sl] = {"error": (sr or {}).get("error", r.get("error") or "not run")}
                continue
            b, n, toks = st[sl]["bytes"], st[sl]["docs"], sum(sr["counts"])
            t1, tw = sr[f"first_{clock}_s"], sr["first_wall_s"]
            tb = min([t1] + sr[f"repeat_{clock}_s"])
            tr = sr.get(f"trials_{clock}_s") or [t1]
            row[sl] = {"clock": clock, "seconds": t1, "MB_s": b / 1e6 / t1, "tokens_s": toks / t1, "calls_s": n / t1,
                       "tokens": toks, "trials_seconds": tr, "spread": max(tr) / min(tr),
                       "wall_seconds": tw, "wall_MB_s": b / 1e6 / tw, "wall_calls_s": n / tw,
                       "trials_wall_seconds": sr.get("trials_wall_s"), "cpu_seconds": sr["first_cpu_s"],
                       "warm_seconds": tb, "warm_MB_s": b / 1e6 / tb, "warm_calls_s": n / tb}
        summary[impl] = row
    return summary


def _loads(worker_results: list[dict]) -> dict:
    out: dict = {}
    for r in worker_results:
        if r.get("error") and "load" not in r:
            continue
        d = out.setdefault(r["impl"], {"load_s": [], "import_s": [], "bundled_s": [], "rss_mb": [], "peak_mb": []})
        ld = r.get("load", {})
        d["load_s"].append(ld.get("load_s"))
        d["import_s"].append(ld.get("import_s"))
        if "bundled_s" in ld:
            d["bundled_s"].append(ld["bundled_s"])
        d["what"] = ld.get("load_what")
        if "import_how" in ld:
            d["import_how"] = ld["import_how"]
        m = r.get("mem", {})
        d["rss_mb"].append(m.get("rss_after_load_delta_mb"))
        if m.get("peak_delta_mb") is not None:
            d["peak_mb"].append(m["peak_delta_mb"])
    for d in out.values():
        for k in ("load_s", "import_s", "bundled_s", "rss_mb", "peak_mb"):
            vals = [v for v in d[k] if v is not None]
            d[k] = {"median": statistics.median(vals), "min": min(vals), "n": len(vals)} if vals else None
    return out


def _f(x, fmt="{:.2f}", na="-"):
    return na if x is None else fmt.format(x)


def _steal_share(steal_s: float, wall_s: float, cpus: int) -> str:
    return f"{steal_s / max(wall_s * cpus, 1e-9):.1%}"
