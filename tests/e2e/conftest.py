"""A real vLLM server started through the launcher, shared by the e2e tests of a session."""
import os
from pathlib import Path

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
    token-weighted scheduler on."""
    data_dir = tmp_path_factory.mktemp("data")
    # the token-weighted scheduler is off in the cpu profile (docs/scheduling.md); the shared server turns it on so that
    # the e2e tests cover it in the engine core
    server = Server(["--qwen-access-log", str(data_dir / "access.jsonl"), "--qwen-token-weighted-scheduler", "true"],
                    tmp_path_factory.mktemp("logs") / "server.log", data_dir=data_dir)
    server.wait_healthy()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(demo_server):
    import openai

    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
