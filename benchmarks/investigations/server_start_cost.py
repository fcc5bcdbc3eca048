"""Issue 52: what one server start-up costs the test suite, in the two process layouts the e2e tests use.

    .venv/bin/python benchmarks/investigations/server_start_cost.py [--rounds 2] [launcher flags...]

For each layout, ``--rounds`` times in alternating order: start ``python -m qwen_vllm_ext.serve`` (1 GiB of KV
cache, as the tests run it), wait for ``/health``, and read the wall time and the CPU time of the whole process tree
(sampled every 0.2 s while it starts, so processes that exit are counted too); then the tree's CPU over 20 s of idle.
Layouts: ``shipped`` (vLLM's default on the CPU build: API server, engine core, and the model worker in a process of
its own) and ``in-engine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker runs inside the engine core, vLLM's
"uni" executor; what tests/e2e/servers.py gives the servers whose tests do not cover worker-side code).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import psutil

from qwen_vllm_ext.bench.server import ServeProcess

LAYOUTS = {"shipped": "1", "in-engine": "0"}


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


def one(layout: str, flags: list[str]) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING=LAYOUTS[layout])
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
    finally:
        done.set()
        server.stop()
    return {"wall_s": wall, "cpu_s": start_cpu, "processes": processes, "idle_cpu_s_per_20s": idle}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args, flags = ap.parse_known_args(argv)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for k in range(args.rounds):
        for layout in (list(LAYOUTS) if k % 2 == 0 else list(reversed(LAYOUTS))):
            runs[layout].append(one(layout, flags))
            r = runs[layout][-1]
            print(f"round {k + 1} {layout:9s}: healthy after {r['wall_s']:5.1f} s, {r['cpu_s']:5.1f} CPU-s in "
                  f"{r['processes']} processes; idle {r['idle_cpu_s_per_20s']:.2f} CPU-s per 20 s", flush=True)
    for layout, rs in runs.items():
        print(f"{layout:9s} median: {statistics.median(r['wall_s'] for r in rs):5.1f} s wall, "
              f"{statistics.median(r['cpu_s'] for r in rs):5.1f} CPU-s to start")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
