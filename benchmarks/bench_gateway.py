#!/usr/bin/env python
"""Cost of the in-server gateway: the same load against two demo servers, gateway ON and OFF, interleaved.

Both servers run at the same time (``python -m qwen_vllm_ext.serve`` on the CPU demo model ``qwen3-demo``,
each with its own fresh data dir and free loopback port). After ``GET /health``, a mode check (the gateway
really is on or off: ``/qwen_ext/health`` settings; an unauthenticated request gets 401 when on, no
``x-qwen-gateway-overhead-ms`` header when off) and a warm-up of each, the measured load is sent in many short
*slices*, one server at a time, in ABBA order (ON,OFF, OFF,ON, ON,OFF, ...): each *pair* of adjacent slices
sees the same machine conditions, so the machine's speed drift (other jobs on this 2-core machine) cancels in
the per-pair ratio, and a linear drift cancels in the pooled ratio too.

Load per slice: closed loop, ``--concurrency`` workers (default 8) each sending the next request as soon as its
previous one finished, ``--slice-requests`` chat completions (default 160; ``--quick`` 64), short mixed zh/en
prompts (the same seeded sequence for both servers), ``max_tokens`` 16 with ``ignore_eos: true`` (every request
decodes exactly 16 tokens; checked from ``usage``). With the gateway on, requests carry ``Authorization: Bearer``
of a key created beforehand (``python -m qwen_vllm_ext.keys create``) with limits high enough that nothing is
rate limited; with it off, a dummy bearer token of the same length, so both put the same bytes on the wire.

Headline: throughput ratio = ON req/s over all ON slices (requests / summed wall time) / OFF req/s over all OFF
slices, PASS when >= ``--target`` (0.97) and no request failed. Also printed: the per-pair ratios (ON slice
req/s / OFF slice req/s of the same pair) with their median, IQR and range -- the spread says how far a single
figure can be trusted on this machine; the gateway's own admission time per request from the
``x-qwen-gateway-overhead-ms`` header (auth, body checks, exact prompt count, atomic reservation) p50/p99;
per slice the CPU time (user + system, /proc) per request of each server's processes split by role (API server,
engine core, worker) and the engine steps per request (``vllm:iteration_tokens_total`` count from ``/metrics``:
more steps per request = smaller batches); the CPU the *idle* server burns while the other one is loaded (if it
busy-polled, running both at once would be unfair: the figure says); and the gateway's CPU per request measured
in-process (real key store, SQLite limiter, spike breaker, calculator; no engine). The spike breaker is given a
floor no benchmark reaches (``--qwen-spike-min-units 1e15``): it still runs on every request, but the key's burst
does not get it suspended. Exit code 0 on PASS, 1 on a ratio below the target or any failed request, 2 when a
server could not be started or checked, 130 when interrupted.

    .venv/bin/python benchmarks/bench_gateway.py            # 8 pairs x 2 slices x 160 requests, ~4 min on 2 cores
    .venv/bin/python benchmarks/bench_gateway.py --quick    # 4 pairs x 2 slices x 64 requests
    .venv/bin/python benchmarks/bench_gateway.py --pairs 12 --slice-requests 100 --concurrency 16

Writes ``benchmarks/results/bench_gateway.json`` (``bench_gateway_quick.json`` with ``--quick``), a PNG (latency
CDFs on/off, gateway overhead CDF, req/s of every slice and the per-pair ratios over time) when matplotlib is
importable, and both servers' logs under ``benchmarks/results/bench_gateway_logs/``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import httpx

from qwen_vllm_ext.bench.server import ServeProcess, ServerStartError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MODEL = "qwen3-demo"
OVERHEAD_HEADER = "x-qwen-gateway-overhead-ms"
SEED = 20250611
STEPS_METRIC = re.compile(r"^vllm:iteration_tokens_total_count\{[^}]*\}\s+([0-9.eE+]+)", re.M)

ZH = [
    "用一句话介绍一下长城。", "今天天气怎么样？", "请把这句话翻译成英文：我喜欢喝茶。", "写一首关于秋天的短诗。",
    "解释一下什么是机器学习。", "推荐三本适合初学者的编程书。", "北京和上海哪个城市更大？", "如何煮一碗好吃的面条？",
    "给我讲个简短的笑话。", "什么是量子计算？请简单说明。", "列出五种常见的水果。", "为什么天空是蓝色的？",
]
EN = [
    "Say hello in three languages.", "What is the capital of France?", "Summarize the plot of Hamlet in one line.",
    "Give me a haiku about rain.", "Explain recursion to a child.", "List three uses of a paperclip.",
    "How do vaccines work, briefly?", "Write a tweet about coffee.", "What does HTTP 429 mean?",
    "Name two prime numbers above 100.", "Why do cats purr?", "Suggest a name for a pet turtle.",
]
MIXED = [
    "请用 English 回答：what is 2+2？", "Translate to Chinese: good morning, 朋友。", "解释 GPU 和 CPU 的区别, briefly.",
    "Write one sentence mixing 中文 and English.", "什么是 API rate limit？Explain in one line.",
    "Compare Python 和 Rust in one sentence.",
]


# ------------------------------------------------------------------------------------------------ helpers
def percentile(values, q):
    if not values:
        return None
    import numpy as np
    return float(np.percentile(np.asarray(values, dtype=float), q))


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def prompts(n: int, seed: int) -> list[str]:
    """A seeded sequence of short mixed zh/en prompts (a number keeps them distinct)."""
    rng = random.Random(seed)
    pool = ZH + EN + MIXED
    return [f"{rng.choice(pool)} (#{i})" for i in range(n)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchError(RuntimeError):
    pass



# ------------------------------------------------------------------------------------------------ server
def role_of(comm: str) -> str:
    """The role of one of a server's processes, from its name (vLLM titles its children)."""
    if "EngineCor" in comm:
        return "engine"
    if "Worker" in comm:
        return "worker"
    return "api"  # the API server (and its helper processes, which stay near 0)


