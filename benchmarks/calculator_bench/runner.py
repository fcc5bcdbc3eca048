"""The parent process: pinning, spawning the workers, agreement checks, the summary."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from .common import (MODULE, MULTITURN, PEER_PASSES, PEER_REFERENCE, PEER_SLICES, PEERS, PEERS_REQUIREMENTS, REFERENCE,
                     ROOT, SLICES)
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


def read_requirements(path: str = PEERS_REQUIREMENTS) -> list[tuple[str, str | None]]:
    """(distribution, pinned version or None) of each line of a requirements file of ``name`` / ``name==version``
    lines (comments and blank lines skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for ln in f:
            ln = ln.split("#", 1)[0].strip()
            if ln:
                name, _, ver = ln.partition("==")
                out.append((name.strip(), ver.strip() or None))
    return out


def _dist_version(dist: str) -> str | None:
    import importlib
    import importlib.metadata
    importlib.invalidate_caches()
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip_reason(text: str) -> str:
    errs = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("ERROR:")]
    return "; ".join(errs[-2:]) if errs else text.strip()[-300:]


def pip_install(reqs: list[tuple[str, str | None]], log: list[str]) -> dict[str, dict]:
    """Install each missing requirement into this interpreter's environment, one at a time and binary wheels only
    (``pip install --only-binary=:all: name==version``), so one that cannot be installed does not stop the others.
    One already installed is kept, at whatever version (a version other than the pin is noted). -> per
    distribution: version (None when not installed), pinned, action, and pip's reason where it failed."""
    status: dict[str, dict] = {}
    for dist, want in reqs:
        have = _dist_version(dist)
        if have is not None:
            st = {"version": have, "pinned": want, "action": "already installed"}
            if want and have != want:
                st["note"] = f"{have} installed, not the pinned {want}: measured as installed"
            log.append(f"{dist} {have} already installed" + (f" (pinned: {want})" if want and have != want else ""))
            status[dist] = st
            continue
        spec = f"{dist}=={want}" if want else dist
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--only-binary=:all:", spec]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            ok, text = r.returncode == 0, (r.stderr or "") + (r.stdout or "")
        except subprocess.TimeoutExpired:
            ok, text = False, "ERROR: pip timed out after 900 s"
        have = _dist_version(dist)
        if ok and have:
            status[dist] = {"version": have, "pinned": want, "action": "installed"}
            log.append(f"pip install --only-binary=:all: {spec}: ok")
        else:
            reason = _pip_reason(text) + " (binary wheels only: --only-binary=:all:)"
            status[dist] = {"version": None, "pinned": want, "action": "install failed", "error": reason}
            log.append(f"pip install --only-binary=:all: {spec}: failed: {reason}")
    return status


def maybe_install_bpe_qwen(log: list[str]) -> None:
    """--try-bpe-qwen: bpe-qwen at its pin in requirements-peers.txt, when missing."""
    pip_install([r for r in read_requirements() if r[0] == "bpe-qwen"], log)


def _spawn(impl: str, slices: list[str], corpus_path: str, passes: int, tmpdir: str, timeout: float,
           tag: str = "", cpus: str = "", ids_dir: str = "", verify: bool = False, env: dict | None = None) -> dict:
    out = os.path.join(tmpdir, f"w-{impl}-{'+'.join(slices)}{tag}.json")
    cmd = [sys.executable, "-m", MODULE, "--_worker", impl, "--_slices", ",".join(slices),
           "--_corpus", corpus_path, "--_out", out, "--_passes", str(passes), "--_cpus", cpus]
    if ids_dir:
        cmd += ["--_ids", ids_dir]
    if verify:
        cmd += ["--_verify"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="true", PYTHONHASHSEED="0", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH"))))  # the `benchmarks` package
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"timed out after {timeout:.0f} s", "slices": {}}
    if r.returncode != 0 or not os.path.exists(out):
        return {"impl": impl, "error": f"worker exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}", "slices": {}}
    with open(out) as f:
        return json.load(f)


