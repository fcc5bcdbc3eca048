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
        else:
            src = "generated, seeded (calculator_bench/languages.py)"
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


# ---- --peers: every peer side by side (markdown tables, text, plot) -------------------------------------------------
def markdown_table(header: list[str], rows: list[list[str]], right: int = 1) -> str:
    """A markdown table; the columns from ``right`` on are right-aligned (figures)."""
    cells = [header] + rows
    width = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.rjust(w) if i >= right else c.ljust(w)  # noqa: E731
                                      for i, (c, w) in enumerate(zip(r, width))) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ":") if i >= right else ("-" * (w + 2)) for i, w in enumerate(width)) + "|"
    return "\n".join([fmt(header), sep] + [fmt(r) for r in rows])


def ranked(summary: dict, exactness: dict, sl: str = "mixed", key: str = "MB_s") -> list[str]:
    """The implementations ranked for speed on one slice, fastest first: only those whose ids were checked equal to
    HF tokenizers' on every document of every slice (status exact, or the reference itself)."""
    ok = [i for i, row in summary.items() if (exactness.get(i) or {}).get("status") in ("exact", "reference")
          and isinstance(row.get(sl), dict) and row[sl].get(key)]
    return sorted(ok, key=lambda i: -summary[i][sl][key])


def _speed_cell(row: dict, base: dict, sl: str, key: str, wrong: bool) -> str:
    v = (row.get(sl) or {}).get(key) if isinstance(row.get(sl), dict) else None
    if v is None:
        return "-"
    b = (base.get(sl) or {}).get(key) if isinstance(base.get(sl), dict) else None
    return f"{v:.1f}" + (f" ({v / b:.2f}x)" if b else "") + (" ✗" if wrong else "")


def peer_slice_table(summary: dict, exactness: dict, slices, key: str = "MB_s",
                     baseline: str = "tiktoken") -> tuple[list[str], list[list[str]]]:
    """Rows = slices, columns = the implementations that ran: MB/s (``key``: MB_s cold, warm_MB_s warm) and the
    ratio to ``baseline`` on the same slice; ✗ marks a slice where the implementation got some document's ids
    wrong. Last row: each implementation's rank on the mixed slice among the exact ones ("inexact": not ranked)."""
    impls = [i for i, r in summary.items() if not r.get("error")]
    base = summary.get(baseline) or {}
    rows = []
    for sl in slices:
        rows.append([sl] + [_speed_cell(summary[i], base, sl, key, sl in ((exactness.get(i) or {}).get("wrong") or {}))
                            for i in impls])
    order = ranked(summary, exactness, "mixed", key)
    rows.append(["rank (mixed)"] + [str(order.index(i) + 1) if i in order else
                                    ((exactness.get(i) or {}).get("status") or "-") for i in impls])
    return ["slice"] + impls, rows


def _exact_cell(v: dict | None) -> str:
    if not v:
        return "-"
    if v["status"] == "reference":
        return "reference"
    if v["status"] == "inexact":
        total = sum(v["docs"].values())
        parts = [f"{sl} {n}/{v['docs'][sl]}" for sl, n in v["wrong"].items()]
        parts += [f"{sl}: other ids on a later pass" for sl in v.get("unstable", []) if sl not in v["wrong"]]
        return f"**inexact**: {v['wrong_docs']}/{total} docs wrong (" + ", ".join(parts) + ")"
    if v["status"] == "unverified":
        return "unverified (" + ", ".join(f"{sl}: {why[:40]}" for sl, why in list(v["unverified"].items())[:3]) + ")"
    return f"exact ({sum(v['docs'].values())} docs, by {v['by']})"


def peer_summary_table(res: dict) -> tuple[list[str], list[list[str]]]:
    """One row per implementation: version, exactness, load and memory, cold and warm MB/s on the mixed and
    multi-turn slices with the ratio to tiktoken, rank; unavailable ones with the reason."""
    summary, ex, loads, peers = res["summary"], res["exactness"], res["load_memory"], res["peers"]
    base = summary.get("tiktoken") or {}
    order = ranked(summary, ex)
    rows = []
    for impl, p in peers.items():
        row = summary.get(impl) or {}
        if row.get("error") or impl not in summary:
            why = p.get("why") or row.get("error") or "?"
            short = ("not installed" if why.startswith("not installed") else
                     "cannot be configured like the reference" if "NotConfigurable" in why else why[:60])
            rows.append([impl, p.get("version") or "-", f"**unavailable**: {short} (below)"] + ["-"] * 8)
            continue
        ld = loads.get(impl) or {}
        med = lambda k, f="{:.3f}": _f(ld.get(k) and ld[k]["median"], f)  # noqa: E731
        rows.append([impl, p.get("version") or "-", _exact_cell(ex.get(impl)), med("import_s"), med("load_s"),
                     med("rss_mb", "{:.1f}"),
                     _speed_cell(row, base, "mixed", "MB_s", False),
                     _speed_cell(row, base, "mixed", "warm_MB_s", False),
                     _speed_cell(row, base, "multiturn", "MB_s", False),
                     _speed_cell(row, base, "multiturn", "warm_MB_s", False),
                     str(order.index(impl) + 1) if impl in order else "not ranked"])
    return ["implementation", "version", "ids vs HF tokenizers", "import s", "load s", "RSS MB", "mixed cold MB/s",
            "mixed warm MB/s", "multiturn cold MB/s", "multiturn warm MB/s", "rank"], rows


