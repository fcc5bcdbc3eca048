"""The report: the text table, the JSON and the plot."""
from __future__ import annotations

import os
import statistics

from .common import BATCH_DOCS, HEADLINE, REFERENCE, SLICES, TARGETS
from .runner import _f, _steal_share


def report(corpus, summary, loads, mism, meta, batch=None) -> tuple[str, dict]:
    L = []
    st = corpus["stats"]
    vocab_name = {"qwen3": "Qwen3", "qwen3.6": "Qwen3.5/3.6"}[meta.get("vocab", "qwen3")]
    L.append(f"{vocab_name} token counting benchmark - one core (cpu {meta['cpu']}), Python {meta['python']}, "
             f"{'quick' if meta['quick'] else 'full'} run, corpus recipe {corpus['recipe']}, seed {corpus['seed']}, "
             f"corpus sha256 {corpus['sha256']}")
    L.append(f"load average at start/end: {meta['loadavg_start']} / {meta['loadavg']}   ({os.cpu_count()} CPUs; "
             "other processes on this machine add noise)")
    if meta.get("steal_s") is not None:
        L.append(f"host steal time over the run: {meta['steal_s']:.1f} s = "
                 f"{_steal_share(meta['steal_s'], meta['run_s'], meta['cpus_allowed'])} of the CPU time of "
                 f"{meta['cpus_allowed']} CPUs x {meta['run_s']:.0f} s (CPU time the hypervisor gave to other guests)")
    L.append("")
    L.append("Corpus (UTF-8 MB = 10^6 bytes; documents 1-16 KB cut at line boundaries; chat = messages <= 300 chars)")
    L.append(f"  {'slice':<6} {'docs':>6} {'bytes':>10} {'chars':>10} {'CJK share':>9}  sources (bytes)")
    for sl in SLICES:
        s = st[sl]
        if sl == "mixed":
            src = " + ".join(f"{k} {v['bytes'] / 1e6:.2f} MB ({v['share']:.0%})/{v['docs']} docs"
                             for k, v in s["by_kind"].items()) + "; disjoint from the slices below, same sources"
        elif sl in corpus["makeup"]:
            src = ", ".join(f"{k} {v['bytes'] / 1e6:.2f} MB/{v['files']} files"
                            for k, v in sorted(corpus["makeup"][sl].items(), key=lambda kv: -kv[1]["bytes"]))
        elif sl == "chat":
            src = "messages: " + ", ".join(f"{k} {v}" for k, v in s["mix"].items()) + " (zh/en/code: held-out text)"
        L.append(f"  {sl:<6} {s['docs']:>6} {s['bytes']:>10,} {s['chars']:>10,} {s['cjk_char_share']:>9.2f}  {src}")
    for n in corpus["notes"]:
        L.append(f"  note: {n}")
    for w in corpus["warnings"]:
        L.append(f"  WARNING: {w}")
    L.append("")
    L.append("Throughput (MB/s = 10^6 UTF-8 bytes/s), first pass over unseen text after a warm-up; slices timed in"
             " this order in one fresh process per implementation;"
             f" best of {meta['trials']} trial process(es); timed by {meta['clock'].upper()} time"
             + (" of the pinned process (robust to other load; 'wall MB/s' = wall clock, best trial)"
                if meta["clock"] == "cpu" else "") + "; 'warm' = best repeat pass (caches have seen the text)")
    hdr = (f"  {'implementation':<21} {'mixed MB/s':>10} {'Mtok/s':>7} {'warm MB/s':>9} {'wall MB/s':>9} | {'zh MB/s':>7} "
           f"{'en MB/s':>7} {'code MB/s':>9} | {'chat kcalls/s':>13} {'chat MB/s':>9}")
    L.append(hdr)
    for impl, row in summary.items():
        if row.get("error"):
            L.append(f"  {impl:<21} unavailable: {row['error'][:90]}")
            continue
        g = lambda sl, k: row[sl].get(k) if isinstance(row.get(sl), dict) else None  # noqa: E731
        chat_k = g("chat", "calls_s")
        L.append(f"  {impl:<21} {_f(g('mixed', 'MB_s')):>10} {_f(g('mixed', 'tokens_s') and g('mixed', 'tokens_s') / 1e6):>7} "
                 f"{_f(g('mixed', 'warm_MB_s')):>9} {_f(g('mixed', 'wall_MB_s')):>9} | {_f(g('zh', 'MB_s')):>7} {_f(g('en', 'MB_s')):>7} "
                 f"{_f(g('code', 'MB_s')):>9} | {_f(chat_k and chat_k / 1e3, '{:.1f}'):>13} {_f(g('chat', 'MB_s')):>9}"
                 + ("   (chat: one batch call)" if impl in ("ours.count_batch", "hf.encode_batch") else ""))
    L.append("")
    L.append("Tokens/s (millions; first pass) and the spread of first-pass times over the trial processes (max/min,"
             f" {meta['clock']} time)")
    L.append(f"  {'implementation':<21} " + " ".join(f"{sl:>7}" for sl in SLICES) + "   spread " +
             " ".join(f"{sl:>5}" for sl in SLICES))
    for impl, row in summary.items():
        if row.get("error"):
            continue
        cells = [_f(row[sl].get("tokens_s") and row[sl]["tokens_s"] / 1e6) if isinstance(row.get(sl), dict) else "-"
                 for sl in SLICES]
        spread = [_f(row[sl].get("spread"), "{:.2f}") if isinstance(row.get(sl), dict) else "-" for sl in SLICES]
        L.append(f"  {impl:<21} " + " ".join(f"{c:>7}" for c in cells) + "          " +
                 " ".join(f"{c:>5}" for c in spread))
    L.append("")
    L.append("Load (wall clock in a fresh process, warm OS page cache; median and min over the fresh processes) and"
             " memory (RSS deltas from before the import; peak while counting the mixed corpus, outputs dropped)")
    L.append(f"  {'implementation':<21} {'import s':>8} {'load s':>7} {'(min)':>7} {'RSS after load MB':>17} "
             f"{'peak MB':>8}  load = ")
    for impl in summary:
        d = loads.get(impl)
        if not d:
            continue
        bs = f" [Tokenizer.bundled() alone {d['bundled_s']['median']:.3f} s]" if d.get("bundled_s") else ""
        L.append(f"  {impl:<21} {_f(d['import_s'] and d['import_s']['median'], '{:.3f}'):>8} "
                 f"{_f(d['load_s'] and d['load_s']['median'], '{:.3f}'):>7} "
                 f"{_f(d['load_s'] and d['load_s']['min'], '{:.3f}'):>7} "
                 f"{_f(d['rss_mb'] and d['rss_mb']['median'], '{:.1f}'):>17} "
                 f"{_f(d['peak_mb'] and d['peak_mb']['median'], '{:.1f}'):>8}  {d.get('what')}{bs}"
                 + (f" ({d['import_how']})" if d.get("import_how") else ""))
    L.append("")
    # ratios of the headline implementation
    ratios: dict = {}
    head = summary.get(HEADLINE, {})
    L.append(f"Ratios: {HEADLINE} vs each (first-pass MB/s; chat: calls/s)")
    L.append(f"  {'vs':<21} " + " ".join(f"{sl:>7}" for sl in SLICES))
    for impl, row in summary.items():
        if impl.startswith("ours.") or row.get("error"):
            continue
        vals = {}
        for sl in SLICES:
            a, b = head.get(sl, {}), row.get(sl, {})
            key = "calls_s" if sl == "chat" else "MB_s"
            vals[sl] = a[key] / b[key] if a.get(key) and b.get(key) else None
        ratios[impl] = vals
        L.append(f"  {impl:<21} " + " ".join(f"{_f(vals[sl], '{:.2f}x'):>7}" for sl in SLICES))
    # the same ratios trial by trial: trial k of every implementation ran in the same rotation round, minutes
    # apart at most, so a fast or slow stretch of the machine hits both sides; the median over the trials does
    # not hang on one lucky process of either side (the best-of-trials ratios above do)
    paired: dict = {}
    L.append(f"Paired ratios: {HEADLINE} vs each, trial k against trial k (first pass; median over the trials, "
             "min-max)")
    for impl, row in summary.items():
        if impl.startswith("ours.") or row.get("error"):
            continue
        vals = {}
        for sl in SLICES:
            a, b = head.get(sl, {}).get("trials_seconds") or [], row.get(sl, {}).get("trials_seconds") or []
            per = [y / x for x, y in zip(a, b) if x and y]  # time ratio = speed ratio (same text)
            vals[sl] = {"median": statistics.median(per), "min": min(per), "max": max(per), "n": len(per)} if per else None
        paired[impl] = vals
        L.append(f"  {impl:<21} " + " ".join(
            f"{_f(vals[sl] and vals[sl]['median'], '{:.2f}x'):>7}" for sl in SLICES) + "   range " + " ".join(
            f"{vals[sl]['min']:.1f}-{vals[sl]['max']:.1f}" if vals[sl] else "-" for sl in SLICES))
    L.append("")
    # agreement
    L.append(f"Agreement with the reference ({REFERENCE}, per document: token count; ids where the API returns ids)")
    L.append(f"  {'implementation':<21} " + " ".join(f"{sl:>12}" for sl in SLICES))
    if REFERENCE not in summary or summary[REFERENCE].get("error"):
        L.append(f"  (reference {REFERENCE} not run: no agreement check)")
    for impl, per in mism.items():
        cells = []
        for sl in SLICES:
            p = per.get(sl)
            if not p:
                cells.append(f"{'-':>12}")
            elif p["count_mismatches"] or p["id_only_mismatches"]:
                cells.append(f"{p['count_mismatches']}+{p['id_only_mismatches']}id/{p['docs']}".rjust(12))
            else:
                cells.append(f"{'ok ' + str(p['docs']):>12}")
        L.append(f"  {impl:<21} " + " ".join(cells))
    listed = 0
    for impl, per in mism.items():
        for sl, p in per.items():
            for ex in p["examples"]:
                if listed >= 20:
                    break
                listed += 1
                L.append(f"  mismatch {impl} {sl} doc {ex['doc']}: {ex['count']} vs ref {ex['ref_count']}"
                         + (" (ids differ, same count)" if ex["ids_only"] else "")
                         + (f", first diff at token {ex['first_diff_token']}: {ex.get('ours_ids')} vs {ex.get('ref_ids')}"
                            if "first_diff_token" in ex else "") + f"; near {ex['excerpt']}")
    L.append("")
    if batch and not batch.get("error"):
        L.append(f"Batch calls over threads (wall clock; threads=1 vs threads={batch['threads']} = all cores this process"
                 f" may use, CPUs {batch['cpus']}; median of {batch['rounds']} paired rounds, order alternating; first"
                 " pass = a new tokenizer per side and round, warmed up on other text; warm = caches have seen the"
                 " texts; steal = CPU time the hypervisor gave to other guests meanwhile, share of all these CPUs' time;"
                 " machine = what the machine gave the same number of threads right after, on a probe loop of random"
                 " reads over 8 MiB (not the tokenizer): 2.00x = each CPU as fast as one alone)")
        L.append(f"  {'workload':<34} {'call':<19} {'state':<10} {'1 thread s':>10} {'N threads s':>11} "
                 f"{'speedup':>8} {'(min-max)':>11} {'identical':>9}")
        for name, w in batch["workloads"].items():
            label = f"{name}: {w['texts']:,} texts, {w['bytes'] / 1e6:.2f} MB"
            for fn in ("count_tokens_batch", "encode_batch"):
                for state, r in w[fn].items():
                    L.append(f"  {label:<34} {fn:<19} {state:<10} {r['one_thread_median_s']:>10.4f} "
                             f"{r['threads_median_s']:>11.4f} {r['speedup_median']:>7.2f}x "
                             f"{min(r['speedups']):>5.2f}-{max(r['speedups']):<5.2f} {'yes' if r['identical'] else 'NO':>9}"
                             + (f"  steal {_steal_share(r['steal_s'], r['wall_s'], len(batch['cpus']))}"
                                if r.get("steal_s") is not None else "")
                             + (f"  machine {r['machine_speedup_median']:.2f}x" if "machine_speedup_median" in r else ""))
        L.append("")
    elif batch:
        L.append(f"Batch calls over threads: not measured ({batch['error'][:200]})")
        L.append("")
    # targets
    targets = []

    def tgt(name, ok, detail):
        targets.append({"target": name, "pass": ok, "detail": detail})
        L.append(f"  [{'PASS' if ok else ('FAIL' if ok is not None else 'N/A ')}] {name}: {detail}")

    L.append("Targets (headline: " + HEADLINE + ", first pass over unseen text)")
    hm = head.get("mixed", {}).get("MB_s")
    tt = summary.get("tiktoken", {}).get("mixed", {}).get("MB_s")
    r = hm / tt if hm and tt else None
    tgt(f">= {TARGETS['vs_tiktoken']:g}x tiktoken on the mixed corpus", (r >= TARGETS["vs_tiktoken"]) if r else None,
        f"{_f(hm)} vs {_f(tt)} MB/s = {_f(r, '{:.2f}x')}")
    hfs = [(k, summary.get(k, {}).get("mixed", {}).get("MB_s")) for k in ("hf.encode", "hf.encode_batch")]
    hfs = [(k, v) for k, v in hfs if v]
    if hfs and hm:
        k, v = max(hfs, key=lambda kv: kv[1])
        r = hm / v
        tgt(">= 15x HF tokenizers on the mixed corpus (vs the faster HF call)", r >= TARGETS["vs_hf_mixed"],
            f"{hm:.2f} vs {v:.2f} MB/s ({k}) = {r:.2f}x; " + ", ".join(f"{kk} {hm / vv:.2f}x" for kk, vv in hfs))
    else:
        tgt(">= 15x HF tokenizers on the mixed corpus", None, "not measured")
    worst = []
    ok = True if head and summary.get("tiktoken") else None
    for sl in SLICES:
        key = "calls_s" if sl == "chat" else "MB_s"
        a = head.get(sl, {}).get(key)
        b = summary.get("tiktoken", {}).get(sl, {}).get(key)
        if a and b:
            worst.append(f"{sl} {a / b:.2f}x")
            ok = ok and a >= TARGETS["vs_tiktoken"] * b
        else:
            ok = None
    tgt(f">= {TARGETS['vs_tiktoken']:g}x tiktoken on every slice (chat: calls/s)", ok, ", ".join(worst) or "not measured")
    if batch and not batch.get("error"):
        cells, ok = [], True
        for name, w in batch["workloads"].items():
            for fn in ("count_tokens_batch", "encode_batch"):
                for state, r in w[fn].items():
                    if fn == "count_tokens_batch":
                        ok = ok and r["speedup_median"] >= TARGETS["batch_speedup"]
                    cells.append(f"{name} {fn} {state} {r['speedup_median']:.2f}x")
        tgt(f">= {TARGETS['batch_speedup']:g}x count_tokens_batch throughput with threads={batch['threads']} vs 1 "
            f"(10,000 chat messages; {BATCH_DOCS} long documents)", ok if batch["threads"] > 1 else None,
            "; ".join(cells) + ("" if batch["threads"] > 1 else " (one core: nothing to spread)"))
        same = all(r["identical"] for w in batch["workloads"].values()
                   for fn in ("count_tokens_batch", "encode_batch") for r in w[fn].values())
        tgt("batch results identical to one call per text, in order", same, "every round of every call checked")
    else:
        tgt(f">= {TARGETS['batch_speedup']:g}x count_tokens_batch with all cores", None, "not measured")
    ld = (loads.get("ours.Tokenizer.count") or loads.get("ours.encode") or loads.get("ours.count_batch")
          or loads.get(HEADLINE) or {})
    lv = ld.get("load_s") and ld["load_s"]["median"]
    cl = loads.get(HEADLINE, {}).get("load_s")
    tgt("load <= 0.3 s", (lv <= TARGETS["load_s"]) if lv is not None else None,
        f'{ld.get("what") or "load"}: median {_f(lv, "{:.3f}")} s over '
        f'{ld["load_s"]["n"] if ld.get("load_s") else 0} fresh processes (import {_f(ld.get("import_s") and ld["import_s"]["median"], "{:.3f}")} s not included); '
        f'first count_tokens() incl. default Calculator: {_f(cl and cl["median"], "{:.3f}")} s')
    return "\n".join(L), {"ratios": ratios, "paired_ratios": paired, "targets": targets}