class Server(ServeProcess):
    """One demo server (the shared launcher: own process group, stopped with killpg) plus what this benchmark
    reads from it: CPU time by process role and engine steps."""

    def __init__(self, gateway: bool, data_dir: str, log_path: str, extra: list[str]):
        self.gateway = gateway
        super().__init__(["--qwen-data-dir", data_dir, "--qwen-gateway", "true" if gateway else "false",
                          # the spike breaker still observes every request (its cost is measured) but never
                          # trips: a benchmark's burst on a fresh key is what it would suspend (403)
                          "--qwen-spike-min-units", "1e15", *extra],
                         log_path, cwd=ROOT, label=f"the gateway-{'on' if gateway else 'off'} server")
        self.name = "on" if gateway else "off"

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds of the live processes of this server's process group, by role (/proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {"api": 0.0, "engine": 0.0, "worker": 0.0}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.find("(") + 1:stat.rfind(")")]
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == self.proc.pid:  # field 5 (pgrp) is index 2 after the comm field
                out[role_of(comm)] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return out

    def engine_steps(self) -> float | None:
        """Engine iterations so far (the count of vLLM's ``vllm:iteration_tokens_total`` histogram)."""
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as r:
                text = r.read().decode()
        except (OSError, urllib.error.URLError):
            return None
        found = STEPS_METRIC.findall(text)
        return sum(float(x) for x in found) if found else None

    def wait_healthy(self, timeout: float) -> float:
        try:
            return super().wait_healthy(timeout, poll_s=0.5)
        except ServerStartError as exc:
            raise BenchError(str(exc)) from None


def create_key(data_dir: str) -> str:
    env = dict(os.environ, QWEN_VLLM_EXT_DATA_DIR=data_dir)
    out = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", "create", "--name", "bench", "--json",
                          "--rpm", "1000000", "--tpm", "1000000000"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise BenchError(f"keys create failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout)["secret"]


# ------------------------------------------------------------------------------------------------ load
async def run_load(base_url: str, token: str, texts: list[str], concurrency: int, max_tokens: int,
                   timeout: float) -> dict:
    """Closed loop: `concurrency` workers, each sends the next prompt as soon as its previous request is done."""
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue = list(enumerate(texts))
    queue.reverse()
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient):
        while queue:
            i, text = queue.pop()
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.0}
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/chat/completions", json=body, headers=headers)
                t1 = time.perf_counter()
                rec = {"i": i, "status": r.status_code, "latency_s": t1 - t0, "end": t1}
                ovh = r.headers.get(OVERHEAD_HEADER)
                rec["overhead_ms"] = float(ovh) if ovh is not None else None
                if r.status_code == 200:
                    usage = r.json().get("usage") or {}
                    rec["completion_tokens"] = usage.get("completion_tokens", 0)
                    rec["prompt_tokens"] = usage.get("prompt_tokens", 0)
                else:
                    rec["error"] = r.text[:300]
            except httpx.HTTPError as exc:
                t1 = time.perf_counter()
                rec = {"i": i, "status": None, "latency_s": t1 - t0, "end": t1, "overhead_ms": None,
                       "error": f"{type(exc).__name__}: {exc}"}
            results.append(rec)

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    results.sort(key=lambda r: r["i"])
    return {"wall_s": wall, "results": results}