def _merge_trial(m: dict, r: dict, slices) -> None:
    """Fold one worker's result into the implementation's: the fastest first pass over the trials, every trial's
    first pass and every warm pass kept; outputs that differ between trials mark the slice nondeterministic."""
    if r.get("error") and not m.get("error"):
        m["error"] = r["error"]
    for sl in slices:
        new = r.get("slices", {}).get(sl)
        old = m["slices"].get(sl)
        if new and "first_cpu_s" in new:
            for clk in ("cpu", "wall"):  # keep the fastest trial, and every warm pass
                new[f"trials_{clk}_s"] = (old or {}).get(f"trials_{clk}_s", []) + [new[f"first_{clk}_s"]]
                if old and f"first_{clk}_s" in old:
                    new[f"repeat_{clk}_s"] = old[f"repeat_{clk}_s"] + new[f"repeat_{clk}_s"]
                    new[f"first_{clk}_s"] = min(old[f"first_{clk}_s"], new[f"first_{clk}_s"])
            if old and "counts" in old and (old["counts"] != new["counts"] or old["hashes"] != new["hashes"]):
                m.setdefault("nondeterministic", []).append(sl)
            if old and "ids" in old:  # the ids written by the first trial
                new.setdefault("ids", old["ids"])
            if old and "warm_same" in old:
                new["warm_same"] = old["warm_same"] and new.get("warm_same", True)
            m["slices"][sl] = new
        elif new and not old:
            m["slices"][sl] = new


def run_trials(impls: list[str], groups: list[tuple[str, ...]], corpus_path: str, passes: int, tmpdir: str,
               trials: int, ids_dir: str = "", verify: bool = False, env: dict | None = None) -> tuple[dict, list]:
    """``trials`` rounds; in each, one fresh process per implementation and group of slices, timing the group's
    slices in order (their documents are disjoint, so every first pass is over text that process has not seen).
    The order of the implementations rotates every round, so a noisy stretch of the machine does not always hit the
    same one; one that failed to load in the first round is not tried again. ``ids_dir``: the first round's
    processes write every text's ids there. -> (per implementation its merged result, every worker's result)."""
    worker_results: list[dict] = []
    merged: dict = {i: {"impl": i, "slices": {}} for i in impls}
    for trial in range(trials if impls else 0):
        k = trial % len(impls)
        for impl in impls[k:] + impls[:k]:
            for group in groups:
                if trial and merged[impl].get("error") and not merged[impl]["slices"]:
                    break  # unavailable: do not retry
                t = time.perf_counter()
                r = _spawn(impl, list(group), corpus_path, passes, tmpdir, timeout=600, tag=f"-t{trial}",
                           ids_dir=ids_dir if trial == 0 else "", verify=verify, env=env)
                worker_results.append(r)
                _merge_trial(merged[impl], r, group)
                done = "error: " + r["error"][:80] if r.get("error") else "ok"
                label = f"{impl} ({group[0]})" if len(groups) > 1 and len(group) == 1 else impl
                print(f"  trial {trial + 1}/{trials} {label:<21} {time.perf_counter() - t:6.1f} s  {done}", flush=True)
                if r.get("error") and not r.get("slices"):
                    break  # it did not load: the other groups would not either
    return merged, worker_results


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


# ---- --peers: exactness, document by document, against HF tokenizers ----------------------------------------------
def compare_docs(ref: tuple, got: tuple) -> list[int]:
    """Indices of the texts whose ids differ; ``ref`` and ``got`` are (offsets, ids) as ``workers.read_ids``
    returns them, for the same texts in the same order."""
    (ro, ri), (go, gi) = ref, got
    if len(ro) != len(go):
        raise ValueError(f"{len(ro) - 1} reference texts, {len(go) - 1} compared")
    return [i for i in range(len(ro) - 1) if ri[ro[i]:ro[i + 1]] != gi[go[i]:go[i + 1]]]


