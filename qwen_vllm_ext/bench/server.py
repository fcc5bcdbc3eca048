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


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 600.0, poll_s: float = 1.0) -> float:
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