def plot(summary: dict, path: str, batch: dict | None = None) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    impls = [k for k, v in summary.items() if not v.get("error")]
    import matplotlib.ticker  # noqa: F401
    with_batch = bool(batch and not batch.get("error"))
    fig, axes = plt.subplots(1, 3 if with_batch else 2, figsize=(19 if with_batch else 13, 5.4))
    sls = ["mixed", "zh", "en", "code"]
    w = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        vals = [summary[impl].get(sl, {}).get("MB_s") or 0 for sl in sls]
        axes[0].bar([j + i * w for j in range(len(sls))], vals, w, label=impl)
    axes[0].set_xticks([j + 0.4 - w / 2 for j in range(len(sls))], sls)
    axes[0].set_ylabel("MB/s (one core, first pass)")
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    axes[0].set_title("Throughput per slice")
    vals = [(summary[k].get("chat", {}).get("calls_s") or 0) / 1e3 for k in impls]
    axes[1].barh(impls, vals)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("thousand calls/s (chat messages <= 300 chars)")
    axes[1].set_title("Short messages")
    axes[1].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    if with_batch:
        labels, vals, errs, machine = [], [], [], []
        for name, w in batch["workloads"].items():
            for fn in ("count_tokens_batch", "encode_batch"):
                for state, r in w[fn].items():
                    if "machine_speedup_median" in r:
                        machine.append((len(labels), r["machine_speedup_median"]))
                    labels.append(f"{name} {fn.split('_')[0]} {state.replace('_', ' ')}")
                    vals.append(r["speedup_median"])
                    errs.append([[r["speedup_median"] - min(r["speedups"])], [max(r["speedups"]) - r["speedup_median"]]])
        ys = list(range(len(labels)))
        axes[2].barh(ys, vals, xerr=[[e[0][0] for e in errs], [e[1][0] for e in errs]], color="tab:green")
        if machine:
            axes[2].plot([m for _, m in machine], [y for y, _ in machine], "kD", ms=5,
                         label="machine: probe loop on the same threads, right after")
        axes[2].set_yticks(ys, labels, fontsize=8)
        axes[2].axvline(TARGETS["batch_speedup"], color="tab:red", ls="--", lw=1, label=f"target {TARGETS['batch_speedup']:g}x")
        axes[2].axvline(1.0, color="grey", lw=0.8)
        axes[2].set_xlabel(f"speedup, threads={batch['threads']} vs 1 (wall clock; median, min-max)")
        axes[2].set_title("Batch calls over threads")
        axes[2].legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.13), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