def peer_allcores_table(res: dict) -> tuple[list[str], list[list[str]]]:
    """One row per implementation with a batch call: its call, then per workload cold and warm MB/s (wall clock,
    every allowed core) with the ratio to tiktoken's batch call, and whether its ids matched HF's batch call."""
    ac, chk = res.get("allcores") or {}, res.get("allcores_check") or {}
    names = []
    for r in ac.values():
        names += [n for n in (r.get("workloads") or {}) if n not in names]
    base = (ac.get("tiktoken") or {}).get("workloads") or {}

    def mb_s(w, state):
        if not w or w.get("error") or not w.get("cold_wall_s"):
            return None
        return w["bytes"] / 1e6 / (w["cold_wall_s"] if state == "cold" else min(w["warm_wall_s"] or [w["cold_wall_s"]]))

    def cell(w, b, state):
        v, bv = mb_s(w, state), mb_s(b, state)
        return "-" if v is None else f"{v:.1f}" + (f" ({v / bv:.2f}x)" if bv else "")

    rows = []
    for impl, r in ac.items():
        if r.get("error"):
            rows.append([impl, "-", "unavailable: " + r["error"][:80]] + ["-"] * (2 * len(names)))
            continue
        ws = r.get("workloads") or {}
        c = chk.get(impl) or {}
        bad = [f"{n} {v['wrong']}/{v['docs']}" for n, v in c.items() if v.get("wrong")]
        bad += [f"{n}: warm calls differ" for n, v in c.items() if v.get("warm_same") is False]
        errs = [n for n, v in c.items() if v.get("error")]
        verdict = ("**inexact** (" + ", ".join(bad) + ")" if bad else
                   ("unverified (" + ", ".join(errs) + ")" if errs else "exact"))
        cells = []
        for n in names:
            cells += [cell(ws.get(n), base.get(n), "cold"), cell(ws.get(n), base.get(n), "warm")]
        rows.append([impl, res["peers"].get(impl, {}).get("batch_call") or "-", verdict] + cells)
    return (["implementation", "call", "ids vs HF"] + [f"{n} {s} MB/s" for n in names for s in ("cold", "warm")],
            rows)