def check_mode(server: Server, token: str) -> None:
    """The server really runs with the gateway on/off as asked."""
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        health = c.get("/qwen_ext/health").json()
        settings = health.get("settings", {})
        if "gateway" in settings and bool(settings["gateway"]) != server.gateway:
            raise BenchError(f"/qwen_ext/health says gateway={settings['gateway']}, expected {server.gateway}")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = c.post("/v1/chat/completions", json=body)  # no Authorization
        if server.gateway and r.status_code != 401:
            raise BenchError(f"gateway on, but an unauthenticated request got {r.status_code}: {r.text[:200]}")
        if not server.gateway and (r.status_code != 200 or OVERHEAD_HEADER in r.headers):
            raise BenchError(f"gateway off, but a plain request got {r.status_code} "
                             f"(overhead header: {OVERHEAD_HEADER in r.headers})")
        if server.gateway:
            r = c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})
            if r.status_code != 200 or OVERHEAD_HEADER not in r.headers:
                raise BenchError(f"gateway on, authenticated request got {r.status_code} "
                                 f"(overhead header: {OVERHEAD_HEADER in r.headers}): {r.text[:200]}")


# ------------------------------------------------------------------------------------------------ slices
def slice_plan(pairs: int) -> list[tuple[int, str]]:
    """(pair index, 'on'|'off') in ABBA order: ON,OFF, OFF,ON, ON,OFF, ..."""
    plan = []
    for p in range(pairs):
        plan += [(p, m) for m in (("on", "off") if p % 2 == 0 else ("off", "on"))]
    return plan


def quiesce(server: Server, max_s: float, step_s: float = 0.25, idle_cores: float = 0.05) -> float:
    """Wait (at most ``max_s``) until ``server`` uses under ``idle_cores`` over ``step_s``; returns seconds waited.
    After a load the server still finishes work (engine steps of the last requests, reconciliation, ledger
    writes): it is counted in that load's CPU, and it must not be counted as the idle server's CPU later."""
    t0 = time.monotonic()
    last = sum(server.cpu_seconds().values())
    while time.monotonic() - t0 < max_s:
        time.sleep(step_s)
        now = sum(server.cpu_seconds().values())
        if now - last < idle_cores * step_s:
            break
        last = now
    return time.monotonic() - t0


def run_slice(server: Server, other: Server, token: str, texts: list[str], args) -> dict:
    """One slice of closed-loop load against ``server`` while ``other`` idles; CPU of both from /proc."""
    steps0 = server.engine_steps()
    cpu0, other0, t0 = server.cpu_seconds(), other.cpu_seconds(), time.monotonic()
    load = asyncio.run(run_load(server.base_url, token, texts, args.concurrency, args.max_tokens,
                                args.request_timeout))
    tail = quiesce(server, args.settle)  # the server's work right after the last response counts too
    cpu1, other1, span = server.cpu_seconds(), other.cpu_seconds(), time.monotonic() - t0
    steps1 = server.engine_steps()
    res = load["results"]
    ok = [r for r in res if r["status"] == 200]
    bad = [r for r in res if r["status"] != 200]
    lat_ms = [r["latency_s"] * 1000 for r in ok]
    ovh = [r["overhead_ms"] for r in ok if r["overhead_ms"] is not None]
    wall = load["wall_s"]
    cpu = {role: cpu1[role] - cpu0[role] for role in cpu0}
    return {
        "server": server.name, "gateway": server.gateway, "requests": len(res), "ok": len(ok), "errors": len(bad),
        "not_full_length": sum(1 for r in ok if r.get("completion_tokens") != args.max_tokens),
        "wall_s": wall, "req_per_s": len(ok) / wall if wall > 0 else 0.0,
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in ok),
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in ok),
        "latency_ms": {"p50": percentile(lat_ms, 50), "p99": percentile(lat_ms, 99)},
        "overhead_ms": {"p50": percentile(ovh, 50), "p99": percentile(ovh, 99)} if ovh else None,
        "server_cpu_s": cpu, "cpu_window_s": span,
        "server_cpu_ms_per_request": {role: v * 1000 / len(ok) for role, v in cpu.items()} if ok else None,
        "tail_s": tail,
        "engine_steps": (steps1 - steps0) if steps0 is not None and steps1 is not None else None,
        "other_server_cpu_cores": sum(other1[r] - other0[r] for r in other0) / span,
        "error_samples": [r.get("error") for r in bad[:5]],
        "raw_latency_ms": lat_ms, "raw_overhead_ms": ovh,
    }


