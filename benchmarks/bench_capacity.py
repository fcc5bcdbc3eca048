"""Capacity 429s under overload: p99 TTFT of the admitted requests and the share refused, max_queue_wait_s on vs off.

    .venv/bin/python -m benchmarks.bench_capacity --out docs/results/capacity/demo.json

Two demo servers (gateway on, spike breaker off) run side by side, each pinned to its own core (its OpenMP thread
bound there too): side ``off`` (max_queue_wait_s=0, stock queueing) and side ``on`` (max_queue_wait_s=W). One
TokenStorm run per side at the same time, same seed, open loop at ``--load`` x the capacity measured first (a closed
loop on side off), so both sides see the same arrivals; the cores swap every repeat. ``--aa`` runs the protocol with
both sides off: how large a difference this machine's noise makes.

Each TokenStorm run checks its accounting against the server's ledger (zero mismatches expected on both sides).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen_vllm_ext.bench.server import ServeProcess
from qwen_vllm_ext.demo import SERVED_NAME


def start(label: str, wait_s: float, core: int, tmp: Path) -> dict:
    data = tmp / label
    data.mkdir()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "QWEN_VLLM_EXT_DATA_DIR": str(data)}
    proc = ServeProcess(["--qwen-data-dir", str(data), "--qwen-gateway", "true", "--qwen-spike-factor", "0",
                         "--qwen-max-queue-wait-s", str(wait_s)], tmp / f"{label}.log", env=env, label=label)
    os.sched_setaffinity(proc.proc.pid, {core})  # before the engine core is spawned: every process inherits it
    return {"label": label, "wait_s": wait_s, "core": core, "server": proc, "data": data}


def make_key(side: dict) -> str:
    out = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", "create", "--json", "--name", side["label"]],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QWEN_VLLM_EXT_DATA_DIR": str(side["data"])})
    out.check_returncode()
    return json.loads(out.stdout)["secret"]


def storm(side: dict, out: Path, *args: str) -> dict:
    """One TokenStorm run against a side (its client pinned to the side's core too); the report."""
    cmd = ["taskset", "-c", str(side["core"]), sys.executable, "-m", "qwen_vllm_ext.bench.token_storm",
           "--base-url", side["server"].base_url, "--model", SERVED_NAME, "--api-key", side["key"],
           "--ledger", str(side["data"] / "ledger.sqlite3"), "--output-dir", str(out), "--no-progress", "--no-plot",
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"TokenStorm failed on {side['label']}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((out / "token_storm.json").read_text())


def side_result(rep: dict) -> dict:
    tp, errors = rep["throughput"], rep["errors"]
    refused = sum(n for k, n in errors.items() if k.startswith("429 capacity_exceeded"))
    other = sum(n for k, n in errors.items() if not k.startswith("429 capacity_exceeded"))
    return {"requests": tp["requests"], "completed": tp["completed"], "refused": refused, "other_errors": other,
            "share_refused": refused / tp["requests"] if tp["requests"] else None,
            "ttft_p50_s": rep["latency"]["ttft_s"]["p50"], "ttft_p99_s": rep["latency"]["ttft_s"]["p99"],
            "output_tokens_per_s": tp["output_token_throughput"],
            "mismatches": len(rep["accounting"]["mismatches"]), "errors": errors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-queue-wait-s", type=float, default=2.0, help="side on's bound")
    p.add_argument("--aa", action="store_true", help="both sides off (the noise)")
    p.add_argument("--load", type=float, default=1.5, help="arrival rate / measured capacity")
    p.add_argument("--input-len", type=int, default=1200)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--capacity", type=float, default=None, help="req/s; measured (closed loop, side off) when absent")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    workload = ["--distribution", "normal", "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    wait_on = 0.0 if args.aa else args.max_queue_wait_s
    sides = [start("off", 0.0, 0, tmp), start("on" if not args.aa else "off2", wait_on, 1, tmp)]
    started = time.time()
    try:
        for s in sides:
            s["server"].wait_healthy(900)
            s["key"] = make_key(s)
        capacity = args.capacity
        if capacity is None:  # closed loop on side off: completed requests per second at saturation
            rep = storm(sides[0], tmp / "capacity", *workload, "--concurrency", "12", "--num-requests", "120",
                        "--duration", "30", "--seed", "99")
            capacity = rep["throughput"]["request_throughput"]
        rate = args.load * capacity
        runs = []
        for k in range(args.repeats):
            if k % 2:  # swap the cores: each side runs on both
                for s, core in zip(sides, (1, 0)):
                    s["core"] = core
            else:
                for s, core in zip(sides, (0, 1)):
                    s["core"] = core
            for s in sides:
                for pid in _tree(s["server"].proc.pid):
                    try:
                        os.sched_setaffinity(pid, {s["core"]})
                    except OSError:
                        pass
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                futures = [pool.submit(storm, s, tmp / f"run{k}-{s['label']}", *workload, "--rate", f"{rate:.3f}",
                                       "--num-requests", str(args.requests), "--duration", str(args.duration),
                                       "--seed", str(k)) for s in sides]
                reports = [f.result() for f in futures]
            runs.append({"repeat": k, "cores": {s["label"]: s["core"] for s in sides},
                         **{s["label"]: side_result(r) for s, r in zip(sides, reports)}})
            print(json.dumps(runs[-1], indent=1), flush=True)
    finally:
        for s in sides:
            s["server"].stop()
    a, b = sides[0]["label"], sides[1]["label"]
    ratios = [r[b]["ttft_p99_s"] / r[a]["ttft_p99_s"] for r in runs if r[a]["ttft_p99_s"] and r[b]["ttft_p99_s"]]
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "aa": args.aa, "capacity_req_s": capacity,
              "load": args.load, "rate_req_s": rate, "max_queue_wait_s": wait_on, "input_len": args.input_len,
              "output_len": args.output_len, "requests": args.requests, "duration_s": args.duration, "runs": runs,
              "ttft_p99_ratio_per_repeat": ratios, "wall_s": time.time() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    shares = ", ".join(f"{r[b]['share_refused']:.2f}" for r in runs)
    print(f"p99 TTFT {b}/{a} per repeat: {', '.join(f'{x:.2f}' for x in ratios)}; share refused {b}: {shares}; "
          f"wrote {args.out}")
    return 0


def _tree(pid: int) -> list[int]:
    """Every thread of pid and of its descendants (Linux /proc): affinity is per thread."""
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = [int(t) for t in os.listdir(f"/proc/{parent}/task")]
        except OSError:
            continue
        out += tasks
        for t in tasks:
            try:
                frontier += [int(c) for c in Path(f"/proc/{parent}/task/{t}/children").read_text().split()]
            except OSError:
                pass
    return out


if __name__ == "__main__":
    raise SystemExit(main())
