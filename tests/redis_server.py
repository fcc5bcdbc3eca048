"""A real, throw-away ``redis-server`` for tests (no mocks).

``RedisServer()`` picks a free loopback port and a temporary directory (under /dev/shm where it exists), starts
``redis-server --save '' --appendonly yes --appendfsync always --dir TMP --port P --bind 127.0.0.1``, waits
until it answers PING and stops it on :meth:`stop`. :meth:`restart` keeps port and directory, so the AOF
is reloaded. A missing ``redis-server`` binary raises (tests must fail loudly, never skip).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from qwen_vllm_ext.bench.server import free_port  # re-exported: the tests' one free-port helper


def ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, directory: str | None = None, port: int | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server): the ledger tests "
                               "need a real Redis server")
        # tmpfs where there is one: the AOF is still written before every reply (so a killed server loses
        # nothing), but a disk busy with other tests' files cannot stall ``appendfsync always``
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.dir = directory or tempfile.mkdtemp(prefix="qve-redis-", dir=shm)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> "RedisServer":
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", self.dir,
             "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT,
            # its own session, so its own scheduler autogroup: in the suite's unit worker (nice 19, one autogroup
            # with the e2e worker, beside an autogroup per vLLM server) it was starved past a client's timeout
            start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = open(os.path.join(self.dir, "redis.log"), errors="replace").read()[-2000:]
                raise RuntimeError(f"redis-server did not come up on port {self.port}:\n{tail}")
            time.sleep(0.02)
        return self

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (clean shutdown) or SIGKILL (crash); waits for the process to exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, kill: bool = False) -> "RedisServer":
        self.stop(kill=kill)
        return self.start()

    def flush(self) -> None:
        """Empty every database, as a test's starting point. FLUSHALL ASYNC (the keys go at once, their memory is
        freed in the background) from a client that waits up to 60 s (redis-py's default of 5 s once ran out on a
        plain FLUSHALL in the suite, under the e2e servers' load)."""
        import redis

        with redis.Redis.from_url(self.url, socket_timeout=60) as r:
            r.flushall(asynchronous=True)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
