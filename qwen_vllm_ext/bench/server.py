"""A ``python -m qwen_vllm_ext.serve`` subprocess on a free loopback port — the one server launcher of the
benchmarks, TokenStorm's comparison with ``vllm bench serve`` and the end-to-end tests.

The server runs in its own process group (``start_new_session``) with its output in a log file;
:meth:`ServeProcess.wait_healthy` polls ``GET /health`` and fails with the log's tail when the server exits or
times out; :meth:`ServeProcess.stop` sends SIGTERM then SIGKILL to the whole group, so no engine core or worker
outlives it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path, n: int) -> str:
    """The last ``n`` lines of a log file ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class ServerStartError(RuntimeError):
    """The server exited, or did not answer ``/health``, before becoming ready (the message has the log tail)."""


class ServeProcess:
    """``python -m <module> --host 127.0.0.1 --port <free> *argv`` (started at construction); ``module`` is the
    launcher, or ``vllm.entrypoints.openai.api_server`` for plain vLLM."""

    def __init__(self, argv: Sequence[str], log_path: str | os.PathLike, *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, label: str = "the server",
                 module: str = "qwen_vllm_ext.serve") -> None:
        self.label = label
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port), *argv],
            cwd=cwd, env=dict(env) if env is not None else None, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, n: int = 120) -> str:
        return log_tail(self.log_path, n)

    def metric(self, name: str) -> float | None:
        """``name``'s value on ``GET /metrics``, summed over its label sets; None when the server has no such
        series."""
        return self.metrics([name])[name]

    def metrics(self, names: Sequence[str]) -> dict[str, float | None]:
        """:meth:`metric` of each name, from one scrape."""
        from qwen_vllm_ext.usage.reconcile import parse_counters

        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        sums = parse_counters(text, names)
        return {name: sums[name] if name in text else None for name in names}

    def wait_healthy(self, timeout: float = 600.0, poll_s: float = 0.25) -> float:
        """Seconds until ``GET /health`` answered 200; raises :class:`ServerStartError` (and stops the server on
        a timeout) otherwise."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.label} exited with {self.proc.returncode} before becoming healthy "
                                       f"(log {self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(poll_s)
        self.stop()
        raise ServerStartError(f"{self.label} not healthy after {timeout:.0f}s (log {self.log_path}):\n"
                               f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to the server's whole process group; idempotent."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # the group may outlive its leader (engine core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()


def _outside_ephemeral_range(n: int) -> tuple[int, int]:
    """Ports to draw a fleet's block from: below the kernel's ephemeral range. A fleet binds its router's ports
    minutes after the check (replicas start first); a block inside the ephemeral range can be taken meanwhile by
    any outgoing connection or ``bind(0)`` (vLLM's own internal ports), and the router then dies with "Address
    already in use"."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    if ephemeral_low - 10000 > 4 * n:
        return 10000, ephemeral_low
    return 20000, 60000


def free_port_block(n: int, tries: int = 200) -> int:
    """The first of ``n`` consecutive free loopback ports (a fleet uses port .. port + replicas + 2)."""
    import random

    from ..fleet.processes import port_in_use  # the fleet's own preflight check: a block it accepts

    low, high = _outside_ephemeral_range(n)
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - n)
        if not any(port_in_use(port) for port in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free loopback ports found")


class FleetProcess:
    """``python -m qwen_vllm_ext.fleet --replicas N`` (router + replicas [+ local Redis]) on a free block of loopback
    ports, for the end-to-end tests and benchmarks. ``fleet_args`` go to the fleet command, ``serve_args`` (after
    ``--``) to every replica. :meth:`stop` sends SIGTERM to the fleet command only: stopping its children is the
    fleet's job (the tests check it did)."""

    def __init__(self, replicas: int, log_path: str | os.PathLike, data_dir: str | os.PathLike, *,
                 fleet_args: Sequence[str] = (), serve_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> None:
        self.replicas = replicas
        self.data_dir = Path(data_dir)
        self.port = free_port_block(replicas + 3)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.replica_urls = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(replicas)]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qwen_vllm_ext.fleet", "--replicas", str(replicas), "--port", str(self.port),
             "--data-dir", str(data_dir), *fleet_args, "--", *serve_args],
            cwd=cwd, env=dict(env) if env is not None else None, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, n: int = 80) -> str:
        return log_tail(self.log_path, n)

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Seconds until the fleet printed ``fleet ready`` (router and every replica healthy)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise ServerStartError(f"the fleet command exited with {self.proc.returncode} "
                                       f"(log {self.log_path}):\n{self.log_tail()}")
            with open(self.log_path, errors="replace") as f:
                if "fleet ready:" in f.read():
                    return time.monotonic() - start
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(f"the fleet was not ready after {timeout:.0f}s (log {self.log_path}):\n"
                               f"{self.log_tail()}")

    def pids(self) -> set[int]:
        """The fleet command and every process below it (replicas, engine cores, router, local Redis)."""
        import psutil

        try:
            parent = psutil.Process(self.proc.pid)
            return {self.proc.pid, *(c.pid for c in parent.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM to the fleet command; its exit status (None if it had to be killed). Idempotent."""
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                code = None
        if not self._log.closed:
            self._log.close()
        return code


def alive(pids) -> list[int]:
    """The processes of ``pids`` still running (zombies count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