def first_difference(ref, got) -> int:
    """Index of the first token where two id sequences differ (the shorter one's length where one is a prefix of
    the other); -1 when they are equal."""
    for j, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return j
    return -1 if len(ref) == len(got) else min(len(ref), len(got))


def classify_exactness(checks: dict[str, dict]) -> dict:
    """A peer's verdict from its per-slice checks, each ``{"docs": n, "wrong": [document indices], "by": "ids" or
    "counts"}`` (``"unstable": True`` where a warm pass or another trial returned other ids than the first pass)
    or ``{"error": why}`` (not run, or no reference to compare with).

    * ``inexact`` -- some document got other ids than HF tokenizers (or another count, for a count-only call), or a
      pass returned other ids than the checked first pass: not ranked for speed;
    * ``unverified`` -- nothing wrong, but some slice could not be checked (it failed, or there is no reference);
    * ``exact`` -- every document of every slice checked and equal (``by``: ids, or counts for a count-only call).
    -> {status, by, docs: {slice: n}, wrong: {slice: n wrong}, wrong_docs, first: [slice, doc] of the first wrong
    document (slice order as given) or None, unstable: [slices], unverified: {slice: why}}."""
    docs, wrong, unstable, unverified, by = {}, {}, [], {}, set()
    first = None
    for sl, c in checks.items():
        if c.get("error"):
            unverified[sl] = c["error"]
            continue
        docs[sl] = c["docs"]
        by.add(c["by"])
        if c["wrong"]:
            wrong[sl] = len(c["wrong"])
            if first is None:
                first = [sl, min(c["wrong"])]
        if c.get("unstable"):
            unstable.append(sl)
    status = "inexact" if wrong or unstable else ("unverified" if unverified or not docs else "exact")
    return {"status": status, "by": "ids" if by == {"ids"} else ("counts" if by == {"counts"} else "ids/counts"),
            "docs": docs, "wrong": wrong, "wrong_docs": sum(wrong.values()), "first": first, "unstable": unstable,
            "unverified": unverified}


def verify_peers(corpus: dict, merged: dict, paths: dict, slices, reference: str = PEER_REFERENCE) -> dict:
    """Every implementation's outputs against ``reference``'s, document by document: ids where the call returns
    them (the first trial's, from the files its workers wrote), counts otherwise; warm passes and later trials
    were compared with the first pass by the workers. -> per implementation ``classify_exactness``'s verdict,
    with ``example``: the first wrong document, where its ids first differ and the text there."""
    from .workers import read_ids

    ref = merged.get(reference, {})
    out: dict = {}
    hf = None
    for impl, m in merged.items():
        if impl == reference or (m.get("error") and not m.get("slices")):
            continue
        checks: dict = {}
        loaded: dict = {}
        for sl in slices:
            rr, sr = ref.get("slices", {}).get(sl) or {}, m.get("slices", {}).get(sl) or {}
            if "counts" not in sr:
                checks[sl] = {"error": sr.get("error") or "not run"}
            elif "ids" not in rr:
                checks[sl] = {"error": f"no reference ids ({reference}: {rr.get('error') or 'not run'})"}
            elif sr.get("ids"):
                loaded[sl] = (read_ids(rr["ids"]), read_ids(sr["ids"]))
                checks[sl] = {"docs": len(sr["counts"]), "wrong": compare_docs(*loaded[sl]), "by": "ids"}
            else:
                checks[sl] = {"docs": len(sr["counts"]), "by": "counts",
                              "wrong": [i for i, (a, b) in enumerate(zip(sr["counts"], rr["counts"])) if a != b]}
            if sl in checks and "docs" in checks[sl]:
                checks[sl]["unstable"] = (sr.get("warm_same") is False or sl in m.get("nondeterministic", []))
        v = classify_exactness(checks)
        if v["first"]:
            sl, i = v["first"]
            doc = corpus["slices"][sl][i]
            ex = {"slice": sl, "doc": i, "count": m["slices"][sl]["counts"][i],
                  "ref_count": ref["slices"][sl]["counts"][i], "excerpt": excerpt(doc, 0)}
            if sl in loaded:
                (ro, ri), (go, gi) = loaded[sl]
                want, got = ri[ro[i]:ro[i + 1]].tolist(), gi[go[i]:go[i + 1]].tolist()
                j = first_difference(want, got)
                ex.update(first_diff_token=j, ids=got[j:j + 4], ref_ids=want[j:j + 4])
                try:  # the text where they part, by the reference's offsets
                    import tokenizers
                    hf = hf or tokenizers.Tokenizer.from_file(paths["tokenizer_json"])
                    offs = hf.encode(doc).offsets
                    ex["excerpt"] = excerpt(doc, offs[j][0] if 0 <= j < len(offs) else len(doc))
                except Exception as exc:  # diagnostics only
                    ex["diag_error"] = str(exc)
            v["example"] = ex
        out[impl] = v
    return out


