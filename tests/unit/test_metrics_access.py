"""Who reads the per-key series (issue 45): with the gateway on and ``metrics_key`` set, ``/metrics`` answers only
``Authorization: Bearer <metrics_key>`` (or the admin key) and carries the ``key_id`` series; with ``metrics_key``
empty it stays public and the top-key families have no samples; with the gateway off nothing changes. The shipped
Prometheus configuration scrapes with the credential."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from qwen_vllm_ext.config import Settings
from qwen_vllm_ext.gateway import metrics as gateway_metrics
from qwen_vllm_ext.gateway.middleware import GatewayMiddleware
from qwen_vllm_ext.observability import catalog
from qwen_vllm_ext.usage import metrics as usage_metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRICS_KEY, ADMIN_KEY = "m" * 32, "a" * 32


def _get(settings: Settings, path: str = "/metrics", headers=()) -> tuple[int, dict | None, bool]:
    """(status, JSON body or None, whether the app behind the gateway was called) of a GET through the gateway."""
    called = []

    async def app(scope, receive, send):
        called.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"# metrics\n"})

    gw = GatewayMiddleware(app, settings=settings, keys=None, limiter=None, policy=None)
    scope = {"type": "http", "path": path, "method": "GET", "state": {}, "headers": list(headers)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(gw(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body) if start["status"] != 200 else None, bool(called)


def _auth(token: str):
    return [(b"authorization", f"Bearer {token}".encode())]


def test_metrics_needs_the_metrics_key_when_it_is_set():
    settings = Settings(gateway=True, metrics_key=METRICS_KEY, admin_key=ADMIN_KEY)
    for headers in ((), _auth("wrong"), _auth(METRICS_KEY[:-1]), _auth(""), [(b"x-api-key", b"qve-something")]):
        status, body, called = _get(settings, headers=headers)
        assert (status, called) == (401, False), headers
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "invalid_metrics_key" and body["error"]["type"] == "authentication_error"
        assert "credentials_file" in body["error"]["message"] and METRICS_KEY not in body["error"]["message"]
    for path in ("/metrics/", "/metrics/anything", "/metricsx"):  # vLLM serves /metrics on ^/metrics(?P<path>.*)$
        assert _get(settings, path=path, headers=_auth("qve-any-api-key"))[::2] == (401, False), path
        assert _get(settings, path=path, headers=_auth(METRICS_KEY))[::2] == (200, True), path
    assert _get(settings, headers=_auth(METRICS_KEY))[::2] == (200, True)
    assert _get(settings, headers=[(b"authorization", f"bearer  {METRICS_KEY} ".encode())])[::2] == (200, True)
    assert _get(settings, headers=_auth(ADMIN_KEY))[::2] == (200, True)  # usage reconcile and the doctor send it
    assert _get(settings, path="/health")[::2] == (200, True)  # the other public routes stay public


def test_no_gate_without_a_metrics_key():
    assert _get(Settings(gateway=True))[::2] == (200, True)
    assert _get(Settings(gateway=True, admin_key=ADMIN_KEY), headers=_auth("anything"))[::2] == (200, True)


def test_per_key_series_only_behind_the_credential_or_without_the_gateway():
    assert catalog.per_key_series(Settings()) is True  # no gateway: no keys (key_id ""), unchanged
    assert catalog.per_key_series(Settings(metrics_key=METRICS_KEY)) is True
    assert catalog.per_key_series(Settings(gateway=True)) is False
    assert catalog.per_key_series(Settings(gateway=True, metrics_key=METRICS_KEY)) is True


def _samples(collector, name: str) -> dict[str, float]:
    families = [f for f in collector.collect() if f.name == name]
    assert len(families) == 1, f"{name} missing from the collector's output"
    return {s.labels["key_id"]: s.value for s in families[0].samples}


def test_the_ledger_collector_leaves_the_key_series_out_when_told():
    usage_metrics._top_tokens.add("k_secret", 123, time.time())
    assert _samples(usage_metrics.LedgerCollector(None, None, "me", per_key=False), "qwen_ext_top_key_tokens") == {}
    assert _samples(usage_metrics.LedgerCollector(None, None, "me"), "qwen_ext_top_key_tokens")["k_secret"] >= 123


def test_the_rejections_collector_leaves_the_key_series_out_when_told():
    gateway_metrics.rejected("rate_limit_exceeded", 429, "k_secret")
    assert _samples(gateway_metrics.TopKeyRejections(per_key=False), "qwen_ext_top_key_rejections") == {}
    assert _samples(gateway_metrics.TopKeyRejections(), "qwen_ext_top_key_rejections")["k_secret"] >= 1
    gateway_metrics.register(per_key=False)  # once per process; a later server's settings update it
    gateway_metrics.register(per_key=True)
    assert gateway_metrics._registered.per_key is True


def test_the_health_route_masks_the_metrics_key():
    assert Settings(metrics_key=METRICS_KEY).public()["metrics_key"] == "***"
    assert Settings().public()["metrics_key"] == ""


def test_the_shipped_prometheus_config_scrapes_the_replicas_with_the_credential(tmp_path):
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    job, = [j for j in config["scrape_configs"] if j["job_name"] == "qwen-replica"]
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    assert config["rule_files"] == ["qwen-vllm-ext.rules.yml"]
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: ./scripts/setup.sh installs Debian's prometheus package"
    # promtool checks that the credentials file exists: point it at one here
    (tmp_path / "key").write_text(METRICS_KEY + "\n")
    job["authorization"]["credentials_file"] = str(tmp_path / "key")
    config["rule_files"] = [str(ROOT / "deploy" / "prometheus" / "qwen-vllm-ext.rules.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    run = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
