"""E2E: `python -m qwen_vllm_ext.doctor` against live demo servers: every check passes on a well-configured one
(gateway, ledger, token-weighted scheduler, KV-reuse template), and each misconfiguration gets the right FAIL or WARN
with its fix — gateway off, prefix caching off and the reuse template off (one server), the endpoint plugin not loaded
(plain vLLM without qwen_vllm_ext in VLLM_PLUGINS)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from qwen_vllm_ext.bench.server import ServeProcess
from qwen_vllm_ext.demo import ensure_demo_model

from ..helpers.doctor import doctor, not_passing
from ..helpers.gateway import ADMIN
from .servers import STARTUP_TIMEOUT_S, Server, early_then_stopped, gateway_server


def statuses(checks: dict[str, dict]) -> dict[str, str]:
    return {name: c["status"] for name, c in checks.items()}


EARLY_GB = 10  # three servers


def start_early(tmp_path_factory) -> dict:
    """A well-configured server and the two misconfigured ones the tests below diagnose, started together (their
    start-ups overlap)."""
    ok = gateway_server(tmp_path_factory, "doctor-ok", extra=["--qwen-token-weighted-scheduler", "true",
                                                              "--qwen-spike-factor", "0"])
    logs = tmp_path_factory.mktemp("logs")
    misconfigured = Server(["--no-enable-prefix-caching", "--qwen-kv-reuse-template", "false"],
                           logs / "misconfigured.log", data_dir=tmp_path_factory.mktemp("misconfigured"))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}  # vLLM's default: no endpoint plugins
    plain = PlainVllm(["--model", str(ensure_demo_model()), "--dtype", "float32", "--enforce-eager",
                       "--max-model-len", "2048"], logs / "plain.log", env=env)
    return {"ok": ok, "misconfigured": misconfigured, "plain": plain}


class PlainVllm(ServeProcess):
    def __init__(self, argv, log_path, env):
        ServeProcess.__init__(self, argv, log_path, env=env, module="vllm.entrypoints.openai.api_server")


@pytest.fixture(scope="module")
def doctor_servers(request):
    yield from early_then_stopped(request, start_early)


def test_a_well_configured_server_passes_every_check(doctor_servers):
    server = doctor_servers["ok"]
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            key = c.post("/qwen_ext/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"},
                         json={"name": "doctor", "rpm": 1000, "tpm": 1_000_000}).json()["key"]
        code, checks = doctor(server, "--api-key", key, "--admin-key", ADMIN)
        # the admin key from the environment (not a flag, which shows in `ps`): the health route's details with it
        text = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.doctor", "--url", server.base_url, "--api-key",
                               key], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "QWEN_VLLM_EXT_ADMIN_KEY": ADMIN}).stdout
        # issue 47: a suspended --api-key is reported as suspended, with the command that lifts it, and the probes
        # that need the key are skipped rather than failing as "check the key's scope"
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            key_id = c.get("/qwen_ext/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"][0]
            c.patch(f"/qwen_ext/admin/keys/{key_id['key_id']}", headers={"Authorization": f"Bearer {ADMIN}"},
                    json={"suspended_until": "10m", "suspend_reason": "usage spike (test)"}).raise_for_status()
        time.sleep(1.2)  # the key cache reads the store's version at most every 0.5 s
        suspended_code, suspended = doctor(server, "--api-key", key, "--admin-key", ADMIN)
    finally:
        server.stop()
    assert suspended_code == 1 and suspended["api key"]["status"] == "FAIL", suspended.get("api key")
    assert "suspended until" in suspended["api key"]["seen"] and "--unsuspend" in suspended["api key"]["fix"]
    assert "usage on every chunk" not in suspended and "gateway: limits" not in suspended
    assert [c["name"] for c in suspended.values() if c["status"] == "FAIL"] == ["api key"]
    assert code == 0 and not_passing(checks) == [], not_passing(checks)
    for wanted in ("server", "plugin", "vllm version", "runtime patches", "profile vs hardware", "scheduler",
                   "prefix caching",
                   "usage on every chunk", "cached tokens", "token count", "kv reuse", "gateway: bad key",
                   "gateway: limits", "gateway: body checks", "gateway: admin routes", "ledger"):
        assert wanted in checks, wanted
    assert "TokenWeighted" in checks["scheduler"]["seen"] and "drift 0" in checks["ledger"]["seen"]
    assert checks["profile vs hardware"]["seen"] == "profile cpu on no GPU"  # the launcher's record
    assert text.splitlines()[-1].endswith("0 FAIL, 0 WARN") and text.startswith("PASS")


def test_gateway_off_is_a_warning_with_the_fix(demo_server):
    code, checks = doctor(demo_server)
    st = statuses(checks)
    assert code == 0 and st["gateway"] == "WARN" and "--qwen-gateway true" in checks["gateway"]["fix"]
    assert [c for c in not_passing(checks) if c["name"] != "gateway"] == []


def test_prefix_caching_and_the_reuse_template_off_each_get_their_finding_and_fix(doctor_servers):
    """Two misconfigurations on one server (one start instead of two): each check names its own."""
    server = doctor_servers["misconfigured"]
    server.wait_healthy()
    code, checks = doctor(server)
    st = statuses(checks)
    assert code == 1 and st["prefix caching"] == "FAIL" and st["cached tokens"] == "FAIL", checks
    assert "enable-prefix-caching" in checks["prefix caching"]["fix"]
    assert "enable-prefix-caching" in checks["cached tokens"]["fix"]
    kv = checks["kv reuse"]
    assert kv["status"] in ("WARN", "FAIL") and "kv_reuse_template=true" in kv["fix"], kv
    assert "template model default" in kv["seen"] or "template qwen3" in kv["seen"], kv
    # what is not misconfigured still passes
    assert st["usage on every chunk"] == st["token count"] == st["ledger"] == "PASS", checks


def test_without_the_endpoint_plugin_the_doctor_says_how_to_load_it(doctor_servers):
    server = doctor_servers["plain"]
    server.wait_healthy(STARTUP_TIMEOUT_S)
    code, checks = doctor(server)
    assert code == 1 and checks["plugin"]["status"] == "FAIL", checks
    assert "VLLM_PLUGINS" in checks["plugin"]["fix"] and "qwen_vllm_ext.serve" in checks["plugin"]["fix"]
    assert list(checks) == ["server", "plugin"]  # nothing further can be checked without the plugin


@pytest.mark.parametrize("url", ["http://127.0.0.1:9"])
def test_an_unreachable_server_fails_cleanly(url):
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.doctor", "--url", url], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout.startswith("FAIL") and "unreachable" in proc.stdout