def verify_allcores(allcores: dict, reference: str = PEER_REFERENCE, per_doc: dict | None = None) -> dict:
    """The all-cores section's outputs against ``reference``'s batch call, workload by workload (ids where the call
    returns them, else counts); ``per_doc``: the reference's one-text-at-a-time results (merged), compared with its
    batch call on the workloads that are slices (chat, multiturn). -> per implementation and workload
    {docs, wrong, by, warm_same} or {error}."""
    from .workers import read_ids

    ref = (allcores.get(reference) or {}).get("workloads", {})
    out: dict = {}
    for impl, r in allcores.items():
        per: dict = {}
        for name, w in (r.get("workloads") or {}).items():
            rw = ref.get(name) or {}
            if w.get("error"):
                per[name] = {"error": w["error"]}
            elif impl == reference:
                sl = (per_doc or {}).get("slices", {}).get(name) or {}
                if sl.get("ids") and w.get("ids"):
                    per[name] = {"docs": w["texts"], "by": "ids", "warm_same": w["warm_same"], "vs": "one at a time",
                                 "wrong": len(compare_docs(read_ids(sl["ids"]), read_ids(w["ids"])))}
                else:
                    per[name] = {"docs": w["texts"], "by": "reference", "warm_same": w["warm_same"], "wrong": 0}
            elif not rw.get("ids"):
                per[name] = {"error": f"no reference ids ({reference}: {rw.get('error') or 'not run'})"}
            elif w.get("ids"):
                per[name] = {"docs": w["texts"], "by": "ids", "warm_same": w["warm_same"],
                             "wrong": len(compare_docs(read_ids(rw["ids"]), read_ids(w["ids"])))}
            else:
                per[name] = {"docs": w["texts"], "by": "counts", "warm_same": w["warm_same"],
                             "wrong": sum(a != b for a, b in zip(w["counts"], rw["counts"]))}
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


def summarize(corpus: dict, results: dict, clock: str = "cpu", slices=SLICES) -> dict:
    st = corpus["stats"]
    summary: dict = {}
    for impl, r in results.items():
        row: dict = {"error": r.get("error")}
        for sl in slices:
            sr = r.get("slices", {}).get(sl)
            if not sr or "first_cpu_s" not in sr:
                row[sl] = {"error": (sr or {}).get("error", r.get("error") or "not run")}
                continue
            b, n, toks = st[sl]["bytes"], st[sl]["docs"], sum(sr["counts"])
            t1, tw = sr[f"first_{clock}_s"], sr["first_wall_s"]
            tb = min(sr[f"repeat_{clock}_s"] or [t1])  # warm: the best repeat pass (the first pass if none)
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


# ---- --peers: the whole run ------------------------------------------------------------------------------------------
def without_per_document(allcores: dict) -> dict:
    """The all-cores results without what only the exactness check reads (each document's count and ids digest,
    the ids file's path): timings stay; the JSON then holds kilobytes per implementation, not megabytes."""
    return {impl: {k: ({w: {f: x for f, x in load.items() if f not in ("counts", "hashes", "ids")}
                        for w, load in v.items()} if k == "workloads" and isinstance(v, dict) else v)
                   for k, v in res.items()} if isinstance(res, dict) else res
            for impl, res in allcores.items()}


