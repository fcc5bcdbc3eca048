"""The suite's shared fixtures and hooks (shared test data and clients: tests/helpers/)."""
import stat

import pytest

from .redis_server import RedisServer


@pytest.fixture
def fake_nvidia_smi(tmp_path):
    """Factory: write an executable that prints the given nvidia-smi CSV lines; returns its path."""

    def make(*lines: str, exit_code: int = 0) -> str:
        path = tmp_path / "nvidia-smi"
        body = "".join(f"echo '{line}'\n" for line in lines)
        path.write_text(f"#!/bin/sh\n{body}exit {exit_code}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return str(path)

    return make


@pytest.fixture(scope="module")
def redis_server():
    """A real, throw-away redis-server (raises, never skips, when the binary is missing)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory):
    """The generated official Qwen3 tokenizer files (the reference for HF ``tokenizers``), built once."""
    from qwen_v3_calculator.hf_export import write_tokenizer_files

    d = tmp_path_factory.mktemp("qwen3-tok")
    from qwen_vllm_ext.common.assets import chat_template

    write_tokenizer_files(d, "qwen3", chat_template("qwen3"))
    return d


@pytest.fixture(scope="session")
def qwen36_tokenizer_dir(tmp_path_factory):
    """The Qwen3.5/3.6 tokenizer files hf_export writes from the bundled ranks (HF ``tokenizers``' reference for
    the ``qwen3.6`` vocabulary), with the official Qwen3.5 chat template, built once."""
    from qwen_v3_calculator.hf_export import write_tokenizer_files

    d = tmp_path_factory.mktemp("qwen36-tok")
    from qwen_vllm_ext.common.assets import chat_template

    write_tokenizer_files(d, "qwen3.6", chat_template("qwen3.5"))
    return d


# ---- two workers (pyproject's addopts: pytest-xdist, -n 2) -----------------------------------------------------------
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with two kinds of scope: every end-to-end test is one scope, run by one worker in the
    module order of tests/e2e/conftest.py's E2E_ORDER (their servers take gigabytes of memory and most of a core
    each, so they run one module at a time as before); every other module is a scope of its own (its module fixtures
    built once), run by the other worker meanwhile."""
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "e2e" if path.startswith("tests/e2e/") else path

    return EndToEndOnOneWorker(config, log)


# ---- time per test module (issue 37: the suite's budget is tracked per module) ---------------------------------------
_MODULE_SECONDS: dict[str, float] = {}
_WORKER_SPAN: dict[str, list] = {}  # worker -> [first start, last stop, seconds in tests, seconds in e2e tests]


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration  # setup + call + teardown
    node = getattr(report, "node", None)  # xdist's worker, on the controller
    worker = getattr(node, "gateway", None) and node.gateway.id or "main"
    span = _WORKER_SPAN.setdefault(worker, [report.start, report.stop, 0.0, 0.0])
    span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)
    span[2] += report.duration
    span[3] += report.duration if module.startswith("tests/e2e/") else 0.0


def pytest_terminal_summary(terminalreporter):
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.write_sep("=", f"seconds per test module (setup + call + teardown; {total:.0f} s in all)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
    # the critical path: which worker ran last, and for how long (the suite's wall time is the longest span)
    origin = min(span[0] for span in _WORKER_SPAN.values())
    for worker, (first, last, busy, e2e) in sorted(_WORKER_SPAN.items()):
        terminalreporter.write_line(f"worker {worker}: tests from {first - origin:6.0f} s to {last - origin:6.0f} s, "
                                    f"{busy:6.0f} s in tests ({e2e:.0f} s end-to-end)")
