"""The e2e tests' servers: the launcher with test conventions (``Server``), the servers several modules start
(``gateway_server``, ``round_robin_router``), and the start-ups overlapped across modules (``early``,
``early_then_stopped`` and their look-ahead, driven by tests/e2e/conftest.py's fixtures)."""
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from qwen_vllm_ext.bench.server import ServeProcess, ServerStartError, free_port_block
from qwen_vllm_ext.fleet.plan import ROUTER_FLAGS

from ..helpers.gateway import ADMIN

STARTUP_TIMEOUT_S = int(os.environ.get("QWEN_VLLM_EXT_TEST_STARTUP_TIMEOUT", "600"))


# Test servers run vLLM's model worker inside the engine-core process (vLLM's "uni" executor, which the CPU build
# takes when VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of in a third process: one vLLM import less per start-up, the
# largest CPU cost of the e2e suite (a demo server: 21.8 CPU-s to start instead of 31.8, measured by
# benchmarks/investigations/server_start_cost.py; docs/benchmarks.md, "The test suite's time"). The API server and
# the engine core stay separate processes, as shipped. The servers whose tests cover code that runs in vLLM's worker
# process (the session's demo server, the hybrid and MTP demos, the source-patched vLLM, data parallel) keep the
# shipped layout, a worker process of their own: shipped_layout=True, or SHIPPED_LAYOUT in a hand-made environment.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# ... with one OpenMP thread, as vLLM gives its CPU worker process on this two-core machine (one core bound to it,
# one reserved). In the engine core nothing sets it: vLLM's CPU worker blocks torch.set_num_threads once it has
# started, so its "reducing Torch threads to 1 for serving" is skipped and torch keeps a thread per core, whose
# spin-waits between ops starve every other process of the suite. Measured with two busy loops beside it, the hybrid
# fleet test took 116.6 s (190 CPU-s) with two threads and 27.9 s (86 CPU-s) with one (docs/benchmarks.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
SHIPPED_LAYOUT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


class Server(ServeProcess):
    """The shared launcher (qwen_vllm_ext.bench.server) with test conventions: ``--qwen-data-dir`` first when
    given, the worker in the engine core unless ``shipped_layout`` (above), and a start-up failure fails the test
    with the server's log tail."""

    def __init__(self, argv, log_path: Path, env=None, data_dir: Path | None = None, shipped_layout: bool = False):
        self.data_dir = data_dir
        if data_dir is not None:
            argv = ["--qwen-data-dir", str(data_dir), *argv]
        if shipped_layout:
            env = {**(os.environ if env is None else env), **SHIPPED_LAYOUT}
        super().__init__(argv, log_path, env=env)

    def wait_healthy(self, timeout=STARTUP_TIMEOUT_S):
        try:
            return super().wait_healthy(timeout)
        except ServerStartError as exc:
            pytest.fail(str(exc))


def gateway_server(tmp_path_factory, name, extra=()) -> Server:
    """A gateway server (started, not waited for); its data dir is ``server.data_dir``."""
    return Server(["--qwen-gateway", "true", "--qwen-admin-key", ADMIN, "--qwen-max-body-bytes", "65536",
                   "--qwen-spike-min-units", "400", *extra], tmp_path_factory.mktemp("logs") / f"{name}.log",
                  data_dir=tmp_path_factory.mktemp(name))


@contextlib.contextmanager
def round_robin_router(replica_urls: list[str], log_path):
    """vllm-router with the round_robin policy over ``replica_urls`` (what conversation affinity is compared with);
    yields its base URL and stops it on exit."""
    port = free_port_block(2)
    with open(log_path, "wb") as log:
        rr = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "vllm-router"), "--port", str(port),
                               "--prometheus-port", str(port + 1), "--worker-urls", *replica_urls,
                               "--policy", "round_robin", *ROUTER_FLAGS], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not _ready(port):
                assert time.monotonic() < deadline and rr.poll() is None, "the round_robin router did not start"
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}"
        finally:
            rr.terminate()
            rr.wait(30)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---- start-ups overlapped across modules (issue 37) ------------------------------------------------------------------