def run_peers(impls: list[str], corpus: dict, corpus_path: str, paths: dict, tmpdir: str, trials: int,
              clock: str, all_cpus: str, log: list[str], allcores: bool = True) -> dict:
    """Install the missing peers (requirements-peers.txt), then: ``trials`` rounds of one fresh process per
    implementation for the slices and one for the multi-turn workload, one thread on this (pinned) core, PEER_PASSES
    passes per slice, every text's ids written by the first round; each implementation's own batch call in one
    more fresh process on every core (``all_cpus``), HF tokenizers first (the reference); then every output checked
    against HF tokenizers'. -> the run's results (report.peers_report renders them)."""
    from .workers import bench_vocab

    reqs = read_requirements()
    install = pip_install(reqs, log)
    peers: dict = {}
    for impl in impls:
        dist, config, call, batch_call = PEERS[impl]
        st = install.get(dist) or {}
        peers[impl] = {"dist": dist, "config": config, "call": call, "batch_call": batch_call,
                       "version": st.get("version") or _dist_version(dist or "qwen-vllm-ext"),
                       "pinned": st.get("pinned"), "install": st.get("action")}
        if st.get("error"):
            peers[impl]["install_error"] = st["error"]
    ids_dir = os.path.join(tmpdir, "ids")
    os.makedirs(ids_dir, exist_ok=True)
    merged, wres = run_trials(impls, [SLICES, (MULTITURN,)], corpus_path, PEER_PASSES, tmpdir, trials,
                              ids_dir=ids_dir, verify=True, env={"RAYON_NUM_THREADS": "1"})
    for m in merged.values():  # an implementation that failed everywhere stays an error; partial ones don't
        if m.get("slices") and any("first_cpu_s" in s for s in m["slices"].values()):
            m.pop("error", None)
    ac: dict = {}
    if allcores:
        order = [PEER_REFERENCE] + [i for i in impls if i != PEER_REFERENCE]
        for impl in order:
            if impl not in impls or (merged[impl].get("error") and not merged[impl]["slices"]):
                continue
            if PEERS[impl][3] is None:
                ac[impl] = {"error": f"{impl} has no batch call here"}
                continue
            t = time.perf_counter()
            r = _spawn(impl, ["@allcores"], corpus_path, PEER_PASSES, tmpdir, timeout=900, cpus=all_cpus,
                       ids_dir=ids_dir)
            ac[impl] = r.get("allcores") or {"error": r.get("error", "no result")}
            ac[impl]["load"] = r.get("load")
            print(f"  all cores {impl:<21} {time.perf_counter() - t:6.1f} s  "
                  + ("error: " + ac[impl]["error"][:80] if ac[impl].get("error") else "ok"), flush=True)
    for impl, p in peers.items():  # why an unavailable one is unavailable: pip's reason first, then the import's
        err = merged[impl].get("error") if not merged[impl].get("slices") else None
        if err:
            p["why"] = (f"not installed: {p['install_error']}" if p.get("install_error") else err)
            if p.get("install_error") and "ModuleNotFoundError" not in err and "ImportError" not in err:
                p["why"] += f"; {err}"
    exactness = verify_peers(corpus, merged, paths, PEER_SLICES)
    if PEER_REFERENCE in merged and merged[PEER_REFERENCE].get("slices"):
        exactness[PEER_REFERENCE] = {"status": "reference", "docs": {}, "wrong": {}, "wrong_docs": 0}
    allcores_check = verify_allcores(ac, per_doc=merged.get(PEER_REFERENCE)) if ac else {}
    return {"slices": list(PEER_SLICES), "vocab": bench_vocab(), "peers": peers, "install": install,
            "requirements": reqs, "summary": summarize(corpus, merged, clock, PEER_SLICES), "exactness": exactness,
            "load_memory": _loads(wres), "allcores": without_per_document(ac), "allcores_check": allcores_check,
            "workers": [{k: v for k, v in r.items() if k != "slices"} for r in wres]}
