"""Starting, watching and stopping the fleet's processes (Redis, replicas, router).

* Every child runs in its own process group (so a stop reaches a replica's engine core and workers) and asks the
  kernel for SIGTERM when the fleet command dies (``PR_SET_PDEATHSIG``): killing the fleet command, even with
  SIGKILL, leaves nothing running.
* Start order: Redis (local, or the given URL answering PING), all replicas at once (each one's ``/health`` is
  waited for in parallel; one that exits or never becomes healthy fails the start with its log tail), then the
  router (it waits for the workers itself). Any failure stops everything already started.
* While running, a replica, the router or the local Redis that exits is started again (with backoff); the router's
  health check takes a dead replica out of rotation within about two seconds and puts it back once it answers.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from ..store.redis import connect, safe_url
from .plan import FleetError, FleetPlan, Proc

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _ready(proc: Proc, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(proc.url + proc.ready_path, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def preflight(plan: FleetPlan) -> None:
    """Binaries installed, ports free, an external Redis reachable: FleetError otherwise (nothing started)."""
    router_bin = plan.router.argv[0]
    if not (os.path.isfile(router_bin) or shutil.which(router_bin)):
        raise FleetError(f"vllm-router is not installed ({router_bin} not found): "
                         "pip install 'qwen-vllm-ext[fleet]' (or pip install vllm-router==0.1.17)")
    if plan.redis is not None and not (os.path.isfile(plan.redis.argv[0]) or shutil.which(plan.redis.argv[0])):
        raise FleetError("redis-server is not installed: apt-get install redis-server, or pass --redis-url "
                         "redis://HOST:6379/0 for an existing Redis")
    for name, port in plan.ports:
        host = plan.config.host if name == "router" else "127.0.0.1"
        if port_in_use(port, host):
            raise FleetError(f"port {port} ({name}) is in use on {host}: stop what listens there or choose another "
                             f"--port (the fleet uses {plan.config.port}..{plan.config.port + plan.config.replicas + 2})")
    if plan.redis is None:
        connect(plan.redis_url, FleetError, "server (--redis-url)", socket_timeout_s=3.0)


class Child:
    """One running process of the plan."""

    def __init__(self, proc: Proc, environ: dict):
        self.spec = proc
        self.environ = environ
        self.popen: subprocess.Popen | None = None
        self.restarts = 0
        self.next_restart = 0.0

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.spec.log), exist_ok=True)
        with open(self.spec.log, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.spec.command_line()}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(list(self.spec.argv), env={**self.environ, **self.spec.env},
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> bool:
        if self.popen is None:
            return True
        try:
            self.popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


class Fleet:
    """Runs a :class:`FleetPlan`: :meth:`start`, :meth:`supervise` until :meth:`request_stop`, :meth:`stop`."""

    def __init__(self, plan: FleetPlan, environ: dict | None = None, say=None):
        self.plan = plan
        environ = dict(os.environ if environ is None else environ)
        self.children = {p.name: Child(p, environ) for p in plan.processes}
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._stop = threading.Event()

    # ---- start -----------------------------------------------------------------------------------
    def start(self, timeout_s: float = 900.0) -> None:
        preflight(self.plan)
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        plan = self.plan
        if plan.redis is not None:
            os.makedirs(plan.redis.argv[plan.redis.argv.index("--dir") + 1], exist_ok=True)
            self._launch("redis")
            self._wait_redis(15.0)
        for r in plan.replicas:
            self._launch(r.name)
        self._wait_healthy([r.name for r in plan.replicas], timeout_s)
        self._launch("router")
        self._wait_healthy(["router"], 120.0)

    def _launch(self, name: str) -> None:
        child = self.children[name]
        child.start()
        self.say(f"fleet: started {name} (pid {child.pid}; log {child.spec.log})")

    def _wait_redis(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                connect(self.plan.redis_url, FleetError, "server", socket_timeout_s=1.0)
                return
            except FleetError as exc:
                child = self.children["redis"]
                if not child.alive() or time.monotonic() > deadline:
                    raise FleetError(f"the local redis-server did not start ({exc}); log {child.spec.log}:\n"
                                     f"{log_tail(child.spec.log)}") from None
                time.sleep(0.1)

    def _wait_healthy(self, names: list[str], timeout_s: float) -> None:
        pending = set(names)
        deadline = time.monotonic() + timeout_s
        while pending:
            for name in sorted(pending):
                child = self.children[name]
                if not child.alive():
                    raise FleetError(f"{name} exited with status {child.popen.returncode} before becoming healthy; "
                                     f"log {child.spec.log}:\n{log_tail(child.spec.log)}")
                if _ready(child.spec):
                    pending.discard(name)
                    self.say(f"fleet: {name} healthy")
            if pending and time.monotonic() > deadline:
                name = sorted(pending)[0]
                child = self.children[name]
                raise FleetError(f"{name} not healthy after {timeout_s:.0f}s; log {child.spec.log}:\n"
                                 f"{log_tail(child.spec.log)}")
            if pending:
                if self._stop.wait(1.0):
                    raise FleetError("stopped while starting")

    def summary(self) -> str:
        plan = self.plan
        lines = [f"fleet ready: {plan.url}  (vllm-router, policy {plan.config.policy}; "
                 f"conversation affinity by the x-session-id header)"]
        for r in plan.replicas:
            c = self.children[r.name]
            lines.append(f"  {r.name}: {r.url}  pid {c.pid}  {r.placement}  log {r.log}")
        where = f"local, pid {self.children['redis'].pid}, AOF in {plan.redis.argv[plan.redis.argv.index('--dir') + 1]}" \
            if plan.redis else "external"
        lines.append(f"  redis: {safe_url(plan.redis_url)}  ({where})")
        lines.append(f"  router metrics: http://127.0.0.1:{plan.ports[-2][1]}/metrics")
        return "\n".join(lines)

    # ---- run -------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def supervise(self, poll_s: float = 1.0) -> None:
        """Restart any process that exits (backoff 1 s doubling to 60 s) until :meth:`request_stop`."""
        while not self._stop.wait(poll_s):
            now = time.monotonic()
            for name, child in self.children.items():
                if child.alive():
                    continue
                if child.next_restart == 0.0:
                    delay = min(60.0, 2.0 ** child.restarts)
                    child.next_restart = now + delay
                    self.say(f"fleet: {name} exited with status {child.popen.returncode}; restarting in "
                             f"{delay:.0f}s (log {child.spec.log})")
                elif now >= child.next_restart:
                    child.restarts += 1
                    child.next_restart = 0.0
                    child.signal(signal.SIGKILL)  # what is left of its process group
                    self._launch(name)

    # ---- stop ------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 30.0) -> None:
        """Router first (no new requests), then replicas, then the local Redis (it flushes its AOF on SIGTERM);
        SIGKILL for any process group still there after ``grace_s``. Idempotent."""
        order = ["router", *[r.name for r in self.plan.replicas], "redis"]
        for group in (order[:1], order[1:-1], order[-1:]):
            children = [self.children[n] for n in group if n in self.children]
            for c in children:
                if c.alive():
                    c.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in children:
                c.wait(max(0.0, deadline - time.monotonic()))
            for c in children:
                c.signal(signal.SIGKILL)  # stragglers of the group (engine cores, workers)
                c.wait(5.0)
