"""Router policies for multi-turn conversations, and what a second replica costs on this machine -- one run.

    .venv/bin/python -m benchmarks.bench_fleet [--replicas 2,3] [--sessions 8] [--turns 10] [--rate 0.5] \
        [--serve-arg=--block-size=32 ...] [--out DIR]

1. For each N of ``--replicas``: ``python -m qwen_vllm_ext.fleet --replicas N`` (demo model, local Redis, gateway
   off; 2 replicas get one core each, more than the cores share them with ``VLLM_CPU_OMP_THREADS_BIND=nobind``) with
   its router (``consistent_hash``: affinity by ``x-session-id``) plus two more vllm-router processes over the same
   N replicas (``cache_aware``, ``round_robin``; the fleet's flags). The replicas run with
   ``VLLM_SERVER_DEV_MODE=1`` so that ``POST /reset_prefix_cache`` empties every prefix cache before each policy's run.
2. The same seeded TokenStorm workload through each router: ``--sessions`` chat sessions of ``--turns`` turns
   (each turn adds ``--input-len`` tokens of user text, the model's reply goes back into the history), arriving
   at ``--rate`` sessions/s.
3. The fleet is stopped and one replica is started alone (``python -m qwen_vllm_ext.serve``, both cores): the same
   workload straight to it.

Per run: cached-token share (cached / prompt tokens, from the usage of the streamed chunks), computed prefill
tokens (prompt - cached), mean and p99 TTFT, output tokens/s, requests completed. Target: ``consistent_hash``
computes >= 60% fewer prefill tokens than ``round_robin`` (see docs/results/fleet.md for the bound: with N replicas
round_robin recomputes about N turns' worth of new tokens per turn, so affinity saves at most about 1 - 1/N).
Writes <out>/bench_fleet.json and bench_fleet.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from qwen_vllm_ext.bench.server import FleetProcess, ServeProcess, free_port_block
from qwen_vllm_ext.fleet.plan import ROUTER_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "qwen3-demo"
EXTRA_POLICIES = ("cache_aware", "round_robin")


def start_router(policy: str, workers: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port_block(2)
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "vllm-router"), "--port", str(port),
                             "--prometheus-port", str(port + 1), "--worker-urls", *workers, "--policy", policy,
                             *ROUTER_FLAGS], stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {policy} router did not start; log {log_path}")
        time.sleep(0.5)


def reset_caches(replicas: list[str]) -> None:
    for url in replicas:
        r = httpx.post(url + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()


def storm(url: str, args, out_dir: str) -> dict:
    cmd = [sys.executable, "-m", "qwen_vllm_ext.bench.token_storm", "--base-url", url, "--model", MODEL,
           "--turns", str(args.turns), "--num-requests", str(args.sessions * args.turns), "--rate", str(args.rate),
           "--input-len", str(args.input_len), "--input-std", "0", "--output-len", str(args.output_len),
           "--output-std", "0", "--seed", str(args.seed), "--template", "qwen3-reuse", "--retries", "0",
           "--output-dir", out_dir]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(f"TokenStorm failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    rep = json.load(open(os.path.join(out_dir, "token_storm.json")))
    done = [r for r in rep["records"] if r["status"] == "ok"]
    prompt = sum(r["final_usage"]["prompt_tokens"] for r in done)
    cached = sum(r["cached_tokens"] or 0 for r in done)
    ttft = rep["latency"]["ttft_s"]
    return {"requests": rep["throughput"]["requests"], "completed": rep["throughput"]["completed"],
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_prefill_tokens": prompt - cached,
            "cached_share": cached / prompt if prompt else 0.0, "ttft_mean_s": ttft["mean"], "ttft_p99_s": ttft["p99"],
            "output_tokens_per_s": rep["throughput"]["output_token_throughput"],
            "duration_s": rep["throughput"]["duration_s"], "errors": rep["errors"]}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    axes[0].bar(names, [runs[n]["computed_prefill_tokens"] for n in names], color="tab:blue")
    axes[0].set_title("computed prefill tokens (lower is better)")
    axes[1].bar(names, [runs[n]["cached_share"] for n in names], color="tab:green")
    axes[1].set_title("cached-token share")
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], [runs[n]["ttft_mean_s"] * 1000 for n in names], 0.4, label="mean")
    axes[2].bar([i + 0.2 for i in x], [runs[n]["ttft_p99_s"] * 1000 for n in names], 0.4, label="p99")
    axes[2].set_xticks(list(x), names)
    axes[2].set_title("TTFT (ms, log scale)")
    axes[2].set_yscale("log")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=40)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    w = result["workload"]
    fig.suptitle(f"{w['sessions']} sessions x {w['turns']} turns, {w['rate']} sessions/s, demo model on "
                 f"{result['machine']['cpus']} cores {' '.join(w.get('serve_arg') or [])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_fleet(n: int, env: dict, args, work: str) -> dict:
    """Every policy through one fleet of ``n`` replicas (caches emptied before each)."""
    os.makedirs(work, exist_ok=True)
    runs, routers = {}, []
    fleet = FleetProcess(n, os.path.join(work, "fleet.log"), os.path.join(work, "data"), env=env, cwd=ROOT,
                         serve_args=args.serve_arg)
    try:
        fleet.wait_ready()
        urls = {"consistent_hash": fleet.base_url}
        for policy in EXTRA_POLICIES:
            proc, url = start_router(policy, fleet.replica_urls, os.path.join(work, f"router-{policy}.log"))
            routers.append(proc)
            urls[policy] = url
        for policy, url in urls.items():
            reset_caches(fleet.replica_urls)
            name = f"{n} replicas, {policy}"
            runs[name] = storm(url, args, os.path.join(work, policy))
            print(name, json.dumps(runs[name]), flush=True)
    finally:
        for proc in routers:
            proc.terminate()
            proc.wait(30)
        fleet.stop()
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="2,3", help="comma-separated fleet sizes")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--rate", type=float, default=0.5, help="sessions per second")
    p.add_argument("--input-len", type=int, default=200, help="tokens of user text per turn")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="flag for every replica (repeatable)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "fleet"))
    p.add_argument("--replot", metavar="JSON", help="redraw the PNG of an earlier run's JSON and exit")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.load(open(args.replot)), os.path.splitext(args.replot)[0] + ".png")
        return 0
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-fleet-")
    runs = {}
    for n in [int(x) for x in args.replicas.split(",")]:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        if n > len(os.sched_getaffinity(0)):
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        runs.update(run_fleet(n, env, args, os.path.join(work, f"n{n}")))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    single = ServeProcess(["--qwen-data-dir", os.path.join(work, "single"), *args.serve_arg],
                          os.path.join(work, "single.log"), env=env, cwd=ROOT, label="the single replica")
    try:
        single.wait_healthy()
        runs["1 replica, direct"] = storm(single.base_url, args, os.path.join(work, "single-run"))
        print("single", json.dumps(runs["1 replica, direct"]), flush=True)
    finally:
        single.stop()
    sizes = [int(x) for x in args.replicas.split(",")]
    result = {
        "workload": {k: getattr(args, k) for k in ("sessions", "turns", "rate", "input_len", "output_len", "seed",
                                                   "serve_arg")},
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "runs": runs,
        "prefill_reduction_vs_round_robin": {
            f"{n} replicas, {policy}": 1 - runs[f"{n} replicas, {policy}"]["computed_prefill_tokens"]
            / runs[f"{n} replicas, round_robin"]["computed_prefill_tokens"]
            for n in sizes for policy in ("consistent_hash", "cache_aware")},
        "output_throughput_vs_1_replica_direct": {
            name: run["output_tokens_per_s"] / runs["1 replica, direct"]["output_tokens_per_s"]
            for name, run in runs.items()},
    }
    with open(os.path.join(args.out, "bench_fleet.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "bench_fleet.png"))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
