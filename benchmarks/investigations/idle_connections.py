"""Issue 45, item 4: idle TCP connections against vLLM's HTTP server, without and with the connection guard.

The server is vLLM's own ``serve_http`` (the uvicorn server every vLLM API-server process runs, ``NoSignalServer``
on uvloop) serving a small FastAPI app (``/health``, ``POST /v1/echo``, ``/hold?s=N``, ``/guard``) in a child
process, so no engine is needed and the numbers are about sockets only. Its open-file limit is this machine's (the
guard raises the soft limit to the hard one; here both are 20,000).

Phases, each against a fresh server:

* ``stock``   connection_guard=false: N connections that never send a byte; probes of /health and POST /v1/echo
              (3 s timeout) while they are open; after --hold seconds, how many are still open.
* ``guarded`` the default settings (header timeout 60 s, cap = open-file limit - 1,024): the same N connections;
              for each, when it was closed and with what (408 request_header_timeout, 408 idle_connection_closed
              when evicted at the cap, 503 refusal, reset), the probes, the guard's counters.
* ``refusal`` max_connections=200: 200 connections each busy with a 6 s request, then 20 newcomers: what they read.

The N idle connections are opened by --clients child processes (each needs its own descriptors), each keeping its
sockets in one epoll and recording when each one got data or EOF.

usage: .venv/bin/python benchmarks/investigations/idle_connections.py [--connections 20000] [--clients 2]
       [--hold 20] [--phases stock,guarded,refusal]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import time

import httpx

HERE = os.path.abspath(__file__)


# ---- the server (child process) -------------------------------------------------------------------------------------
def serve(port: int, settings_json: str) -> None:
    import asyncio

    import uvloop
    from fastapi import FastAPI

    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.gateway import vllm_connections
    from vllm.entrypoints.launchers import launcher

    settings = Settings.from_flat(json.loads(settings_json))
    if settings.connection_guard:
        vllm_connections.install(settings)
    app = FastAPI()
    app.state.engine_client = None  # serve_http runs no engine watchdog then

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/echo")
    async def echo(body: dict):
        return body

    @app.get("/hold")
    async def hold(s: float = 6.0):
        await asyncio.sleep(s)
        return {"held": s}

    @app.get("/guard")
    async def guard():
        return {"status": vllm_connections.status(), "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)}

    sock = launcher.create_server_socket(("127.0.0.1", port), reuse_port=False)

    async def main():
        shutdown = await launcher.serve_http(app, sock, host="127.0.0.1", port=port, log_level="warning",
                                             access_log=False, timeout_keep_alive=5)
        await shutdown

    uvloop.run(main())


class Server:
    def __init__(self, settings: dict):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(f"/tmp/idle_connections_{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, HERE, "--serve", str(self.port), json.dumps(settings)],
                                     stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start: /tmp/idle_connections_{self.port}.log")
            time.sleep(0.5)

    def guard(self) -> dict | None:
        try:
            return httpx.get(self.url + "/guard", timeout=5).json()
        except httpx.HTTPError as exc:
            return {"error": repr(exc)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- idle clients (child processes) ---------------------------------------------------------------------------------
def raise_own_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def classify(data: bytes) -> str:
    if not data:
        return "closed without an answer"
    if b"request_header_timeout" in data:
        return "408 request_header_timeout"
    if b"idle_connection_closed" in data:
        return "408 idle_connection_closed (evicted)"
    if data.startswith(b"HTTP/1.1 503"):
        return "503 too_many_connections"
    return data[:40].decode(errors="replace")


def idle_client(port: int, count: int, hold: float, t0: float, out) -> None:
    """Open ``count`` connections that never send a byte; for ``hold`` seconds after opening them, record when each
    gets data or EOF. Sends (opened, failed, open_done_at, [(closed_at, what)], still_open) through ``out``."""
    raise_own_fd_limit()
    ep = select.epoll()
    socks, opened_at, failed = {}, {}, {}
    for _ in range(count):
        s = socket.socket()
        s.settimeout(3)
        try:
            s.connect(("127.0.0.1", port))
        except OSError as exc:
            failed[type(exc).__name__] = failed.get(type(exc).__name__, 0) + 1
            s.close()
            continue
        s.setblocking(False)
        ep.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
        socks[s.fileno()] = s
        opened_at[s.fileno()] = time.time() - t0
    open_done = time.time() - t0
    data, closed = {}, []
    end = time.time() + hold
    while socks and time.time() < end:
        for fd, _ in ep.poll(max(0.0, min(0.5, end - time.time()))):
            s = socks[fd]
            try:
                chunk = s.recv(4096)
            except (ConnectionResetError, BlockingIOError) as exc:
                chunk = b"" if isinstance(exc, ConnectionResetError) else None
            if chunk is None:
                continue
            if chunk:
                data[fd] = data.get(fd, b"") + chunk
                continue
            closed.append((opened_at[fd], time.time() - t0, classify(data.pop(fd, b""))))
            ep.unregister(fd)
            s.close()
            del socks[fd]
    still_open = len(socks)
    for s in socks.values():
        s.close()
    out.send((len(opened_at), failed, open_done, closed, still_open))


def probe(url: str) -> tuple[str, str]:
    """One /health and one POST /v1/echo, each on a new connection (3 s timeout): status or exception, latency."""
    import http.client

    host, port = url.rsplit("/", 1)[1].split(":")
    res = []
    for method, path, body in (("GET", "/health", None), ("POST", "/v1/echo", b'{"hello": "world"}')):
        t = time.time()
        conn = http.client.HTTPConnection(host, int(port), timeout=3)
        try:
            conn.request(method, path, body=body, headers={"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            res.append(f"{r.status} in {1000 * (time.time() - t):.0f} ms")
        except OSError as exc:
            res.append(f"{type(exc).__name__} after {time.time() - t:.1f} s")
        finally:
            conn.close()
    return res[0], res[1]


def idle_phase(name: str, settings: dict, n: int, clients: int, hold: float) -> dict:
    server = Server(settings)
    print(f"\n== {name}: {n} idle connections, settings {settings or 'defaults'}; server fd limit "
          f"{(server.guard() or {}).get('fd_limit')}", flush=True)
    t0 = time.time()
    pipes, procs = [], []
    for i in range(clients):
        parent, child = multiprocessing.Pipe(duplex=False)
        share = n // clients + (1 if i < n % clients else 0)
        p = multiprocessing.Process(target=idle_client, args=(server.port, share, hold, t0, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    probes, results = [], [None] * clients
    deadline = time.time() + hold + 120
    while any(r is None for r in results) and time.time() < deadline:
        at = time.time() - t0
        health, echo = probe(server.url)
        probes.append((round(at, 1), health, echo))
        print(f"  t={at:5.1f} s  /health {health:28}  POST /v1/echo {echo}", flush=True)
        while time.time() - t0 - at < 2.0:
            for i, pipe in enumerate(pipes):
                if results[i] is None and pipe.poll(0.05):
                    results[i] = pipe.recv()
    for p in procs:
        p.join()
    guard = server.guard()
    server.stop()
    opened = sum(r[0] for r in results)
    failed: dict = {}
    for r in results:
        for k, v in r[1].items():
            failed[k] = failed.get(k, 0) + v
    closed = [c for r in results for c in r[3]]
    still_open = sum(r[4] for r in results)
    by_kind: dict = {}
    for opened_at, closed_at, what in closed:
        by_kind.setdefault(what, []).append((opened_at, closed_at))
    print(f"  opened {opened} of {n} in {max(r[2] for r in results):.1f} s (connect failures: {failed or 'none'})")
    for what, times in sorted(by_kind.items()):
        lived = [c - o for o, c in times]
        closed_at = [c for _, c in times]
        print(f"  {len(times):6} closed with {what}: at t={min(closed_at):.1f}..{max(closed_at):.1f} s; open for "
              f"{min(lived):.1f}..{max(lived):.1f} s (median {statistics.median(lived):.1f})")
    print(f"  {still_open:6} still open {hold:g} s after they were opened")
    if guard and guard.get("status"):
        print(f"  guard: {json.dumps(guard['status'])}")
    return {"name": name, "settings": settings, "connections": n, "opened": opened, "connect_failures": failed,
            "closed": {k: len(v) for k, v in by_kind.items()}, "still_open_after_hold": still_open, "hold_s": hold,
            "probes": probes, "guard": guard}


def refusal_phase() -> dict:
    settings = {"max_connections": 200}
    server = Server(settings)
    print(f"\n== refusal: settings {settings}; 200 connections busy with a 6 s request, then 20 newcomers", flush=True)
    busy = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        s.sendall(b"GET /hold?s=6 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        busy.append(s)
    time.sleep(1.5)
    answers = []
    for _ in range(20):
        t = time.time()
        r = httpx.get(server.url + "/health", timeout=5)
        answers.append((r.status_code, round(1000 * (time.time() - t), 1), dict(r.headers), r.text))
    codes: dict = {}
    for code, *_ in answers:
        codes[code] = codes.get(code, 0) + 1
    print(f"  newcomers: {codes}; latency {min(a[1] for a in answers)}..{max(a[1] for a in answers)} ms")
    sample = next((a for a in answers if a[0] == 503), None)
    if sample:
        print(f"  a refusal: HTTP {sample[0]}, headers {sample[2]}\n  body {sample[3]}")
    ok = sum(1 for s in busy if s.recv(64).startswith(b"HTTP/1.1 200"))
    for s in busy:
        s.close()
    print(f"  the 200 busy requests: {ok} answered 200")
    time.sleep(1)
    after = probe(server.url)
    print(f"  after they finished: /health {after[0]}, POST /v1/echo {after[1]}")
    guard = server.guard()
    print(f"  guard: {json.dumps(guard['status'])}")
    server.stop()
    return {"name": "refusal", "settings": settings, "newcomers": codes, "sample": sample, "busy_ok": ok,
            "after": after, "guard": guard}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), sys.argv[3])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--hold", type=float, default=20.0)
    ap.add_argument("--phases", default="stock,guarded,refusal")
    ap.add_argument("--json", default="/tmp/idle_connections.json")
    args = ap.parse_args()
    raise_own_fd_limit()
    out = []
    for phase in args.phases.split(","):
        if phase == "stock":
            out.append(idle_phase("stock", {"connection_guard": False}, args.connections, args.clients, args.hold))
        elif phase == "guarded":
            out.append(idle_phase("guarded", {}, args.connections, args.clients, args.hold))
        elif phase == "refusal":
            out.append(refusal_phase())
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
