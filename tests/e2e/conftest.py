"""A real vLLM server started through the launcher, shared by the e2e tests of a session; start-ups overlapped
across modules."""
import os
from pathlib import Path

import psutil
import pytest

from qwen_vllm_ext.bench.server import ServeProcess, ServerStartError

STARTUP_TIMEOUT_S = int(os.environ.get("QWEN_VLLM_EXT_TEST_STARTUP_TIMEOUT", "600"))


class Server(ServeProcess):
    """The shared launcher (qwen_vllm_ext.bench.server) with test conventions: ``--qwen-data-dir`` first when
    given, and a start-up failure fails the test with the server's log tail."""

    def __init__(self, argv, log_path: Path, env=None, data_dir: Path | None = None):
        self.data_dir = data_dir
        if data_dir is not None:
            argv = ["--qwen-data-dir", str(data_dir), *argv]
        super().__init__(argv, log_path, env=env)

    def wait_healthy(self, timeout=STARTUP_TIMEOUT_S):
        try:
            return super().wait_healthy(timeout)
        except ServerStartError as exc:
            pytest.fail(str(exc))


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`python -m qwen_vllm_ext.serve` on the demo model (no --model, no GPU) on a free loopback port, with the
    token-weighted scheduler on behind its overload gate (``auto``)."""
    data_dir = tmp_path_factory.mktemp("data")
    # the cpu profile's default scheduler mode is in docs/scheduling.md; the shared server runs auto so that the e2e
    # tests cover the token-weighted class and its gate in the engine core
    server = Server(["--qwen-access-log", str(data_dir / "access.jsonl"), "--qwen-token-weighted-scheduler", "auto"],
                    tmp_path_factory.mktemp("logs") / "server.log", data_dir=data_dir)
    server.wait_healthy()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(demo_server):
    import openai

    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


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
# short). What was started early but never taken (its tests deselected) is stopped at the end of the session.
EARLY_MARGIN_GB = 2.0  # over the new servers' EARLY_GB, in the memory free now
SESSION_GB = 3.5  # the session's demo server (a demo server with 1 GiB of KV cache takes ~2.9)
EARLY_RESERVE_GB = 5.0
LOOKAHEAD = 2
_early: dict[str, dict] = {}
_upcoming: dict[str, list] = {}
_taken: set[str] = set()


# The e2e modules' order: a module that needs much memory (EARLY_GB/LATE_GB of 10 or so) follows one that needs
# little, so that its servers can start while that one runs; modules not named here run last, in file order.
E2E_ORDER = ["test_count_chat_vllm", "test_fleet", "test_hybrid_demo", "test_mtp_demo", "test_gateway",
             "test_monitoring", "test_usage_ledger", "test_patched_vllm", "test_doctor", "test_kv_reuse",
             "test_openrouter_provider", "test_token_storm", "test_hybrid_fleet", "test_data_parallel",
             "test_count_endpoint", "test_demo_server", "test_gpu_check_smoke"]


def pytest_collection_modifyitems(items):
    """The e2e tests in E2E_ORDER's module order (each module's tests in file order), where they were."""
    where = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/e2e/")]
    rank = {name: n for n, name in enumerate(E2E_ORDER)}

    def key(item):
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        return rank.get(module, len(rank)), module

    ordered = sorted((items[i] for i in where), key=key)  # stable: file order within a module
    for i, item in zip(where, ordered):
        items[i] = item


def early(request, start_early) -> dict:
    """What the calling module's ``start_early`` started ahead of the module, or starts now."""
    name = request.module.__name__
    _taken.add(name)
    started = _early.pop(name, None)
    return started if started is not None else start_early(request.getfixturevalue("tmp_path_factory"))


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


def _look_ahead(items, item, tmp_path_factory) -> None:
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
                _early[nxt.__name__] = nxt.start_early(tmp_path_factory)
            return
        committed += _gb(nxt)


@pytest.fixture(autouse=True)
def _start_a_later_module_early(request, tmp_path_factory):
    """Before each test (after its module fixtures)."""
    _look_ahead(request.session.items, request.node, tmp_path_factory)


def _nice_the_other_workers() -> None:
    """The e2e tests are the suite's critical path; the other worker's tests (a few minutes of CPU) should take what
    they leave idle, not slow them down: nice 19 for the other workers and everything they started."""
    me = psutil.Process()
    for worker in me.parent().children():
        if worker.pid != me.pid:
            for proc in (worker, *worker.children(recursive=True)):
                try:
                    proc.nice(19)
                except psutil.Error:
                    pass


@pytest.fixture(scope="session", autouse=True)
def _e2e_session(request, tmp_path_factory):
    """Under xdist: checks that this is the only worker running e2e tests (tests/conftest.py puts them all on one:
    two at once would need twice the memory) and nices the other. Then looks ahead from the first e2e module (before
    the session's demo server starts: an autouse fixture comes first); at the end, stops what no module took."""
    import fcntl

    lock = None
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base temp dirs share a parent
        lock = open(tmp_path_factory.getbasetemp().parent / "e2e.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail("another pytest worker is running e2e tests at the same time (tests/conftest.py's "
                        "scheduler keeps them on one)")
        _nice_the_other_workers()
    first = next(item for item in request.session.items if item.nodeid.startswith("tests/e2e/"))
    _look_ahead(request.session.items, first, tmp_path_factory)
    yield
    for started in _early.values():  # started early, never taken
        stop_all(started)
    _early.clear()
    if lock is not None:
        lock.close()
