"""E2E: plain vLLM (``python -m vllm.entrypoints.openai.api_server``, no launcher) started from a source-patched
COPY of the installed vLLM, with qwen-vllm-ext's plugin NOT loaded (``VLLM_PLUGINS`` names every discovered plugin
but ours). The patched server shows the extension's behaviour all the same: per-chunk usage with cached tokens and
billing, the token-weighted scheduler, the usage ledger and the KV-reuse template. Then: with strict_patches, the
launcher refuses to start on a vLLM whose wrapped code differs from the declared fingerprints.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import entry_points

import httpx
import pytest

from qwen_vllm_ext import plugin
from qwen_vllm_ext.demo import SERVED_NAME, ensure_demo_model
from qwen_vllm_ext.sourcepatch import core
from qwen_vllm_ext.bench.server import ServeProcess
from qwen_vllm_ext.usage.ledger import open_store

from ..redis_server import free_port
from .servers import SHIPPED_LAYOUT, Server, early_then_stopped

LONG_PROMPT = " ".join(f"token{i}" for i in range(300))  # > 2 KV blocks of 128 tokens (CPU prefix caching)


def _env(overlay_parent, **settings) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_VLLM_EXT_") and k != "VLLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(overlay_parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["VLLM_PLUGINS"] = ",".join(ep.name for ep in entry_points(group="vllm.general_plugins")
                                   if ep.name != plugin.PLUGIN_NAME)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(SHIPPED_LAYOUT)  # plain vLLM as shipped: a worker process of its own (tests/e2e/servers.py)
    env.update({f"QWEN_VLLM_EXT_{k.upper()}": str(v) for k, v in settings.items()})
    return env


class PlainVllmServer(Server):
    """vLLM's own OpenAI server entry point (what a team that cannot load plugins runs)."""

    def __init__(self, argv, log_path, env):
        self.data_dir = None
        ServeProcess.__init__(self, argv, log_path, env=env, module="vllm.entrypoints.openai.api_server")


_RUNNING: list[Server] = []  # at most one server of this module at a time
# one server at a time (tests/e2e/servers.py): the plain server on the patched copy, started early, then the launcher
# on it, started in its test once the plain server has stopped
EARLY_GB = 3.5


def start_early(tmp_path_factory) -> dict:
    """A symlink overlay of the installed vLLM with every source patch applied (through the CLI), and plain vLLM
    started from it (not waited for); the overlay is ``server.overlay``."""
    overlay = core.overlay(core.find_vllm(), tmp_path_factory.mktemp("patched") / "site")
    applied = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.patches", "apply", "--vllm-path", str(overlay)],
                             capture_output=True, text=True, timeout=120)
    assert applied.returncode == 0, applied.stderr
    base = tmp_path_factory.mktemp("plain")
    data_dir = base / "data"
    env = _env(overlay.parent, token_weighted_scheduler="true", data_dir=data_dir)
    server = PlainVllmServer(["--model", str(ensure_demo_model()), "--served-model-name", SERVED_NAME,
                              "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096"],
                             base / "server.log", env)
    server.data_dir = data_dir
    server.overlay = overlay
    return {"plain": server}


@pytest.fixture(scope="module")
def _started(request):
    yield from early_then_stopped(request, start_early)


@pytest.fixture(scope="module")
def patched_vllm(_started):
    return _started["plain"].overlay


@pytest.fixture(scope="module")
def patched_server(_started):
    server = _started["plain"]
    _RUNNING.append(server)
    server.wait_healthy()
    return server


def _health(server) -> dict:
    with urllib.request.urlopen(server.base_url + "/qwen_ext/health", timeout=10) as r:
        return json.load(r)


def _stream_chat(server, messages, max_tokens=4):
    chunks = []
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        request_id = r.headers.get("x-request-id")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return request_id, chunks


def test_the_plugin_is_not_loaded_and_the_source_patches_are_active(patched_server):
    health = _health(patched_server)
    assert health["patch_mode"] == "source" and health["disabled_patches"] == {}
    assert sorted(health["source_patches"]) == ["connection_guard", "per_chunk_usage", "token_weighted_scheduler",
                                                "usage_accounting"]
    assert health["connections"]["header_timeout_s"] == 60.0  # the launcher module's hook guarded vLLM's server
    # only the API server's source hook recorded itself: the general plugin never ran (not in the engine core)
    assert health["plugin_loaded_in"] == ["api_server"]
    assert all(p["patch_mode"] == "source" for p in health["processes"])
    log = patched_server.log_path.read_text(errors="replace")
    assert "Loading plugin qwen_vllm_ext" not in log


def test_every_chunk_carries_cached_tokens_and_billing(patched_server):
    messages = [{"role": "user", "content": LONG_PROMPT}]
    _, first = _stream_chat(patched_server, messages)
    request_id, second = _stream_chat(patched_server, messages)  # same prompt: prefix-cache hit
    for chunks, hit in ((first, False), (second, True)):
        assert chunks and all(isinstance(c.get("usage"), dict) for c in chunks)  # no stream_options sent
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        cached = {c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks}
        assert len(cached) == 1
        (value,) = cached
        prompt = chunks[-1]["usage"]["prompt_tokens"]
        assert (value >= 256 and value % 128 == 0 and value <= prompt) if hit else value == 0
        for c in chunks:
            billing = c["usage"]["billing"]
            assert billing["policy"] == "default" and float(billing["total_units"]) > 0
    assert request_id


