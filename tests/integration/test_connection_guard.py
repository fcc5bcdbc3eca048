"""The connection guard on real sockets: vLLM's own ``NoSignalServer`` (the class ``serve_http`` runs) serving a
trivial ASGI app in this process, no engine. Both ways it accepts connections are covered: uvicorn's asyncio server
(one API-server process) and vLLM's ``_accept``/``_connect`` (``peer_loads``: several API-server processes), with
uvicorn's httptools protocol (what ``auto`` picks where httptools is installed, as with vLLM) and its h11 one.

Idle and trickling connections get 408 and are closed after the header timeout; a request that takes longer than
the timeout is untouched; at the cap the oldest idle connection makes room for a newcomer, and when every
connection is busy the newcomer reads a 503 with ``Retry-After``."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn

from qwen_vllm_ext.config import Settings
from qwen_vllm_ext.gateway import connections as core
from qwen_vllm_ext.gateway import vllm_connections

launcher = pytest.importorskip("vllm.entrypoints.launchers.launcher")

RELEASE = threading.Event()  # /hold answers once set


async def app(scope, receive, send):
    assert scope["type"] == "http"
    if scope["path"] == "/slow":
        await asyncio.sleep(2.5)
    while scope["path"] == "/hold" and not RELEASE.is_set():
        await asyncio.sleep(0.02)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"path": scope["path"]}).encode()})


class Running:
    """A NoSignalServer on 127.0.0.1 in a thread with its own event loop."""

    def __init__(self, settings: Settings, multi: bool, http: str):
        # keep-alive far above any pause of a test: on a loaded CI host a kept-alive connection idle past uvicorn's
        # own timer is closed silently (a RemoteDisconnected on its next request), which is not the guard's doing
        config = uvicorn.Config(app, lifespan="off", log_level="warning", timeout_keep_alive=60, http=http)
        config.load()  # as serve_http does
        self.protocol = vllm_connections.guard_config(config, settings)
        assert self.protocol is not None
        self.server = launcher.NoSignalServer(config, peer_loads=([0], 0) if multi else None)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def status(self) -> dict:
        return self.protocol._qwen_status()

    def get(self, path: str = "/", timeout: float = 10) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def idle(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        RELEASE.set()
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(params=[(False, "auto"), (True, "auto"), (False, "h11")], ids=["one-api-server", "peer-loads", "h11"])
def serve(request):
    started = []
    multi, http = request.param

    def start(**values) -> Running:
        RELEASE.clear()
        server = Running(Settings.from_flat(values), multi=multi, http=http)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk


def error_of(raw: bytes) -> tuple[str, dict, dict]:
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    return lines[0], dict(line.split(": ", 1) for line in lines[1:]), json.loads(body)["error"]


def test_idle_and_trickling_connections_are_closed_after_the_header_timeout(serve):
    server = serve(header_timeout_s=2.5)   # 1.3 s of slack after the trickle's last line, for a loaded machine
    t0 = time.monotonic()
    silent = [server.idle() for _ in range(5)]
    trickle = server.idle()
    trickle.sendall(b"GET / HTTP/1.1\r\n")
    for _ in range(4):
        time.sleep(0.3)
        trickle.sendall(b"X-Slow: 1\r\n")  # never the blank line that ends the head
    assert server.status()["waiting_for_headers"] == 6
    assert server.get("/")[0] == 200  # a normal request meanwhile
    for sock in [*silent, trickle]:
        status, _, error = error_of(read_all(sock))
        assert status == "HTTP/1.1 408 Request Timeout" and error["code"] == "request_header_timeout"
    assert 2.4 <= time.monotonic() - t0 <= 10
    status = server.status()
    assert status["header_timeouts"] == 6 and status["waiting_for_headers"] == 0


def test_a_request_longer_than_the_timeout_and_a_kept_alive_connection_are_served(serve):
    server = serve(header_timeout_s=1.0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/slow")  # 2.5 s of work: the header timer is long cancelled
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"path": "/slow"}
    time.sleep(0.5)
    conn.request("GET", "/again")  # the same kept-alive connection
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"path": "/again"}
    conn.close()
    assert server.status()["header_timeouts"] == 0


def test_at_the_cap_the_oldest_idle_connection_makes_room(serve):
    server = serve(header_timeout_s=30, max_connections=4)
    idle = [server.idle() for _ in range(4)]
    time.sleep(core.EVICT_MIN_AGE_S + 0.2)
    assert server.get("/health")[0] == 200  # evicts idle[0]
    status, _, error = error_of(read_all(idle[0]))
    assert status.startswith("HTTP/1.1 408") and error["code"] == "idle_connection_closed"
    assert server.status()["evicted"] == 1
    for sock in idle[1:]:
        sock.close()


def test_with_every_connection_busy_a_newcomer_reads_a_503(serve):
    server = serve(header_timeout_s=30, max_connections=3)
    busy = []
    for _ in range(3):
        sock = server.idle()
        sock.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        busy.append(sock)
    deadline = time.monotonic() + 5
    while server.status()["waiting_for_headers"] or server.status()["open"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, headers, body = server.get("/v1/models")
    assert status == 503 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    RELEASE.set()
    for sock in busy:
        assert read_all(sock).startswith(b"HTTP/1.1 200")
        sock.close()
    deadline = time.monotonic() + 5
    while server.status()["open"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.get("/")[0] == 200
    assert server.status()["refused"] == 1


def test_install_guards_every_no_signal_server(monkeypatch):
    """The runtime patch: NoSignalServer's config gets the guarded protocol; the health route's status reports it."""
    cls = launcher.NoSignalServer
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    monkeypatch.setattr(cls, vllm_connections._MARK, False, raising=False)
    settings = Settings.from_flat({"header_timeout_s": 12, "max_connections": 100})
    assert vllm_connections.install(settings) is True
    assert vllm_connections.install(settings) is True  # idempotent
    config = uvicorn.Config(app, lifespan="off")
    config.load()
    launcher.NoSignalServer(config)
    assert config.http_protocol_class.__name__.startswith("Guarded")
    status = vllm_connections.status()
    assert status["cap"] == 100 and status["header_timeout_s"] == 12.0 and status["open"] == 0
    assert vllm_connections.install(Settings.from_flat({"connection_guard": False})) is False
