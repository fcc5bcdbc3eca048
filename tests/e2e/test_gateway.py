"""E2E: the in-server gateway on the demo server — keys, exact reserve-and-reconcile limits, budgets, headers,
spike breaker, clean errors for bad input; on SQLite, and with two API-server processes sharing Redis."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from qwen_vllm_ext.demo import SERVED_NAME

from ..redis_server import RedisServer
from .conftest import Server

ADMIN = "admin-secret-for-tests-0001"
HI = [{"role": "user", "content": "hi"}]  # 9 prompt tokens with the Qwen3 template


def make_key(data_dir: Path, *args, redis_url: str | None = None) -> dict:
    extra = ["--redis-url", redis_url] if redis_url else []
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", "create", "--json", *extra, *args],
                          capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                           "QWEN_VLLM_EXT_DATA_DIR": str(data_dir)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def chat(client, secret, messages=HI, max_tokens=5, **extra):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                       json={"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens,
                             "ignore_eos": True, **extra})


def gateway_server(tmp_path_factory, name, extra=()):
    data = tmp_path_factory.mktemp(name)
    server = Server(["--qwen-gateway", "true", "--qwen-admin-key", ADMIN, "--qwen-max-body-bytes", "65536",
                     "--qwen-spike-min-units", "400", *extra], tmp_path_factory.mktemp("logs") / f"{name}.log",
                    data_dir=data)
    return server, data


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    server, data = gateway_server(tmp_path_factory, "gw")
    server.wait_healthy()
    yield server, data
    server.stop()


def barrier_burst(server, secret, n=200, max_tokens=5):
    """n requests released at once by a barrier; returns the responses."""
    barrier = threading.Barrier(n)
    results = [None] * n

    def worker(i):
        with httpx.Client(base_url=server.base_url, timeout=300) as client:
            barrier.wait()
            results[i] = chat(client, secret, max_tokens=max_tokens)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def check_burst(results, tpm, cost):
    admitted = [r for r in results if r.status_code == 200]
    denied = [r for r in results if r.status_code == 429]
    assert len(admitted) + len(denied) == len(results)
    assert len(admitted) * cost <= tpm  # zero overshoot
    assert len(admitted) == tpm // cost  # and the limit is used, not wasted
    for r in denied:
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.headers["x-ratelimit-limit-tokens"] == str(tpm)
    for r in admitted:
        assert r.json()["usage"]["total_tokens"] == cost


def test_barrier_burst_never_overshoots_tpm(gw):
    server, data = gw
    key = make_key(data, "--name", "burst", "--tpm", "300", "--rpm", "10000")
    check_burst(barrier_burst(server, key["secret"]), tpm=300, cost=9 + 5)


def test_headers_on_every_response_and_honest(gw):
    server, data = gw
    key = make_key(data, "--name", "honest", "--tpm", "400", "--rpm", "50")
    client = httpx.Client(base_url=server.base_url, timeout=120)
    r = chat(client, key["secret"], max_tokens=10)
    assert r.status_code == 200
    for h in ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-requests",
              "x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens",
              "x-request-id", "x-qwen-gateway-overhead-ms"):
        assert h in r.headers, h
    assert r.headers["x-ratelimit-reset-tokens"] in ("59s", "1m0s")
    # streams get the same headers, decided before the first byte
    with client.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key['secret']}"},
                       json={"model": SERVED_NAME, "messages": HI, "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200 and "x-ratelimit-remaining-tokens" in s.headers
        assert float(s.headers["x-qwen-gateway-overhead-ms"]) >= 0
        s.read()
    # honesty: a request that the last remaining-tokens header says fits is admitted
    remaining = int(chat(client, key["secret"], max_tokens=1).headers["x-ratelimit-remaining-tokens"])
    while remaining >= 9 + 1:
        fits = min(remaining - 9, 100)
        r = chat(client, key["secret"], max_tokens=fits)
        assert r.status_code == 200, (remaining, r.text)
        remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    r = chat(client, key["secret"], max_tokens=remaining + 1)  # does not fit any more
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


def test_key_scope_revocation_expiry_and_auth_errors(gw):
    server, data = gw
    client = httpx.Client(base_url=server.base_url, timeout=120)
    no_key = client.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": HI})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert chat(client, "qve-" + "x" * 43).json()["error"]["code"] == "invalid_api_key"
    scoped = make_key(data, "--name", "scoped", "--models", "some-other-model")
    denied = chat(client, scoped["secret"])
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"
    expiring = make_key(data, "--name", "expiring", "--expires", "2s")
    assert chat(client, expiring["secret"]).status_code == 200
    time.sleep(2.2)
    expired = chat(client, expiring["secret"])
    assert expired.status_code == 401 and expired.json()["error"]["code"] == "api_key_expired"
    live = make_key(data, "--name", "to-revoke")
    assert chat(client, live["secret"]).status_code == 200
    revoked_at = time.monotonic()
    r = client.delete(f"/qwen_ext/admin/keys/{live['key']['key_id']}", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["revoked_at"]
    while chat(client, live["secret"], max_tokens=1).status_code == 200:
        assert time.monotonic() - revoked_at < 1.0, "revocation not effective within 1 s"
    assert chat(client, live["secret"]).json()["error"]["code"] == "invalid_api_key"


def test_no_generation_escapes_metering_and_no_secret_leaks(gw):
    server, data = gw
    key = make_key(data, "--name", "escape", "--max-tokens-cap", "7")
    client = httpx.Client(base_url=server.base_url, timeout=120)
    auth = {"Authorization": f"Bearer {key['secret']}"}
    for path in ("/v1/responses", "/v1/messages", "/invocations", "/inference/v1/generate"):
        r = client.post(path, headers=auth, json={"model": SERVED_NAME, "input": "hi"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "endpoint_not_allowed", path
    assert client.post("/tokenize", headers=auth, json={"model": SERVED_NAME, "prompt": "hi"}).status_code == 200
    # the key's max_tokens cap is enforced by the engine even when the client sends no max_tokens
    r = client.post("/v1/chat/completions", headers=auth,
                    json={"model": SERVED_NAME, "messages": HI, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
    health = client.get("/qwen_ext/health").text  # public route
    assert ADMIN not in health and '"admin_key": "***"' in health.replace('":"', '": "')


def test_admin_endpoints(gw):
    server, _ = gw
    client = httpx.Client(base_url=server.base_url, timeout=60)
    assert client.get("/qwen_ext/admin/keys").status_code == 401
    assert client.get("/qwen_ext/admin/keys", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {ADMIN}"}
    created = client.post("/qwen_ext/admin/keys", headers=auth, json={"name": "via-admin", "tpm": 1000,
                                                                     "daily_budget": "12.5"}).json()
    assert created["key"].startswith("qve-") and created["daily_budget_micro"] == 12_500_000
    listing = client.get("/qwen_ext/admin/keys", headers=auth).text
    assert created["key"] not in listing and "via-admin" in listing
    patched = client.patch(f"/qwen_ext/admin/keys/{created['key_id']}", headers=auth, json={"tpm": 2000}).json()
    assert patched["tpm"] == 2000
    bad = client.patch(f"/qwen_ext/admin/keys/{created['key_id']}", headers=auth, json={"tpm": -1})
    assert bad.status_code == 400 and "tpm" in bad.json()["error"]["message"]
    assert client.get("/qwen_ext/admin/keys/k_nope", headers=auth).status_code == 404


def test_budget_exhaustion_is_insufficient_quota(gw):
    server, data = gw
    key = make_key(data, "--name", "budget", "--daily-budget", "40")
    client = httpx.Client(base_url=server.base_url, timeout=120)
    statuses = [chat(client, key["secret"], max_tokens=5) for _ in range(4)]  # ~15.75 units each
    assert [r.status_code for r in statuses[:2]] == [200, 200]
    last = statuses[-1]
    assert last.status_code == 429 and last.json()["error"]["code"] == "insufficient_quota"
    assert "retry-after" not in last.headers


def test_spike_breaker_suspends_the_key(gw):
    server, data = gw
    key = make_key(data, "--name", "spiky")
    client = httpx.Client(base_url=server.base_url, timeout=120)
    # threshold: 3 x max(baseline 0, floor 400 units) = 1200 units per 15 min; each request ~ 280 units
    codes = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = chat(client, key["secret"], max_tokens=200)
        codes.append(r.status_code)
        if r.status_code == 403:
            assert r.json()["error"]["code"] == "api_key_suspended"
            break
        time.sleep(0.2)
    assert codes[-1] == 403 and 4 <= codes.index(403) <= 7
    metrics = client.get("/metrics").text
    assert "qwen_ext_keys_suspended_total 1.0" in metrics


def test_bad_input_suite(gw):
    server, data = gw
    key = make_key(data, "--name", "bad-input", "--max-tokens-cap", "64")
    secret = key["secret"]
    client = httpx.Client(base_url=server.base_url, timeout=120)
    auth = {"Authorization": f"Bearer {secret}", "content-type": "application/json"}

    def post(raw: bytes):
        return client.post("/v1/chat/completions", headers=auth, content=raw)

    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"\xff\xfe{}", 400, "invalid_json"),  # invalid UTF-8
        (b"[1, 2]", 400, "invalid_request_error"),
        (json.dumps({"data": {"messages": HI, "model": SERVED_NAME}}).encode(), 400, "double_wrapped_body"),
        (json.dumps({"model": SERVED_NAME, "messages": "hi"}).encode(), 400, "invalid_request_error"),
        (json.dumps({"model": SERVED_NAME, "messages": HI, "max_tokens": "ten"}).encode(), 400,
         "invalid_request_error"),
        (json.dumps({"model": SERVED_NAME, "messages": [{"content": "no role"}]}).encode(), 400,
         "invalid_request_error"),
        (json.dumps({"model": SERVED_NAME, "messages": HI, "max_tokens": 65}).encode(), 400,
         "max_tokens_exceeds_cap"),
        (json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": "word " * 4200}]}).encode(),
         400, "context_length_exceeded"),
        (json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": "x" * 70000}]}).encode(),
         413, "request_too_large"),
    ]
    for raw, status, code in cases:
        r = post(raw)
        assert r.status_code == status, (raw[:60], r.text)
        error = r.json()["error"]
        assert error["code"] == code and error["message"], raw[:60]
        assert set(error) == {"message", "type", "param", "code"}
    # zero-width characters are removed before counting and before the engine: the counts agree
    dirty = [{"role": "user", "content": "h\u200bi\u2060\ufeff"}]
    r = chat(client, secret, messages=dirty, max_tokens=3)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 9
    # the server keeps serving, and the ledger still agrees with vLLM's counters
    assert chat(client, secret, max_tokens=2).status_code == 200
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "reconcile", "--url", server.base_url],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_two_api_servers_sharing_redis_never_overshoot(tmp_path_factory):
    with RedisServer() as redis:
        server, data = gateway_server(tmp_path_factory, "gw-redis", (
            "--api-server-count", "2", "--qwen-ledger-backend", "redis", "--qwen-ledger-redis-url", redis.url,
            "--qwen-limiter-backend", "redis"))
        try:
            server.wait_healthy()
            key = make_key(data, "--name", "shared", "--tpm", "280", redis_url=redis.url)
            check_burst(barrier_burst(server, key["secret"]), tpm=280, cost=9 + 5)
            # Redis lost at runtime: limiter_failure=closed (default) answers 503, nothing is admitted unmetered
            other = make_key(data, "--name", "outage", "--tpm", "100000", redis_url=redis.url)
            client = httpx.Client(base_url=server.base_url, timeout=120)
            assert chat(client, other["secret"]).status_code == 200
            redis.stop()
            down = chat(client, other["secret"])
            assert down.status_code == 503 and down.json()["error"]["code"] == "service_unavailable"
            assert down.headers["retry-after"] == "1"
            redis.restart()
            deadline = time.monotonic() + 30
            while chat(client, other["secret"]).status_code != 200:
                assert time.monotonic() < deadline, "the gateway did not recover after Redis came back"
                time.sleep(0.5)
        finally:
            server.stop()