def test_token_weighted_scheduler_runs_in_the_engine_core(patched_server):
    for i in range(3):
        resp = httpx.post(patched_server.base_url + "/v1/completions", timeout=120,
                          json={"model": SERVED_NAME, "prompt": f"count {i}", "max_tokens": 3, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 15
    while True:
        schedulers = _health(patched_server)["scheduler"]
        if (schedulers and schedulers[0]["stats"]["admitted"] >= 3) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    (scheduler,) = schedulers
    assert scheduler["scheduler"] == "TokenWeightedScheduler" and scheduler["stats"]["admitted"] >= 3


def test_the_ledger_records_every_request_with_engine_counts(patched_server):
    messages = [{"role": "user", "content": LONG_PROMPT + " again"}]
    _stream_chat(patched_server, messages)
    request_id, chunks = _stream_chat(patched_server, messages)
    store = open_store("sqlite", str(patched_server.data_dir / "ledger.sqlite3"))
    deadline = time.monotonic() + 10
    while True:
        records = {r.request_id: r for r in store.records()}
        if request_id in records or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    record = records[request_id]
    usage = chunks[-1]["usage"]
    assert record.status == "length" and record.endpoint == "/v1/chat/completions"
    assert (record.prompt_tokens, record.completion_tokens) == (usage["prompt_tokens"], 4)
    assert record.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_kv_reuse_template_keeps_earlier_reasoning(patched_server):
    """The official Qwen3 template drops the reasoning of earlier assistant turns; the package's qwen3-reuse
    template (chosen by the source patch, as the launcher chooses it) keeps it, so the prompt grows."""
    def prompt_tokens(reasoning):
        turn = {"role": "assistant", "content": "Paris."}
        if reasoning:
            turn["reasoning_content"] = reasoning
        messages = [{"role": "user", "content": "Capital of France?"}, turn, {"role": "user", "content": "Why?"}]
        resp = httpx.post(patched_server.base_url + "/v1/chat/completions", timeout=120,
                          json={"model": SERVED_NAME, "messages": messages, "max_tokens": 1})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("It is the seat of government and the largest city.") > prompt_tokens(None)


def test_launcher_with_the_plugin_on_a_patched_vllm_does_nothing_twice(patched_vllm, tmp_path):
    """Plugin AND source patches: the guard reports the capabilities the source carries, the plugin patches
    nothing again, and the ledger middleware is attached once (one record per request, no suffixed duplicate)."""
    while _RUNNING:
        _RUNNING.pop().stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_VLLM_EXT_") and k != "VLLM_PLUGINS"}
    env["PYTHONPATH"] = str(patched_vllm.parent)
    # the profiles ship the scheduler off; on here, so that the test sees it is not installed twice
    server = Server(["--qwen-token-weighted-scheduler", "true"], tmp_path / "server.log", env=env,
                    data_dir=tmp_path / "data")
    try:
        server.wait_healthy()
        health = _health(server)
        assert health["patch_mode"] == "plugin" and health["disabled_patches"] == {}
        assert sorted(health["source_patches"]) == ["connection_guard", "per_chunk_usage", "token_weighted_scheduler",
                                                    "usage_accounting"]
        assert {"api_server", "engine_core"} <= set(health["plugin_loaded_in"])
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"X-Request-ID": "twice-check-1"}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert r.headers["x-request-id"] == "twice-check-1"
        assert all("billing" in c["usage"] for c in chunks) and chunks[-1]["choices"] == []
        store = open_store("sqlite", str(tmp_path / "data" / "ledger.sqlite3"))
        deadline = time.monotonic() + 10
        while not store.records() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # a second (duplicate) middleware would commit its record right after the first
        assert [r.request_id for r in store.records()] == ["twice-check-1"]
        deadline = time.monotonic() + 15
        while not (schedulers := _health(server)["scheduler"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [s["scheduler"] for s in schedulers] == ["TokenWeightedScheduler"]
    finally:
        server.stop()


def test_strict_mode_refuses_to_start_on_changed_vllm(tmp_path):
    """The launcher (plugin path) on a vLLM whose SchedulerConfig.get_scheduler_cls differs from the declared
    fingerprint: with strict_patches the server does not start and says why."""
    overlay = core.overlay(core.find_vllm(), tmp_path / "site")
    target = overlay / "config" / "scheduler.py"
    text = target.read_text()
    target.unlink()
    target.write_text(text.replace("        if self.scheduler_cls is None:\n",
                                   "        if not self.scheduler_cls:  # a future vLLM\n", 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_VLLM_EXT_") and k != "VLLM_PLUGINS"}
    env["PYTHONPATH"] = str(overlay.parent)
    run = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.serve", "--qwen-strict-patches", "true",
                          "--qwen-token-weighted-scheduler", "true",  # the guard checks the patches turned on
                          "--qwen-data-dir", str(tmp_path / "data"), "--port", str(free_port())],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2
    assert "runtime patch 'token_weighted_scheduler' disabled: vLLM 0.32.0 differs" in run.stderr
    assert "Traceback" not in run.stderr  # one clear error line, not a crash
    assert "(strict_patches=true: refusing to start)" in run.stderr
    assert "Application startup complete" not in run.stdout + run.stderr
