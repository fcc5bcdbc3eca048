"""Issue 45's probe, replayed against the demo server with the gateway on, then SIGTERM timed.

    .venv/bin/python benchmarks/investigations/abuse_then_sigterm.py [--idle 5000] [--keyless 3000] [--models 3000]

What it does, in order, on a fresh data dir: a key scoped to another model sends ``"model": "\\ud800"`` (the silent
outage's trigger); a key without limits sends ``n = 10**30`` and ``n = 16384``; ``--keyless`` requests with no key
and client-chosen ids; ``--models`` distinct model names from the scoped key; ``--idle`` connections that never send a
byte. Then it reads what the probe saw broken (a metered request's latency and status, ``/health``, ``/metrics``'
status and size, the ledger's rows, spill and dead-letter files) and sends SIGTERM to the server's process group,
timing how long the server takes to exit (the target: < 10 s). Prints one table; exit status 1 when a target is
missed.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from qwen_vllm_ext.bench.server import ServeProcess
from qwen_vllm_ext.demo import SERVED_NAME

ADMIN = "abuse-admin-key-0123456789"
HI = [{"role": "user", "content": "hi"}]


def make_key(base_url: str, **fields) -> str:
    r = httpx.post(base_url + "/qwen_ext/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"}, json=fields,
                   timeout=60)
    r.raise_for_status()
    return r.json()["key"]


async def flood(base_url: str, bodies_headers: list[tuple[bytes, dict]]) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=32)) as client:
        gate = asyncio.Semaphore(32)

        async def one(body, headers):
            async with gate:
                try:
                    return (await client.post("/v1/chat/completions", content=body, headers=headers)).status_code
                except httpx.TransportError:
                    return 599

        return await asyncio.gather(*(one(b, h) for b, h in bodies_headers))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int, default=5000, help="idle connections that never send a byte")
    ap.add_argument("--keyless", type=int, default=3000)
    ap.add_argument("--models", type=int, default=3000)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    data = Path(tempfile.mkdtemp(prefix="abuse-"))
    server = ServeProcess(["--qwen-data-dir", str(data), "--qwen-gateway", "true"], data / "server.log",
                          env={**os.environ, "QWEN_VLLM_EXT_ADMIN_KEY": ADMIN})
    rows: list[tuple[str, str]] = []
    ok = True
    try:
        server.wait_healthy()
        url = server.base_url
        scoped, open_key = make_key(url, name="scoped", models=["some-other-model"]), make_key(url, name="open")
        enc = lambda body: json.dumps(body).encode()  # noqa: E731 (non-ASCII as \\u escapes: lone surrogates travel)
        auth = lambda k: {"authorization": f"Bearer {k}", "content-type": "application/json"}  # noqa: E731
        poison = httpx.post(url + "/v1/chat/completions", content=enc({"model": "\ud800", "messages": HI}),
                            headers=auth(scoped), timeout=60)
        rows.append(("model \"\\ud800\" from a scoped key", f"{poison.status_code} {poison.json()['error']['code']}"))
        for n in (10**30, 16384):
            r = httpx.post(url + "/v1/chat/completions", timeout=120, headers=auth(open_key),
                           content=enc({"model": SERVED_NAME, "messages": HI, "n": n, "max_tokens": 1}))
            rows.append((f"n = {'10**30' if n > 10**9 else n}, max_tokens 1", f"{r.status_code} {r.json()['error']['code']}"))
        t0 = time.monotonic()
        keyless = asyncio.run(flood(url, [(enc({"model": SERVED_NAME, "messages": HI}),
                                           {"x-request-id": f"attacker-{i}", "content-type": "application/json"})
                                          for i in range(args.keyless)]))
        rows.append((f"{args.keyless} keyless requests", f"{sorted(set(keyless))} in {time.monotonic() - t0:.1f} s"))
        t0 = time.monotonic()
        models = asyncio.run(flood(url, [(enc({"model": f"model-{i}", "messages": HI}), auth(scoped))
                                         for i in range(args.models)]))
        rows.append((f"{args.models} distinct model names", f"{sorted(set(models))} in {time.monotonic() - t0:.1f} s"))
        idle = []
        for _ in range(args.idle):
            s = socket.create_connection(("127.0.0.1", server.port))
            idle.append(s)
        time.sleep(1.0)
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", headers=auth(open_key), timeout=60,
                       content=enc({"model": SERVED_NAME, "messages": HI, "max_tokens": 4}))
        metered_s = time.monotonic() - t0
        ok &= r.status_code == 200 and metered_s < 5
        rows.append((f"metered request with {args.idle} idle connections open",
                     f"{r.status_code}, {r.json()['usage']['total_tokens']} tokens, {metered_s:.2f} s"))
        health = httpx.get(url + "/health", timeout=30).status_code
        metrics = httpx.get(url + "/metrics", timeout=30)
        ok &= health == 200 and metrics.status_code == 200 and len(metrics.content) < 1 << 20
        rows.append(("/health, /metrics", f"{health}, {metrics.status_code} ({len(metrics.content)} bytes)"))
        with sqlite3.connect(data / "ledger.sqlite3") as db:
            total = db.execute("SELECT count(*) FROM requests").fetchone()[0]
            unauth = db.execute("SELECT count(*) FROM requests WHERE http_status = 401").fetchone()[0]
            distinct = db.execute("SELECT count(DISTINCT model) FROM requests").fetchone()[0]
        rows.append(("ledger rows (401 rows, distinct models)", f"{total} ({unauth}, {distinct})"))
        spills = glob.glob(str(data / "ledger-spill-*.jsonl")) + glob.glob(str(data / "ledger-deadletter-*.jsonl"))
        ok &= not spills
        rows.append(("spill / dead-letter files", str(len(spills))))
        mode = oct(os.stat(data / "ledger.sqlite3").st_mode & 0o777)
        rows.append(("ledger.sqlite3 mode", mode))
        t0 = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=60)
            stop_s = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            stop_s = float("inf")
        ok &= stop_s < 10
        rows.append((f"SIGTERM -> exit ({args.idle} idle connections still open)", f"{stop_s:.1f} s"))
        for s in idle:
            s.close()
    finally:
        server.stop()
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    print("all targets met" if ok else "a target was missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
