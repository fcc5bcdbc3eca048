"""A real vLLM server started through the launcher, shared by the e2e tests of a session."""
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ..redis_server import free_port

STARTUP_TIMEOUT_S = int(os.environ.get("QWEN_VLLM_EXT_TEST_STARTUP_TIMEOUT", "600"))


class Server:
    def __init__(self, argv, log_path: Path, env=None, data_dir: Path | None = None):
        self.data_dir = data_dir
        if data_dir is not None:
            argv = ["--qwen-data-dir", str(data_dir), *argv]
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qwen_vllm_ext.serve", "--host", "127.0.0.1", "--port", str(self.port), *argv],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def log_tail(self, n=120) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, timeout=STARTUP_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before becoming healthy:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`python -m qwen_vllm_ext.serve` on the demo model (no --model, no GPU) on a free loopback port."""
    data_dir = tmp_path_factory.mktemp("data")
    server = Server(["--qwen-access-log", str(data_dir / "access.jsonl")], tmp_path_factory.mktemp("logs") / "server.log",
                    data_dir=data_dir)
    server.wait_healthy()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(demo_server):
    import openai

    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