def pooled(slices: list[dict], gateway: bool) -> dict:
    sel = [s for s in slices if s["gateway"] == gateway]
    ok = sum(s["ok"] for s in sel)
    wall = sum(s["wall_s"] for s in sel)
    lat = [x for s in sel for x in s["raw_latency_ms"]]
    ovh = [x for s in sel for x in s["raw_overhead_ms"]]
    cpu = {role: sum(s["server_cpu_s"][role] for s in sel) for role in ("api", "engine", "worker")}
    steps = [s["engine_steps"] for s in sel]
    return {
        "slices": len(sel), "requests": sum(s["requests"] for s in sel), "ok": ok,
        "errors": sum(s["errors"] for s in sel), "wall_s": wall,
        "req_per_s": ok / wall if wall else 0.0,
        "completion_tokens_per_s": sum(s["completion_tokens"] for s in sel) / wall if wall else 0.0,
        "latency_ms": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)},
        "overhead_ms": ({"p50": percentile(ovh, 50), "p99": percentile(ovh, 99), "n": len(ovh)} if ovh else None),
        "server_cpu_ms_per_request": {**{r: v * 1000 / ok for r, v in cpu.items()},
                                      "total": sum(cpu.values()) * 1000 / ok} if ok else None,
        "engine_steps_per_request": (sum(steps) / ok) if ok and None not in steps else None,
        "idle_cpu_cores_while_other_loaded": None,  # filled in by main (measured on the other server's slices)
        "raw_latency_ms": lat, "raw_overhead_ms": ovh,
    }


def pair_ratios(slices: list[dict]) -> list[float]:
    by_pair: dict[int, dict[str, float]] = {}
    for s in slices:
        by_pair.setdefault(s["pair"], {})[s["server"]] = s["req_per_s"]
    return [p["on"] / p["off"] for _i, p in sorted(by_pair.items()) if p.get("off") and "on" in p]


# ------------------------------------------------------------------------------------------------ report
def table(slices: list[dict], on: dict, off: dict) -> str:
    head = (f"{'slice':<10}{'req':>5}{'err':>4}{'req/s':>7}{'lat p50':>8}{'lat p99':>8}{'ovh p50':>8}{'ovh p99':>8}"
            f"{'cpu ms/req api+engine+worker':>31}{'steps/req':>10}{'idle other':>11}")
    lines = [head, "-" * len(head)]

    def row(name, s, steps, idle):
        o = s.get("overhead_ms") or {}
        c = s["server_cpu_ms_per_request"] or {}
        split = f"{sum(c.get(r, 0) for r in ('api', 'engine', 'worker')):.1f} = {c.get('api', 0):.1f}+" \
                f"{c.get('engine', 0):.1f}+{c.get('worker', 0):.1f}"
        return (f"{name:<10}{s['requests']:>5}{s['errors']:>4}{s['req_per_s']:>7.2f}"
                f"{fmt(s['latency_ms']['p50'], '.0f'):>8}{fmt(s['latency_ms']['p99'], '.0f'):>8}"
                f"{fmt(o.get('p50'), '.2f'):>8}{fmt(o.get('p99'), '.2f'):>8}{split:>31}"
                f"{fmt(steps, '.2f'):>10}{fmt(idle, '.3f'):>11}")

    for s in slices:
        steps = s["engine_steps"] / s["ok"] if s["engine_steps"] is not None and s["ok"] else None
        lines.append(row(f"{s['pair'] + 1}:{s['server']}", s, steps, s["other_server_cpu_cores"]))
    lines.append("-" * len(head))
    for name, p in (("ON", on), ("OFF", off)):
        lines.append(row(name, p, p["engine_steps_per_request"], p["idle_cpu_cores_while_other_loaded"]))
    return "\n".join(lines)


def plot(path: str, slices: list[dict], on: dict, off: dict, ratios: list[float], title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    ax = axes[0]
    for label, data, color in (("gateway off", off["raw_latency_ms"], "tab:blue"),
                               ("gateway on", on["raw_latency_ms"], "tab:orange")):
        xs = np.sort(np.asarray(data))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)}, p50 {np.percentile(xs, 50):.0f} ms)", color=color)
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDF, gateway on vs off")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax = axes[1]
    if on["raw_overhead_ms"]:
        xs = np.sort(np.asarray(on["raw_overhead_ms"]))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", color="tab:orange",
                label=f"p50 {np.percentile(xs, 50):.3f} ms, p99 {np.percentile(xs, 99):.3f} ms")
        ax.set_xscale("log")
        ax.legend(loc="lower right")
    ax.set_xlabel(f"gateway admission time ({OVERHEAD_HEADER}, ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Gateway overhead per request CDF")
    ax.grid(alpha=0.3)
    ax = axes[2]
    for name, color in (("on", "tab:orange"), ("off", "tab:blue")):
        idx = [i for i, s in enumerate(slices) if s["server"] == name]
        ax.plot(idx, [slices[i]["req_per_s"] for i in idx], "o", color=color, label=f"gateway {name} slice req/s")
    ax.set_xlabel("slice (time order, ABBA)")
    ax.set_ylabel("req/s")
    ax2 = ax.twinx()
    ax2.plot([2 * i + 0.5 for i in range(len(ratios))], ratios, "k_-", ms=14, label="pair ratio ON/OFF")
    ax2.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax2.set_ylabel("pair ratio ON/OFF")
    ax.set_title("Slices and per-pair ratios")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------------ main
