"""Issue 37 follow-up: why a test client that leaves a stream after a few chunks sometimes gets a "length" record.

A demo server with the extension, N busy-loop processes next to it (the CPU contention of CI's parallel schedule).
Each round: 2 short streams, 2 streams ended by a stop string, and 2 streams whose client reads 3-4 chunks and closes
(max_tokens 4,000). For each disconnecting client it prints, in seconds after the client sent its request: when the
response headers arrived, when the first chunk arrived, when the client closed, and the ledger record (status,
completion tokens, latency).

What it showed (3 busy loops, 2 cores): in the rounds with a "length" record the client got its headers at once but
its first chunk only after ~17 s, when the engine had generated all 4,000 tokens, and then closed at once. The server
notices a close within a millisecond (traced separately); the client was starved, not the disconnect lost.

usage: .venv/bin/python benchmarks/investigations/disconnect_client_starvation.py <busy loops> [rounds]
"""
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from qwen_vllm_ext.bench.server import ServeProcess
from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
data = tempfile.mkdtemp()
server = ServeProcess(["--qwen-data-dir", data], os.path.join(data, "server.log"))
server.wait_healthy()
hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(sys.argv[1]))]
client = httpx.Client(base_url=server.base_url, timeout=120)
seen = {}


def stream(rid, body, stop_after=None):
    start, first, n = time.time(), None, 0
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                       headers={"X-Request-ID": rid}) as r:
        headers = time.time()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first = first or time.time()
                n += 1
                if stop_after and n >= stop_after:
                    break
    seen[rid] = (start, headers, first, time.time())


base = {"model": "qwen3-demo", "temperature": 0}
store = SqliteLedgerStore(os.path.join(data, "ledger.sqlite3"))
try:
    for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
        tag, jobs = uuid.uuid4().hex[:6], []
        for i in range(2):
            jobs.append((f"len-{tag}-{i}", {**base, "messages": [{"role": "user", "content": f"Tell {i}"}],
                                            "max_tokens": 12, "ignore_eos": True}, None))
            jobs.append((f"disc-{tag}-{i}", {**base, "messages": [{"role": "user", "content": f"Go on {i}"}],
                                             "max_tokens": 4000, "ignore_eos": True}, 3 + i))
            jobs.append((f"stop-{tag}-{i}", {**base, "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 30, "stop": [" "]}, None))
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: stream(*job), jobs))
        for rid in (j[0] for j in jobs if j[2]):
            deadline = time.monotonic() + 60
            while (record := store.get(rid)) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            start, headers, first, closed = seen[rid]
            print(f"round {rnd} {rid}: headers +{headers - start:.2f} s, first chunk +{first - start:.2f} s, "
                  f"closed +{closed - start:.2f} s; record {record.status}, {record.completion_tokens} tokens, "
                  f"{record.latency_s:.2f} s", flush=True)
finally:
    for hog in hogs:
        hog.kill()
    server.stop()