# Test servers take 1 GiB of KV cache instead of the CPU profile's 2 (the tiny demo models use a sliver of either):
# more of them fit in memory at once, which the overlapped start-ups below need.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# A server takes ~25 s to start, nearly all of it three processes importing vLLM one after the other: one core busy,
# the other idle. A module that defines
#     def start_early(tmp_path_factory) -> dict   # what it starts, each with stop(); nothing waited for
#     EARLY_GB = ...                              # the memory that takes, in GiB (an upper bound)
# has start_early called while a module before it runs (at most LOOKAHEAD modules before; one module ahead at a
# time), at the first test where the memory allows. Memory is counted from what modules declare, because a server
# just started has not taken its memory yet: the session's demo server, the running module's EARLY_GB and LATE_GB
# (what it starts other than through start_early), those of the modules in between, and what was started early
# must fit in the machine's memory less a reserve (the other xdist worker, pytest itself); and the memory free now
# must hold the new servers plus a margin. The module's fixtures take the result with early(request,
# start_early), which calls start_early itself when nothing was started ahead (the module run alone, or memory
# short). What was started early but never taken (its tests deselected) is stopped at the end of the session
# (stop_untaken). tests/e2e/conftest.py calls look_ahead before each test and stop_untaken at the end.
EARLY_MARGIN_GB = 2.0  # over the new servers' EARLY_GB, in the memory free now
SESSION_GB = 3.5  # the session's demo server (a demo server with 1 GiB of KV cache takes ~2.9)
EARLY_RESERVE_GB = 5.0
LOOKAHEAD = 2
_early: dict[str, dict] = {}
_upcoming: dict[str, list] = {}
_taken: set[str] = set()


def timeline(event: str) -> None:
    """One line (seconds since the epoch, memory available, the event) in the file named by
    QWEN_VLLM_EXT_TEST_TIMELINE, when set: where the e2e worker's time goes (modules, early start-ups)."""
    path = os.environ.get("QWEN_VLLM_EXT_TEST_TIMELINE")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.1f} {psutil.virtual_memory().available / 2**30:.1f} {event}\n")


def early(request, start_early) -> dict:
    """What the calling module's ``start_early`` started ahead of the module, or starts now."""
    name = request.module.__name__
    _taken.add(name)
    started = _early.pop(name, None)
    timeline(f"{name} takes its servers ({'started early' if started is not None else 'starting now'})")
    factory = request.getfixturevalue("tmp_path_factory")
    if started is None:
        started = start_early(factory)
    # the next module's servers may start now, while these become healthy (memory is counted from what the modules
    # declare, so servers still loading are counted in full)
    items = request.session.items
    look_ahead(items, next(i for i in items if i.module is request.module), factory)
    return started


def stop_all(started: dict) -> None:
    """Stop what a ``start_early`` started: the servers first, then what they use (a Redis: stopped, its directory
    removed)."""
    for proc in started.values():
        if not hasattr(proc, "cleanup"):
            proc.stop()
    for proc in started.values():
        if hasattr(proc, "cleanup"):
            proc.cleanup()


def early_then_stopped(request, start_early):
    """A module fixture's body (``yield from``): what ``early`` gives, stopped with ``stop_all`` after the module."""
    started = early(request, start_early)
    yield started
    stop_all(started)


def _modules_after(items, item) -> list:
    out = []
    for i in items[items.index(item) + 1:]:
        if i.module is not item.module and (not out or i.module is not out[-1]):
            out.append(i.module)
            if len(out) == LOOKAHEAD:
                break
    return out


def _gb(module) -> float:
    return getattr(module, "EARLY_GB", 0) + getattr(module, "LATE_GB", 0)


def look_ahead(items, item, tmp_path_factory) -> None:
    """Start the first of the modules after ``item``'s that has servers to start early, if the memory allows."""
    module = item.module
    if _early:  # one module ahead at a time
        return
    if module.__name__ not in _upcoming:
        _upcoming[module.__name__] = _modules_after(items, item)
    committed = SESSION_GB + _gb(module)
    for nxt in _upcoming[module.__name__]:
        if hasattr(nxt, "start_early") and nxt.__name__ not in _taken:
            memory = psutil.virtual_memory()
            if (committed + nxt.EARLY_GB <= memory.total / 2**30 - EARLY_RESERVE_GB
                    and memory.available / 2**30 >= nxt.EARLY_GB + EARLY_MARGIN_GB):
                timeline(f"early start {nxt.__name__} (during {module.__name__})")
                _early[nxt.__name__] = nxt.start_early(tmp_path_factory)
            return
        committed += _gb(nxt)


def stop_untaken() -> None:
    """Stop what was started early but never taken by its module (its tests deselected)."""
    for started in _early.values():
        stop_all(started)
    _early.clear()