def gateway_cpu_ms_per_request(n: int = 500, history: int = 0) -> float:
    """CPU milliseconds (all threads) the gateway middleware spends per admitted request, in-process, with the
    real key store, SQLite limiter, spike breaker and calculator in front of a no-op app: the gateway's cost
    without the engine's noise. ``history``: that many earlier requests of the key are first put in its 15-minute
    spike window (and, up to one minute's worth at the same rate, in its RPM/TPM windows), as on a busy server
    (30 req/s for 15 minutes = 27,000): the per-request cost must not grow with the windows' contents."""
    import asyncio
    import tempfile
    import types

    from qwen_v3_calculator import Calculator
    from qwen_v3_calculator.billing import get_policy
    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.common.context import request_context
    from qwen_vllm_ext.gateway.admission import Served
    from qwen_vllm_ext.keys import KeyCache, SqliteKeyStore
    from qwen_vllm_ext.gateway.limiter import SqliteLimiter
    from qwen_vllm_ext.gateway.middleware import GatewayMiddleware, GatewayState
    from qwen_vllm_ext.gateway.spike import SpikeBreaker
    from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

    d = tempfile.mkdtemp(prefix="bench-gw-cpu-")
    settings = Settings(data_dir=d, gateway=True, spike_min_units=1e15)
    keys = SqliteKeyStore(os.path.join(d, "ledger.sqlite3"), "s" * 32)
    secret, _ = keys.create("bench", rpm=10**9, tpm=10**12)
    limiter = SqliteLimiter(os.path.join(d, "limiter.sqlite3"))
    breaker = SpikeBreaker(settings, limiter, keys, SqliteLedgerStore(os.path.join(d, "ledger.sqlite3")))
    if history:
        from qwen_vllm_ext.gateway.spike import UNBOUNDED, WINDOW_S
        key = keys.authenticate(secret)
        for i in range(history):
            limiter.reserve([(f"spike:{key.key_id}", UNBOUNDED, WINDOW_S, 33_600_000)])
            if i < history * 60 // int(WINDOW_S):
                limiter.reserve([(f"key:{key.key_id}:rpm", 10**9, 60.0, 1), (f"key:{key.key_id}:tpm", 10**12, 60.0, 40)])
    record = types.SimpleNamespace(engine_prompt_tokens=12, completion_tokens=16, billed_total_micro=33_600_000,
                                   usage_tokens=12 + 16)  # what the ledger hands the gateway after a response

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        for callback in request_context(scope).on_usage:  # what the ledger does after a response
            callback(record)

    gateway = GatewayMiddleware(app, settings=settings, keys=KeyCache(keys), limiter=limiter,
                                policy=get_policy("default"), on_spike=breaker.observe_sync,
                                inline_limiter=limiter.nonblocking(),
                                state=GatewayState(admission=Served(Calculator(), 4096, names=("m",))))
    state = types.SimpleNamespace()
    texts = prompts(64, SEED)

    async def one(i):
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": texts[i % len(texts)]}],
                           "max_tokens": 16}).encode()
        scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "state": {},
                 "app": types.SimpleNamespace(state=state), "headers": [(b"authorization", f"Bearer {secret}".encode())]}
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop() if messages else await asyncio.sleep(3600)

        async def send(message):
            pass

        await gateway(scope, receive, send)

    async def run(count):
        for i in range(count):
            await one(i)
        await asyncio.sleep(0.2)  # let the executor finish the reconciliation calls

    asyncio.run(run(50))  # warm-up
    started = time.process_time()
    asyncio.run(run(n))
    return (time.process_time() - started) * 1000 / n


