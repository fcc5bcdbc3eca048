#!/usr/bin/env python
"""Cost of the in-server gateway: the same load against the demo server with the gateway ON and OFF, in one run.

Each phase starts ONE fresh demo server (``python -m qwen_vllm_ext.serve`` on the CPU demo model
``qwen3-demo``, its own fresh data dir, a free loopback port), waits for ``GET /health``, checks that the
gateway really is on or off (``/qwen_ext/health`` settings; an unauthenticated request gets 401 when on, no
``x-qwen-gateway-overhead-ms`` header when off), sends warm-up requests, then the measured load, and stops the
server (its whole process group) before the next phase starts. Phases are interleaved (default
``off,on,off``: the ON phase sits between two OFF phases, so a linear drift of the machine's speed cancels
out in the ratio).

Load: closed loop, ``--concurrency`` workers (default 8) each sending the next request as soon as its previous
one finished; ``--requests`` chat completions per phase (default 200, ``--quick`` 60), short mixed zh/en
prompts (the same seeded sequence in every phase), ``max_tokens`` 16 with ``ignore_eos: true`` (every request
decodes exactly 16 tokens; checked from ``usage``). With the gateway on, requests carry
``Authorization: Bearer <secret>`` of a key created beforehand (``python -m qwen_vllm_ext.keys create``) with
limits high enough that nothing is rate limited; with it off, a dummy bearer token of the same length is sent,
so both phases put the same bytes on the wire.

Reported per phase: requests, req/s and completion tokens/s (wall time from the first request sent to the last
response), end-to-end latency p50/p99, and with the gateway on the gateway's own admission time per request
from the ``x-qwen-gateway-overhead-ms`` response header (auth, body checks, exact prompt count, atomic
reservation) p50/p99, and the CPU time of the server's processes per request (user + system, from /proc,
over the measured load; the server's idle CPU is measured over 2 s after the load: if it busy-polled, this
figure would track wall time too). The spike breaker is given a floor no benchmark reaches
(``--qwen-spike-min-units 1e15``): it still runs on every request, but a fresh key's burst does not get it
suspended. Headline: throughput ratio ON/OFF = mean req/s of the ON phases / mean req/s of the OFF
phases, PASS when >= 0.97 (``--target``). Any failed request fails the run (exit 1), as does a ratio below the
target (exit 1 too; the JSON says which).

    .venv/bin/python benchmarks/bench_gateway.py            # 3 phases x 200 requests, ~4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_gateway.py --quick    # 3 phases x 60 requests, ~3 minutes
    .venv/bin/python benchmarks/bench_gateway.py --phases on,off,on --concurrency 16

Writes ``benchmarks/results/bench_gateway.json`` (``bench_gateway_quick.json`` with ``--quick``), a PNG of the
latency CDFs on/off and of the gateway overhead when matplotlib is importable, and each server's log under
``benchmarks/results/bench_gateway_logs/``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MODEL = "qwen3-demo"
OVERHEAD_HEADER = "x-qwen-gateway-overhead-ms"
SEED = 20250611

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int, seed: int) -> list[str]:
    """The same seeded sequence of short mixed zh/en prompts for every phase (a number keeps them distinct)."""
    rng = random.Random(seed)
    pool = ZH + EN + MIXED
    return [f"{rng.choice(pool)} (#{i})" for i in range(n)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ server
class Server:
    """One demo server in its own process group (start_new_session), always stopped with killpg."""

    def __init__(self, gateway: bool, data_dir: str, log_path: str, extra: list[str]):
        self.gateway = gateway
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        argv = [sys.executable, "-m", "qwen_vllm_ext.serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--qwen-data-dir", data_dir, "--qwen-gateway", "true" if gateway else "false",
                # the spike breaker still observes every request (its cost is measured) but never trips: a
                # benchmark's burst on a fresh key is exactly what it would suspend (403 api_key_suspended)
                "--qwen-spike-min-units", "1e15", *extra]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the live processes of this server's process group (from /proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # field 5 (pgrp) is index 2 after the comm field
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise BenchError(f"server exited with {self.proc.returncode} before becoming healthy; log tail:\n"
                                 f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise BenchError(f"server not healthy after {timeout:.0f}s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # the group may outlive its leader (engine core, workers): make sure nothing of it is left
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()


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


def summarize(name: str, gateway: bool, load: dict, max_tokens: int) -> dict:
    res = load["results"]
    ok = [r for r in res if r["status"] == 200]
    bad = [r for r in res if r["status"] != 200]
    short = [r for r in ok if r.get("completion_tokens") != max_tokens]
    lat_ms = [r["latency_s"] * 1000 for r in ok]
    ovh = [r["overhead_ms"] for r in ok if r["overhead_ms"] is not None]
    tokens = sum(r.get("completion_tokens", 0) for r in ok)
    wall = load["wall_s"]
    return {
        "phase": name, "gateway": gateway, "requests": len(res), "ok": len(ok), "errors": len(bad),
        "not_full_length": len(short), "wall_s": wall,
        "req_per_s": len(ok) / wall if wall > 0 else 0.0,
        "completion_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "completion_tokens": tokens, "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in ok),
        "latency_ms": {"p50": percentile(lat_ms, 50), "p90": percentile(lat_ms, 90), "p99": percentile(lat_ms, 99),
                       "mean": sum(lat_ms) / len(lat_ms) if lat_ms else None},
        "overhead_ms": ({"p50": percentile(ovh, 50), "p90": percentile(ovh, 90), "p99": percentile(ovh, 99),
                         "max": max(ovh), "mean": sum(ovh) / len(ovh), "n": len(ovh)} if ovh else None),
        "server_cpu_s": load["server_cpu_s"], "server_idle_cpu_frac": load["server_idle_cpu_frac"],
        "server_cpu_ms_per_request": load["server_cpu_s"] * 1000 / len(ok) if ok else None,
        "error_samples": [r.get("error") for r in bad[:5]],
        "raw_latency_ms": lat_ms, "raw_overhead_ms": ovh,
    }


def run_phase(idx: int, gateway: bool, args, texts, warm_texts, logs_dir: str) -> dict:
    name = f"{idx + 1}:{'on' if gateway else 'off'}"
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as data_dir:
        token = create_key(data_dir) if gateway else None
        log_path = os.path.join(logs_dir, f"phase{idx + 1}-{'on' if gateway else 'off'}.log")
        log(f"phase {name}: starting server (gateway {'on' if gateway else 'off'}), log {os.path.relpath(log_path, ROOT)}")
        t_start = time.monotonic()
        server = Server(gateway, data_dir, log_path, args.server_arg)
        try:
            startup = server.wait_healthy(args.startup_timeout)
            log(f"phase {name}: healthy after {startup:.1f}s on port {server.port}")
            if token is None:
                token = "qve-" + "x" * 40  # a dummy bearer of similar length, ignored without the gateway
            check_mode(server, token)
            warm = asyncio.run(run_load(server.base_url, token, warm_texts, args.concurrency, args.max_tokens,
                                        args.request_timeout))
            warm_bad = [r for r in warm["results"] if r["status"] != 200]
            if warm_bad:
                raise BenchError(f"phase {name}: {len(warm_bad)} warm-up requests failed: {warm_bad[0].get('error')}")
            log(f"phase {name}: warm-up {len(warm_texts)} requests in {warm['wall_s']:.1f}s; measuring {len(texts)}")
            cpu0 = server.cpu_seconds()
            load = asyncio.run(run_load(server.base_url, token, texts, args.concurrency, args.max_tokens,
                                        args.request_timeout))
            load["server_cpu_s"] = server.cpu_seconds() - cpu0
            time.sleep(1.0)
            idle0 = server.cpu_seconds()
            time.sleep(2.0)
            idle_cpu = (server.cpu_seconds() - idle0) / 2.0  # busy-polling processes burn CPU even when idle
            load["server_idle_cpu_frac"] = idle_cpu
        finally:
            server.stop()
        summary = summarize(name, gateway, load, args.max_tokens)
        summary["startup_s"] = startup
        summary["phase_total_s"] = time.monotonic() - t_start
        log(f"phase {name}: {summary['ok']}/{summary['requests']} ok, {summary['req_per_s']:.2f} req/s, "
            f"p50 {fmt(summary['latency_ms']['p50'])} ms; server stopped")
        return summary


# ------------------------------------------------------------------------------------------------ report
def table(phases: list[dict], on: dict, off: dict) -> str:
    head = f"{'phase':<8}{'requests':>9}{'errors':>7}{'req/s':>8}{'tok/s':>8}{'lat p50 ms':>11}{'lat p99 ms':>11}" \
           f"{'ovh p50 ms':>11}{'ovh p99 ms':>11}{'cpu ms/req':>11}"
    lines = [head, "-" * len(head)]

    def row(name, s):
        o = s.get("overhead_ms") or {}
        return (f"{name:<8}{s['requests']:>9}{s['errors']:>7}{s['req_per_s']:>8.2f}{s['completion_tokens_per_s']:>8.1f}"
                f"{fmt(s['latency_ms']['p50']):>11}{fmt(s['latency_ms']['p99']):>11}"
                f"{fmt(o.get('p50'), '.3f'):>11}{fmt(o.get('p99'), '.3f'):>11}"
                f"{fmt(s['server_cpu_ms_per_request']):>11}")

    for s in phases:
        lines.append(row(s["phase"], s))
    lines.append("-" * len(head))
    lines.append(row("ON", on))
    lines.append(row("OFF", off))
    return "\n".join(lines)


def pooled(phases: list[dict], gateway: bool) -> dict:
    sel = [p for p in phases if p["gateway"] == gateway]
    lat = [x for p in sel for x in p["raw_latency_ms"]]
    ovh = [x for p in sel for x in p["raw_overhead_ms"]]
    return {
        "phases": [p["phase"] for p in sel], "requests": sum(p["requests"] for p in sel),
        "errors": sum(p["errors"] for p in sel),
        "req_per_s": sum(p["req_per_s"] for p in sel) / len(sel),  # mean over phases
        "completion_tokens_per_s": sum(p["completion_tokens_per_s"] for p in sel) / len(sel),
        "server_cpu_ms_per_request": sum(p["server_cpu_ms_per_request"] for p in sel) / len(sel),
        "latency_ms": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)},
        "overhead_ms": ({"p50": percentile(ovh, 50), "p99": percentile(ovh, 99), "n": len(ovh)} if ovh else None),
        "raw_latency_ms": lat, "raw_overhead_ms": ovh,
    }


def plot(path: str, on: dict, off: dict, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
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
        ax.legend(loc="lower right")
    ax.set_xlabel(f"gateway admission time ({OVERHEAD_HEADER}, ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Gateway overhead per request CDF")
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
def gateway_cpu_ms_per_request(n: int = 500) -> float:
    """CPU milliseconds (all threads) the gateway middleware spends per admitted request, in-process, with the
    real key store, SQLite limiter, spike breaker and calculator in front of a no-op app: the gateway's cost
    without the engine's noise."""
    import asyncio
    import tempfile
    import types

    from qwen_v3_calculator import Calculator
    from qwen_v3_calculator.billing import get_policy
    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.gateway.keys import KeyCache, SqliteKeyStore
    from qwen_vllm_ext.gateway.limiter import SqliteLimiter
    from qwen_vllm_ext.gateway.middleware import GatewayMiddleware
    from qwen_vllm_ext.gateway.spike import SpikeBreaker
    from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

    d = tempfile.mkdtemp(prefix="bench-gw-cpu-")
    settings = Settings(data_dir=d, gateway=True, spike_min_units=1e15)
    keys = SqliteKeyStore(os.path.join(d, "ledger.sqlite3"), "s" * 32)
    secret, _ = keys.create("bench", rpm=10**9, tpm=10**12)
    limiter = SqliteLimiter(os.path.join(d, "limiter.sqlite3"))
    breaker = SpikeBreaker(settings, limiter, keys, SqliteLedgerStore(os.path.join(d, "ledger.sqlite3")))
    record = types.SimpleNamespace(engine_prompt_tokens=12, completion_tokens=16, billed_total_micro=33_600_000)

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        for callback in scope["state"].get("qwen_usage_callbacks", ()):  # what the ledger does after a response
            callback(record)

    gateway = GatewayMiddleware(app, settings=settings, keys=KeyCache(keys), limiter=limiter,
                                policy=get_policy("default"), on_spike=breaker.observe)
    state = types.SimpleNamespace(qwen_vllm_ext_calculator=Calculator(), qwen_max_model_len=4096)
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="60 requests per phase, 24 warm-up requests")
    p.add_argument("--requests", type=int, help="measured requests per phase (default 200; --quick 60)")
    p.add_argument("--warmup", type=int, help="warm-up requests per phase (default 48; --quick 24)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop concurrency (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request, with ignore_eos (default 16)")
    p.add_argument("--phases", default="off,on,off",
                   help="comma-separated order of phases, each 'on' or 'off' (default off,on,off)")
    p.add_argument("--target", type=float, default=0.97, help="minimum throughput ratio ON/OFF (default 0.97)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the server (repeatable), e.g. --server-arg=--qwen-ledger=false")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--output", help="JSON path (default benchmarks/results/bench_gateway[_quick].json)")
    args = p.parse_args(argv)
    args.requests = args.requests or (60 if args.quick else 200)
    args.warmup = args.warmup if args.warmup is not None else (24 if args.quick else 48)
    args.phase_list = [x.strip().lower() for x in args.phases.split(",") if x.strip()]
    if not args.phase_list or any(x not in ("on", "off") for x in args.phase_list):
        p.error("--phases: comma-separated 'on'/'off'")
    if "on" not in args.phase_list or "off" not in args.phase_list:
        p.error("--phases needs at least one 'on' and one 'off' phase")
    if args.concurrency < 1 or args.requests < 1:
        p.error("--concurrency and --requests must be positive")
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a plain `kill` also stops the servers (finally blocks)
    os.makedirs(RESULTS, exist_ok=True)
    logs_dir = os.path.join(RESULTS, "bench_gateway_logs")
    os.makedirs(logs_dir, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    out_json = args.output or os.path.join(RESULTS, f"bench_gateway{suffix}.json")
    out_png = os.path.splitext(out_json)[0] + ".png"

    gateway_cpu = gateway_cpu_ms_per_request()
    log(f"gateway CPU per request (in-process, no engine): {gateway_cpu:.3f} ms")
    texts = prompts(args.requests, args.seed)
    warm_texts = prompts(args.warmup, args.seed + 1) if args.warmup else []
    t0 = time.monotonic()
    log(f"bench_gateway: phases {','.join(args.phase_list)}, {args.requests} requests/phase "
        f"(+{args.warmup} warm-up), concurrency {args.concurrency}, max_tokens {args.max_tokens} (ignore_eos)")
    phases = []
    try:
        for idx, mode in enumerate(args.phase_list):
            phases.append(run_phase(idx, mode == "on", args, texts, warm_texts, logs_dir))
    except KeyboardInterrupt:
        log("interrupted: servers stopped")
        return 130
    except BenchError as exc:
        log(f"error: {exc}")
        return 2
    total = time.monotonic() - t0

    on, off = pooled(phases, True), pooled(phases, False)
    ratio = on["req_per_s"] / off["req_per_s"] if off["req_per_s"] else 0.0
    tok_ratio = on["completion_tokens_per_s"] / off["completion_tokens_per_s"] if off["completion_tokens_per_s"] else 0.0
    cpu_ratio = on["server_cpu_ms_per_request"] / off["server_cpu_ms_per_request"] \
        if off["server_cpu_ms_per_request"] else 0.0
    errors = sum(p["errors"] for p in phases)
    not_full = sum(p["not_full_length"] for p in phases)
    passed = ratio >= args.target and errors == 0

    print(f"Gateway ON vs OFF: demo server ({MODEL}, CPU, {os.cpu_count()} cores), closed loop concurrency "
          f"{args.concurrency}, {args.requests} requests/phase (+{args.warmup} warm-up), max_tokens "
          f"{args.max_tokens} ignore_eos, phases {','.join(args.phase_list)}")
    print(table(phases, on, off))
    print("ON/OFF: mean req/s of the ON phases / mean req/s of the OFF phases; latency and overhead pooled; "
          "cpu ms/req: CPU time of the server's processes per request")
    if on["overhead_ms"]:
        print(f"gateway overhead per request ({OVERHEAD_HEADER}, n={on['overhead_ms']['n']}): "
              f"p50 {on['overhead_ms']['p50']:.3f} ms, p99 {on['overhead_ms']['p99']:.3f} ms")
    print(f"latency p50/p99: on {on['latency_ms']['p50']:.1f}/{on['latency_ms']['p99']:.1f} ms, "
          f"off {off['latency_ms']['p50']:.1f}/{off['latency_ms']['p99']:.1f} ms")
    p50_ratio = off["latency_ms"]["p50"] / on["latency_ms"]["p50"] if on["latency_ms"]["p50"] else 0.0
    print(f"stall-robust estimate (closed loop: req/s ~ concurrency / latency): p50 latency OFF/ON "
          f"{p50_ratio:.3f}")
    print(f"server CPU per request: on {on['server_cpu_ms_per_request']:.1f} ms, off "
          f"{off['server_cpu_ms_per_request']:.1f} ms (ON/OFF {cpu_ratio:.3f}); idle server CPU "
          f"{', '.join(format(p['server_idle_cpu_frac'], '.2f') for p in phases)} cores per phase (when well above "
          f"0, the server burns CPU while idle and CPU time tracks wall time)")
    spread = [p["req_per_s"] for p in phases if not p["gateway"]]
    if len(spread) > 1:
        print(f"OFF phases req/s spread: {min(spread):.2f}..{max(spread):.2f} "
              f"({(max(spread) - min(spread)) / (sum(spread) / len(spread)) * 100:.0f}% of their mean: run-to-run noise)")
    estimate = off["server_cpu_ms_per_request"] / (off["server_cpu_ms_per_request"] + gateway_cpu) \
        if off["server_cpu_ms_per_request"] else 0.0
    print(f"gateway CPU per request, in-process with real keys/limiter/SQLite and no engine: {gateway_cpu:.3f} ms; "
          f"against {off['server_cpu_ms_per_request']:.1f} ms of server CPU per request (OFF) that bounds the "
          f"throughput ratio at {estimate:.3f} on a CPU-bound server")
    if errors or not_full:
        print(f"errors: {errors} failed requests, {not_full} responses without exactly {args.max_tokens} tokens")
    print(f"throughput ratio ON/OFF: {ratio:.3f} req/s ({tok_ratio:.3f} tokens/s), target >= {args.target:.2f}: "
          f"{'PASS' if passed else 'FAIL'}{'' if errors == 0 else ' (failed requests)'}")

    report = {
        "benchmark": "bench_gateway", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"model": MODEL, "phases": args.phase_list, "requests_per_phase": args.requests,
                   "warmup_per_phase": args.warmup, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                   "ignore_eos": True, "target": args.target, "seed": args.seed, "server_args": args.server_arg,
                   "quick": args.quick},
        "environment": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "git": git_commit()},
        "ratio_req_per_s": ratio, "ratio_tokens_per_s": tok_ratio, "gateway_cpu_ms_per_request": gateway_cpu,
        "cpu_bound_ratio_estimate": estimate,
        "ratio_server_cpu_per_request": cpu_ratio, "ratio_p50_latency_off_on": p50_ratio, "pass": passed, "errors": errors,
        "not_full_length": not_full, "total_s": total,
        "on": {k: v for k, v in on.items() if not k.startswith("raw_")},
        "off": {k: v for k, v in off.items() if not k.startswith("raw_")},
        "phases": phases,
    }
    with open(out_json, "w") as f:
        json.dump(report, f, indent=2)
    made_png = plot(out_png, on, off, f"gateway on/off, {args.requests} req/phase, concurrency {args.concurrency}, "
                                      f"ratio {ratio:.3f}")
    print(f"wrote {os.path.relpath(out_json, ROOT)}" + (f" and {os.path.relpath(out_png, ROOT)}" if made_png else "")
          + f"; total {total:.0f}s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
