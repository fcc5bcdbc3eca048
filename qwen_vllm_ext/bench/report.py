"""TokenStorm output: a terminal table, the JSON report, and PNG plots (TTFT CDF, throughput over time)."""
from __future__ import annotations

import json
import os
from typing import Any


def _ms(v):
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def table(report: dict[str, Any]) -> str:
    """The terminal summary."""
    lines = []
    tp = report["throughput"]
    lines.append(f"requests {tp['requests']}  completed {tp['completed']}  failed {tp['failed']}  "
                 f"span {tp['duration_s']:.2f} s")
    lines.append(f"throughput: {_num(tp['request_throughput'])} req/s, {_num(tp['output_token_throughput'], '{:.1f}')} "
                 f"output tok/s, {_num(tp['total_token_throughput'], '{:.1f}')} total tok/s")
    if tp["slos"]:
        slo = ", ".join(f"{k[:-2]} ≤ {v * 1000:g} ms" for k, v in tp["slos"].items())
        lines.append(f"goodput ({slo}): {_num(tp['goodput'])} req/s ({tp['good_requests']} requests)")
    lines.append("")
    lines.append(f"{'metric (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>8}")
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency")):
        s = report["latency"][key]
        lines.append(f"{name:<14}{_ms(s['mean']):>10}{_ms(s['p50']):>10}{_ms(s['p90']):>10}{_ms(s['p99']):>10}"
                     f"{s['n']:>8}")
    lines.append("")
    errs = report["errors"]
    lines.append("errors: " + (", ".join(f"{k} × {v}" for k, v in errs.items()) if errs else "none"))
    acc = report["accounting"]
    mm = acc["mismatches"]
    lines.append(f"accounting: {acc['checked_requests']} requests checked"
                 f"{' (ledger included)' if acc['ledger_checked'] else ' (no ledger given)'}, {len(mm)} mismatches")
    for m in mm[:20]:
        lines.append(f"  #{m['index']} {m['request_id']}: {m['check']} expected {m['expected']} got {m['got']}"
                     f"{' — ' + m['detail'] if m.get('detail') else ''}")
    if len(mm) > 20:
        lines.append(f"  … {len(mm) - 20} more in the JSON report")
    hh = report["header_honesty"]
    ov = hh["overshoot"]
    if ov.get("limit_tokens") is None and ov.get("limit_requests") is None:
        lines.append("header honesty: no x-ratelimit-* headers seen")
    else:
        lines.append(f"header honesty: {hh['denials_checked']} denials checked, {len(hh['violations'])} violations; "
                     f"overshoot {ov['overshoot_tokens']} tokens (max {ov['max_admitted_tokens']} admitted in "
                     f"{ov['window_s']:g} s vs limit {ov['limit_tokens']}), {ov['overshoot_requests']} requests "
                     f"(max {ov['max_admitted_requests']} vs limit {ov['limit_requests']})")
        for v in hh["violations"][:10]:
            lines.append(f"  #{v['index']} denied although #{v['header_from']} said {v['remaining_tokens']} tokens "
                         f"remain ({v['reserved_in_between']} reserved in between; cost {v['cost']})")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, ensure_ascii=False, default=str)
        fh.write("\n")


def plot(report: dict[str, Any], ttfts: list[float], path: str) -> None:
    """Two panels: TTFT CDF, and output tokens + completed requests per second over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = sorted(t * 1000 for t in ttfts)
    if xs:
        a.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
    a.set_xlabel("TTFT (ms)")
    a.set_ylabel("fraction of requests")
    a.set_title("TTFT CDF")
    a.grid(alpha=0.3)
    tl = report["timeline"]
    b.plot([p["t_s"] for p in tl], [p["output_chunks_per_s"] for p in tl], label="token chunks/s")
    b.set_xlabel("time since start (s)")
    b.set_ylabel("token-carrying chunks / s (= tokens/s at one token per chunk)")
    b2 = b.twinx()
    b2.plot([p["t_s"] for p in tl], [p["requests_per_s"] for p in tl], color="tab:orange", label="requests/s")
    b2.set_ylabel("completed requests / s")
    b.set_title("throughput over time")
    lines = b.get_lines() + b2.get_lines()
    b.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