def cpu_only(args) -> int:
    """The in-process figures alone, each measured --cpu-repeats times (alternating), median and range."""
    import qwen_v3_calculator

    plain, busy = [], []
    for _ in range(max(1, args.cpu_repeats)):
        plain.append(gateway_cpu_ms_per_request())
        if args.history:
            busy.append(gateway_cpu_ms_per_request(history=args.history))
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    report = {"gateway_cpu_ms_per_request": med(plain), "runs": plain,
              "gateway_cpu_ms_per_request_with_history": med(busy), "runs_with_history": busy,
              "history_requests": args.history, "requests_per_run": 500,
              "calculator": {"version": qwen_v3_calculator.__version__, "module": qwen_v3_calculator.__file__},
              "commit": git_commit(), "loadavg": " ".join(open("/proc/loadavg").read().split()[:3])}
    print(f"gateway CPU per request, in-process with real keys/limiter/SQLite and no engine: median "
          f"{report['gateway_cpu_ms_per_request']:.3f} ms of {len(plain)} runs ({min(plain):.3f}-{max(plain):.3f})"
          + (f"; with {args.history} earlier requests of the key in its windows: median {med(busy):.3f} ms "
             f"({min(busy):.3f}-{max(busy):.3f})" if busy else ""))
    out = args.output or os.path.join(RESULTS, "bench_gateway_cpu.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {out}")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 pairs of 64-request slices, 24 warm-up requests")
    p.add_argument("--pairs", type=int, help="ON/OFF slice pairs, in ABBA order (default 8; --quick 4)")
    p.add_argument("--slice-requests", type=int, help="measured requests per slice (default 160; --quick 64)")
    p.add_argument("--warmup", type=int, help="warm-up requests per server (default 48; --quick 24)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop concurrency (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request, with ignore_eos (default 16)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="at most this many seconds after a slice's last response for the server to go idle; that "
                        "tail is counted in the slice's CPU, not in the wall time (default 5)")
    p.add_argument("--target", type=float, default=0.97, help="minimum throughput ratio ON/OFF (default 0.97)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for both servers (repeatable), e.g. --server-arg=--qwen-ledger=false")
    p.add_argument("--history", type=int, default=27000,
                   help="also measure the in-process gateway CPU after this many earlier requests of the key in its "
                        "15-minute spike window (default 27000 = 30 req/s for 15 min; 0: skip)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--cpu-only", action="store_true",
                   help="only the in-process CPU per request (no servers): --cpu-repeats measurements of each figure, "
                        "median reported; writes benchmarks/results/bench_gateway_cpu.json unless --output")
    p.add_argument("--cpu-repeats", type=int, default=5, help="measurements per figure with --cpu-only (default 5)")
    p.add_argument("--output", help="JSON path (default benchmarks/results/bench_gateway[_quick].json)")
    args = p.parse_args(argv)
    args.pairs = args.pairs or (4 if args.quick else 8)
    args.slice_requests = args.slice_requests or (64 if args.quick else 160)
    args.warmup = args.warmup if args.warmup is not None else (24 if args.quick else 48)
    if args.concurrency < 1 or args.slice_requests < 1 or args.pairs < 1:
        p.error("--concurrency, --slice-requests and --pairs must be positive")
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def measure(args, logs_dir: str) -> tuple[list[dict], dict]:
    """Start both servers at once, check and warm them, run the ABBA slices; always stop both servers."""
    info: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-on-") as on_dir, \
            tempfile.TemporaryDirectory(prefix="bench-gateway-off-") as off_dir:
        token_on = create_key(on_dir)
        token_off = "qve-" + "x" * (len(token_on) - 4)  # same length, ignored without the gateway
        servers: dict[str, Server] = {}
        try:
            for name, d in (("on", on_dir), ("off", off_dir)):
                servers[name] = Server(name == "on", d, os.path.join(logs_dir, f"server-{name}.log"), args.server_arg)
            log(f"started both servers (on: port {servers['on'].port}, off: port {servers['off'].port}); "
                f"waiting for /health")
            t0 = time.monotonic()
            for name in ("on", "off"):
                servers[name].wait_healthy(args.startup_timeout - (time.monotonic() - t0))
            info["startup_s"] = time.monotonic() - t0
            log(f"both healthy after {info['startup_s']:.0f}s")
            tokens = {"on": token_on, "off": token_off}
            for name in ("on", "off"):
                check_mode(servers[name], tokens[name])
            warm = prompts(args.warmup, args.seed - 1) if args.warmup else []
            for name in ("on", "off"):
                if warm:
                    w = asyncio.run(run_load(servers[name].base_url, tokens[name], warm, args.concurrency,
                                             args.max_tokens, args.request_timeout))
                    failed = [r for r in w["results"] if r["status"] != 200]
                    if failed:
                        raise BenchError(f"gateway-{name}: {len(failed)} warm-up requests failed: "
                                         f"{failed[0].get('error')}")
            # idle baseline: both servers idle, before any measured load
            for name in ("on", "off"):
                quiesce(servers[name], args.settle)
            c0 = {n: servers[n].cpu_seconds() for n in servers}
            time.sleep(2.0)
            info["idle_cpu_cores_both_idle"] = {n: sum(servers[n].cpu_seconds().values()) - sum(c0[n].values())
                                                for n in servers}
            info["idle_cpu_cores_both_idle"] = {n: v / 2.0 for n, v in info["idle_cpu_cores_both_idle"].items()}
            slices = []
            for i, (pair, name) in enumerate(slice_plan(args.pairs)):
                texts = prompts(args.slice_requests, args.seed + pair)  # both slices of a pair: the same prompts
                other = servers["off" if name == "on" else "on"]
                s = run_slice(servers[name], other, tokens[name], texts, args)
                s["pair"], s["index"] = pair, i
                slices.append(s)
                log(f"slice {i + 1}/{2 * args.pairs} pair {pair + 1} gateway {name}: {s['ok']}/{s['requests']} ok, "
                    f"{s['req_per_s']:.2f} req/s, p50 {fmt(s['latency_ms']['p50'], '.0f')} ms, other server "
                    f"{s['other_server_cpu_cores']:.3f} cores")
        finally:
            for s in servers.values():
                s.stop()
    return slices, info


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a plain `kill` also stops the servers (finally blocks)
    os.makedirs(RESULTS, exist_ok=True)
    logs_dir = os.path.join(RESULTS, "bench_gateway_logs")
    os.makedirs(logs_dir, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    out_json = args.output or os.path.join(RESULTS, f"bench_gateway{suffix}.json")
    out_png = os.path.splitext(out_json)[0] + ".png"

    if args.cpu_only:
        return cpu_only(args)
    gateway_cpu = gateway_cpu_ms_per_request()
    log(f"gateway CPU per request (in-process, no engine): {gateway_cpu:.3f} ms")
    gateway_cpu_busy = gateway_cpu_ms_per_request(history=args.history) if args.history else None
    if gateway_cpu_busy is not None:
        log(f"same, after {args.history} earlier requests of the key in its windows: {gateway_cpu_busy:.3f} ms")
    t0 = time.monotonic()
    log(f"bench_gateway: both servers at once, {args.pairs} ABBA pairs of {args.slice_requests}-request slices "
        f"(+{args.warmup} warm-up each), concurrency {args.concurrency}, max_tokens {args.max_tokens} (ignore_eos)")
    try:
        slices, info = measure(args, logs_dir)
    except KeyboardInterrupt:
        log("interrupted: servers stopped")
        return 130
    except BenchError as exc:
        log(f"error: {exc}")
        return 2
    total = time.monotonic() - t0

    on, off = pooled(slices, True), pooled(slices, False)
    # the idle server's CPU while the other one was loaded (OFF idles during ON slices and vice versa)
    on["idle_cpu_cores_while_other_loaded"] = sum(s["other_server_cpu_cores"] for s in slices if not s["gateway"]) \
        / max(1, off["slices"])
    off["idle_cpu_cores_while_other_loaded"] = sum(s["other_server_cpu_cores"] for s in slices if s["gateway"]) \
        / max(1, on["slices"])
    ratio = on["req_per_s"] / off["req_per_s"] if off["req_per_s"] else 0.0
    ratios = pair_ratios(slices)
    r_med, r_q1, r_q3 = (percentile(ratios, q) for q in (50, 25, 75))
    cpu_on, cpu_off = on["server_cpu_ms_per_request"], off["server_cpu_ms_per_request"]
    cpu_ratio = cpu_on["total"] / cpu_off["total"] if cpu_on and cpu_off and cpu_off["total"] else 0.0
    errors = on["errors"] + off["errors"]
    not_full = sum(s["not_full_length"] for s in slices)
    passed = ratio >= args.target and errors == 0 and not_full == 0
    idle_max = max(on["idle_cpu_cores_while_other_loaded"], off["idle_cpu_cores_while_other_loaded"])

    print(f"Gateway ON vs OFF: two demo servers ({MODEL}, CPU, {os.cpu_count()} cores) up at once, {args.pairs} ABBA "
          f"pairs of {args.slice_requests}-request slices, closed loop concurrency {args.concurrency}, max_tokens "
          f"{args.max_tokens} ignore_eos")
    print(table(slices, on, off))
    print("req/s: requests / wall time of the slice (pooled: over all slices of that server); lat/ovh in ms; cpu: "
          "server CPU ms per request by process (incl. its tail after the last response); steps/req: engine "
          "iterations per request; idle other: CPU cores the other (idle) server used meanwhile (ON/OFF rows: that "
          "server while the other one was loaded)")
    if on["overhead_ms"]:
        print(f"gateway overhead per request ({OVERHEAD_HEADER}, n={on['overhead_ms']['n']}): "
              f"p50 {on['overhead_ms']['p50']:.3f} ms, p99 {on['overhead_ms']['p99']:.3f} ms")
    print(f"latency p50/p99: on {on['latency_ms']['p50']:.1f}/{on['latency_ms']['p99']:.1f} ms, "
          f"off {off['latency_ms']['p50']:.1f}/{off['latency_ms']['p99']:.1f} ms")
    print(f"server CPU per request: on {cpu_on['total']:.1f} ms (api {cpu_on['api']:.1f}, engine {cpu_on['engine']:.1f}, "
          f"worker {cpu_on['worker']:.1f}), off {cpu_off['total']:.1f} ms (api {cpu_off['api']:.1f}, engine "
          f"{cpu_off['engine']:.1f}, worker {cpu_off['worker']:.1f}); ON/OFF {cpu_ratio:.3f}; engine steps per "
          f"request on {fmt(on['engine_steps_per_request'], '.2f')}, off {fmt(off['engine_steps_per_request'], '.2f')}")
    print(f"idle server CPU while the other was loaded: on {on['idle_cpu_cores_while_other_loaded']:.3f}, off "
          f"{off['idle_cpu_cores_while_other_loaded']:.3f} cores (both idle: "
          f"{', '.join(f'{n} {v:.3f}' for n, v in info['idle_cpu_cores_both_idle'].items())}); "
          + ("no busy-polling: running both at once is fair" if idle_max < 0.05 else
             "WARNING: an idle server burns CPU, so the loaded one competes with it: the comparison is skewed"))
    estimate = cpu_off["total"] / (cpu_off["total"] + gateway_cpu) if cpu_off and cpu_off["total"] else 0.0
    print(f"gateway CPU per request, in-process with real keys/limiter/SQLite and no engine: {gateway_cpu:.3f} ms; "
          f"against {cpu_off['total']:.1f} ms of server CPU per request (OFF) that bounds the throughput ratio at "
          f"{estimate:.3f} on a CPU-bound server"
          + (f"; with {args.history} earlier requests of the key in its windows: {gateway_cpu_busy:.3f} ms"
             if gateway_cpu_busy is not None else ""))
    print(f"per-pair ratios ON/OFF (n={len(ratios)}): median {r_med:.3f}, IQR {r_q1:.3f}..{r_q3:.3f}, range "
          f"{min(ratios):.3f}..{max(ratios):.3f}")
    if errors or not_full:
        print(f"errors: {errors} failed requests, {not_full} responses without exactly {args.max_tokens} tokens")
    print(f"throughput ratio ON/OFF: {ratio:.3f} (ON {on['req_per_s']:.2f} req/s over {on['slices']} slices, OFF "
          f"{off['req_per_s']:.2f} req/s over {off['slices']}), target >= {args.target:.2f}: "
          f"{'PASS' if passed else 'FAIL'}{'' if errors == 0 and not_full == 0 else ' (failed requests)'}")

    report = {
        "benchmark": "bench_gateway", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"model": MODEL, "design": "both servers up at once, ABBA slices", "pairs": args.pairs,
                   "slice_requests": args.slice_requests, "warmup_per_server": args.warmup,
                   "concurrency": args.concurrency, "max_tokens": args.max_tokens, "ignore_eos": True,
                   "settle_s": args.settle, "history": args.history, "target": args.target, "seed": args.seed, "server_args": args.server_arg,
                   "quick": args.quick},
        "environment": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "git": git_commit(),
                        "loadavg_at_end": os.getloadavg()},
        "ratio_req_per_s": ratio, "pair_ratios": ratios,
        "pair_ratio_median": r_med, "pair_ratio_iqr": [r_q1, r_q3],
        "gateway_cpu_ms_per_request": gateway_cpu, "cpu_bound_ratio_estimate": estimate,
        "gateway_cpu_ms_per_request_with_history": gateway_cpu_busy, "history_requests": args.history,
        "ratio_server_cpu_per_request": cpu_ratio, "pass": passed, "errors": errors, "not_full_length": not_full,
        "total_s": total, **info,
        "on": {k: v for k, v in on.items() if not k.startswith("raw_")},
        "off": {k: v for k, v in off.items() if not k.startswith("raw_")},
        "slices": [{k: v for k, v in s.items() if not k.startswith("raw_")} for s in slices],
    }
    with open(out_json, "w") as f:
        json.dump(report, f, indent=2)
    made_png = plot(out_png, slices, on, off, ratios,
                    f"gateway on/off, {args.pairs} ABBA pairs x {args.slice_requests} req, concurrency "
                    f"{args.concurrency}: ratio {ratio:.3f}, pair median {r_med:.3f} (IQR {r_q1:.3f}..{r_q3:.3f})")
    print(f"wrote {os.path.relpath(out_json, ROOT)}" + (f" and {os.path.relpath(out_png, ROOT)}" if made_png else "")
          + f"; total {total:.0f}s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
