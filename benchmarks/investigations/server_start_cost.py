"""Issue 52: what one test server costs the suite, in the process layouts the e2e tests use: its start-up, its idle,
and its decoding while the rest of the suite keeps both cores busy.

    .venv/bin/python benchmarks/investigations/server_start_cost.py [--rounds 2] [--layouts a,b] [--busy 2]
        [--requests 4] [--max-tokens 200] [launcher flags...]

For each layout, ``--rounds`` times in a rotated order: start ``python -m qwen_vllm_ext.serve`` (1 GiB of KV cache,
as the tests run it), wait for ``/health``, and read the wall time and the CPU time of the whole process tree
(sampled every 0.2 s while it starts, so processes that exit are counted too); then the tree's CPU over 20 s of
idle; then, with ``--busy`` busy loops beside it (the rest of the suite), ``--requests`` chat requests of
``--max-tokens`` generated tokens, two at a time: their wall time and the tree's CPU time. Layouts:
- ``shipped``: vLLM's default on the CPU build (API server, engine core, and the model worker in a process of its
  own, which vLLM binds to one core with one OpenMP thread on this two-core machine), ``OMP_NUM_THREADS`` unset;
- ``in-engine``: the worker inside the engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's "uni" executor)
  with one OpenMP thread (``OMP_NUM_THREADS=1``): what tests/e2e/servers.py gives the servers whose tests do not
  cover worker-side code;
- ``in-engine-torch-threads``: the same without ``OMP_NUM_THREADS``: torch keeps a thread per core (vLLM's CPU
  worker blocks the engine core's reduction to one thread, "CPU backend doesn't allow to use
  `torch.set_num_threads`" in its log), as the test servers ran in session 33.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from qwen_vllm_ext.bench.server import ServeProcess

LAYOUTS = {"shipped": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
           "in-engine": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"},
           "in-engine-torch-threads": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def _tree_cpu(pid: int, seen: dict[int, float]) -> float:
    """Record the CPU time of ``pid`` and every process below it in ``seen``; the total of all ever seen."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return sum(seen.values())
    for proc in procs:
        try:
            cpu = proc.cpu_times()
            seen[proc.pid] = cpu.user + cpu.system
        except psutil.Error:
            pass
    return sum(seen.values())


def _decode(server: ServeProcess, seen: dict[int, float], busy: int, requests: int, max_tokens: int) -> dict:
    """``requests`` chats of ``max_tokens`` generated tokens, two at a time, with ``busy`` busy loops running."""
    model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]

    def chat(k: int) -> int:
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": f"Tell me story number {k}."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    try:
        time.sleep(1)
        before, t0 = _tree_cpu(server.proc.pid, seen), time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            tokens = sum(pool.map(chat, range(requests)))
        wall = time.monotonic() - t0
        cpu = _tree_cpu(server.proc.pid, seen) - before
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    return {"decode_wall_s": wall, "decode_cpu_s": cpu, "tokens": tokens}


def one(layout: str, flags: list[str], args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", **LAYOUTS[layout])
    work = tempfile.mkdtemp(prefix="start-cost-")
    server = ServeProcess(["--qwen-data-dir", os.path.join(work, "data"), *flags], os.path.join(work, "server.log"),
                          env=env)
    seen: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            _tree_cpu(server.proc.pid, seen)
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        wall = server.wait_healthy(600)
        done.set()
        sampler.join()
        start_cpu = _tree_cpu(server.proc.pid, seen)
        processes = len(seen)
        time.sleep(3)
        before = _tree_cpu(server.proc.pid, seen)
        time.sleep(20)
        idle = _tree_cpu(server.proc.pid, seen) - before
        decode = _decode(server, seen, args.busy, args.requests, args.max_tokens) if args.requests else {}
    finally:
        done.set()
        server.stop()
    return {"wall_s": wall, "cpu_s": start_cpu, "processes": processes, "idle_cpu_s_per_20s": idle, **decode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the server while it decodes")
    ap.add_argument("--requests", type=int, default=4, help="chat requests to decode (0: start-up and idle only)")
    ap.add_argument("--max-tokens", type=int, default=200)
    args, flags = ap.parse_known_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        ap.error(f"unknown layout(s) {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    for k in range(args.rounds):
        for layout in layouts[k % len(layouts):] + layouts[:k % len(layouts)]:
            runs[layout].append(one(layout, flags, args))
            r = runs[layout][-1]
            line = (f"round {k + 1} {layout:23s}: healthy after {r['wall_s']:5.1f} s, {r['cpu_s']:5.1f} CPU-s in "
                    f"{r['processes']} processes; idle {r['idle_cpu_s_per_20s']:.2f} CPU-s per 20 s")
            if "tokens" in r:
                line += (f"; {r['tokens']} tokens beside {args.busy} busy loops in {r['decode_wall_s']:.1f} s, "
                         f"{r['decode_cpu_s']:.1f} CPU-s")
            print(line, flush=True)
    for layout, rs in runs.items():
        line = (f"{layout:23s} median: {statistics.median(r['wall_s'] for r in rs):5.1f} s wall, "
                f"{statistics.median(r['cpu_s'] for r in rs):5.1f} CPU-s to start")
        if all("tokens" in r for r in rs):
            line += (f"; decoding {statistics.median(r['decode_wall_s'] for r in rs):.1f} s, "
                     f"{statistics.median(r['decode_cpu_s'] for r in rs):.1f} CPU-s")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
