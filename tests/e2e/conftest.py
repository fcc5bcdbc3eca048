"""A real vLLM server started through the launcher, shared by the e2e tests of a session; start-ups overlapped
across modules (the helpers: tests/e2e/servers.py)."""
import os

import psutil
import pytest

from .servers import Server, look_ahead, stop_untaken, timeline


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`python -m qwen_vllm_ext.serve` on the demo model (no --model, no GPU) on a free loopback port, with the
    token-weighted scheduler on behind its overload gate (``auto``)."""
    data_dir = tmp_path_factory.mktemp("data")
    # the cpu profile's default scheduler mode is in docs/scheduling.md; the shared server runs auto so that the e2e
    # tests cover the token-weighted class and its gate in the engine core
    server = Server(["--qwen-access-log", str(data_dir / "access.jsonl"), "--qwen-token-weighted-scheduler", "auto"],
                    tmp_path_factory.mktemp("logs") / "server.log", data_dir=data_dir, shipped_layout=True)
    server.wait_healthy()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(demo_server):
    import openai

    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


# The e2e modules' order. A module's servers start early, while the module before it runs, only when the memory the
# two declare fits (tests/e2e/servers.py: at most 15 GiB of EARLY_GB/LATE_GB together on this 24 GiB machine), so
# every module that needs 10 GiB or so (fleet, gateway, usage_ledger, doctor) sits between two that need 3.5 or less,
# and the modules that need 6.5-7 follow one another; the host module should last as long as the next one's
# start-ups (a minute for three servers). Modules not named here run last, in file order.
E2E_ORDER = ["test_count_chat_vllm", "test_fleet", "test_patched_vllm", "test_gateway", "test_hybrid_demo",
             "test_usage_ledger", "test_monitoring", "test_doctor", "test_kv_reuse", "test_mtp_demo",
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


@pytest.fixture(autouse=True)
def _start_a_later_module_early(request, tmp_path_factory):
    """Before each test (after its module fixtures)."""
    timeline(f"test {request.node.nodeid}")
    look_ahead(request.session.items, request.node, tmp_path_factory)


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
    look_ahead(request.session.items, first, tmp_path_factory)
    yield
    stop_untaken()
    if lock is not None:
        lock.close()