def peers_report(res: dict) -> str:
    """The text of a --peers run: what ran where, the tables (markdown), the unavailable peers and why, one example
    of each inexact peer's first wrong document."""
    meta, corpus = res["meta"], res["corpus"]
    vocab_name = {"qwen3": "Qwen3", "qwen3.6": "Qwen3.5/3.6"}[meta["vocab"]]
    st = corpus["stats"]
    L = [f"{vocab_name} tokenizers side by side (--peers) - one thread on one pinned core (cpu {meta['cpu']}), Python "
         f"{meta['python']}, --size-mb {meta['size_mb']:g} --chat {meta['n_chat']}"
         f"{' (--quick)' if meta['quick'] else ''}, {meta['trials']} trial process(es) per "
         f"implementation and group of slices, {meta['passes']} passes per slice, timed by "
         f"{meta['clock'].upper()} time",
         f"corpus sha256 {corpus['sha256']}; language slices {corpus.get('languages_sha256')}; multi-turn "
         f"{corpus.get('multiturn_sha256')}",
         f"load average at start/end: {meta['loadavg_start']} / {meta['loadavg']} ({os.cpu_count()} CPUs; other "
         "processes on this machine add noise)", ""]
    L.append("Slices: " + ", ".join(f"{sl} {st[sl]['bytes'] / 1e6:.2f} MB/{st[sl]['docs']}" for sl in res["slices"])
             + f" (multiturn: {st['multiturn'].get('conversations')} conversations, each request repeating the "
             "previous one and adding a turn)")
    L.append("")
    L.append("cold = the first pass of a fresh process over text it has not seen (after a warm-up on held-out text; "
             "best over the trial processes); warm = the best of the next passes over the same documents. MB/s = "
             "10^6 UTF-8 bytes per CPU second; (Nx) = the ratio to tiktoken on the same slice. Ids are checked "
             "document by document against HF tokenizers on every slice (first pass; every later pass and trial "
             "against the first): an implementation with any document wrong is inexact and not ranked.")
    L.append("")
    L.append("### Summary")
    L.append("")
    L.append(markdown_table(*peer_summary_table(res), right=3))
    L.append("")
    for title, key in (("cold", "MB_s"), ("warm", "warm_MB_s")):
        L.append(f"### One core, {title} MB/s per slice (x tiktoken; ✗ = some document's ids wrong on that slice)")
        L.append("")
        L.append(markdown_table(*peer_slice_table(res["summary"], res["exactness"], res["slices"], key)))
        L.append("")
    ac = res.get("allcores") or {}
    cores = next((len(r["cores"]) for r in ac.values() if r.get("cores")), None)
    if ac:
        L.append(f"### All cores ({cores} cores), each implementation's own batch call, wall clock (x tiktoken's "
                 "batch call)")
        L.append("")
        L.append(markdown_table(*peer_allcores_table(res), right=3))
        L.append("")
    L.append("### How each was loaded")
    L.append("")
    for impl, p in res["peers"].items():
        L.append(f"- `{impl}` {p.get('version') or ''}: {p['config']}" + (f" — **unavailable**: {p['why']}"
                                                                            if p.get("why") else ""))
    L.append("")
    examples = [(i, v["example"]) for i, v in res["exactness"].items() if v.get("example")]
    if examples:
        L.append("### First wrong document of each inexact implementation")
        L.append("")
        for impl, e in examples:
            L.append(f"- `{impl}` {e['slice']} doc {e['doc']}: {e['count']} tokens vs HF {e['ref_count']}"
                     + (f"; first difference at token {e['first_diff_token']}: {e['ids']} vs HF {e['ref_ids']}"
                        if "first_diff_token" in e else "") + f"; near {e['excerpt']}")
        L.append("")
    for ln in meta.get("log", []):
        L.append(f"note: {ln}")
    return "\n".join(L)


def peers_plot(res: dict, path: str) -> str | None:
    """Cold and warm MB/s per slice (one core; hollow markers: inexact) and the all-cores MB/s per workload."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception:
        return None
    summary, ex, slices = res["summary"], res["exactness"], res["slices"]
    impls = [k for k, v in summary.items() if not v.get("error")]
    ac = {k: v for k, v in (res.get("allcores") or {}).items() if not v.get("error")}
    fig, axes = plt.subplots(1, 3 if ac else 2, figsize=(22 if ac else 16, 6.8))
    marks = "osD^v<>ph*X"
    color = {impl: f"C{n % 10}" for n, impl in enumerate(res["peers"])}  # one colour per implementation throughout
    for ax, key, title in ((axes[0], "MB_s", "one core, cold"), (axes[1], "warm_MB_s", "one core, warm")):
        for n, impl in enumerate(impls):
            xs = [j for j, sl in enumerate(slices) if isinstance(summary[impl].get(sl), dict)
                  and summary[impl][sl].get(key)]
            ys = [summary[impl][slices[j]][key] for j in xs]
            exact = (ex.get(impl) or {}).get("status") in ("exact", "reference")
            ax.plot(xs, ys, marker=marks[n % len(marks)], ls="-" if exact else ":", lw=1, color=color.get(impl),
                    mfc=None if exact else "none", label=impl + ("" if exact else " (inexact)"))
        ax.set_xticks(range(len(slices)), slices, rotation=60, fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylabel("MB/s (10^6 UTF-8 bytes per CPU second)")
        ax.set_title(f"{title} ({res['meta']['vocab']})")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    if ac:
        names = []
        for r in ac.values():
            names += [n for n in r["workloads"] if n not in names]
        w = 0.8 / max(1, len(ac))
        for n, (impl, r) in enumerate(ac.items()):
            vals = []
            for name in names:
                wl = r["workloads"].get(name) or {}
                vals.append(wl["bytes"] / 1e6 / min(wl["warm_wall_s"]) if wl.get("warm_wall_s") else 0)
            axes[2].bar([j + n * w for j in range(len(names))], vals, w, label=impl, color=color.get(impl))
        axes[2].set_xticks([j + 0.4 - w / 2 for j in range(len(names))], names)
        axes[2].set_yscale("log")
        axes[2].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        cores = next(len(r["cores"]) for r in ac.values())
        axes[2].set_ylabel(f"MB/s, wall clock, {cores} cores (warm)")
        axes[2].set_title("all cores: each one's own batch call")
        axes[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
