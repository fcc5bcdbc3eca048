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
from .conftest import Server, early_then_stopped

ADMIN = "admin-secret-for-tests-0001"
HI = [{"role": "user", "content": "hi"}]  # 9 prompt tokens with the Qwen3 template


def make_key(data_dir: Path, *args, redis_url: str | None = None) -> dict:
    extra = ["--redis-url", redis_url] if redis_url else []
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", "create", "--json", *extra, *args],
                          capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                           "QWEN_VLLM_EXT_DATA_DIR": str(data_dir)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def chat(client, secret, messages=HI, max_tokens=5, model=SERVED_NAME, **extra):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                       json={"model": model, "messages": messages, "max_tokens": max_tokens,
                             "ignore_eos": True, **extra})


def gateway_server(tmp_path_factory, name, extra=()) -> Server:
    """A gateway server (started, not waited for); its data dir is ``server.data_dir``."""
    return Server(["--qwen-gateway", "true", "--qwen-admin-key", ADMIN, "--qwen-max-body-bytes", "65536",
                   "--qwen-spike-min-units", "400", *extra], tmp_path_factory.mktemp("logs") / f"{name}.log",
                  data_dir=tmp_path_factory.mktemp(name))


EARLY_GB = 10.5  # three servers, one with two API-server processes


def start_early(tmp_path_factory) -> dict:
    """The module's gateway servers, started together (their start-ups overlap): on the KV-reuse template, on the
    model's own, and two API-server processes sharing a Redis (which the test stops and starts)."""
    redis = RedisServer().start()
    return {"gw": gateway_server(tmp_path_factory, "gw"),
            "stock": gateway_server(tmp_path_factory, "gw-stock", ("--qwen-kv-reuse-template", "false")),
            "redis": redis,
            "gw-redis": gateway_server(tmp_path_factory, "gw-redis", (
                "--api-server-count", "2", "--qwen-ledger-backend", "redis", "--qwen-ledger-redis-url", redis.url,
                "--qwen-limiter-backend", "redis"))}


@pytest.fixture(scope="module")
def gw_servers(request):
    yield from early_then_stopped(request, start_early)


@pytest.fixture(scope="module")
def gw(gw_servers):
    server = gw_servers["gw"]
    server.wait_healthy()
    return server, server.data_dir


def barrier_burst(server, secret, n=200, max_tokens=5, request=None):
    """n requests released at once by a barrier; returns the responses. ``request(client, i)`` sends request i
    (default: a short chat with ``secret``)."""
    barrier = threading.Barrier(n)
    results = [None] * n
    send = request or (lambda client, i: chat(client, secret, max_tokens=max_tokens))

    def worker(i):
        with httpx.Client(base_url=server.base_url, timeout=600) as client:
            barrier.wait()
            results[i] = send(client, i)

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
    for path in ("/v1/responses", "/invocations", "/inference/v1/generate"):
        r = client.post(path, headers=auth, json={"model": SERVED_NAME, "input": "hi"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "endpoint_not_allowed", path
        assert path in r.json()["error"]["message"]
    # /v1/messages (Anthropic) is metered like chat: the key's cap, the exact count, the headers
    r = client.post("/v1/messages", headers=auth, json={"model": SERVED_NAME, "max_tokens": 50, "messages": HI})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["code"] == "max_tokens_exceeds_cap"
    assert r.json()["type"] == "error"  # the Anthropic error shape as well (error.type, error.message)
    r = client.post("/v1/messages", headers=auth, json={"model": SERVED_NAME, "max_tokens": 5, "messages": HI,
                                                        "system": "Be brief.", "thinking": {"type": "disabled"}})
    assert r.status_code == 200 and r.json()["type"] == "message"
    assert int(r.headers["x-qwen-prompt-tokens"]) == r.json()["usage"]["input_tokens"] + (
        r.json()["usage"].get("cache_read_input_tokens") or 0)
    bad = client.post("/v1/messages", headers=auth, json={"model": SERVED_NAME, "messages": HI})  # no max_tokens
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
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


def test_two_api_servers_sharing_redis_never_overshoot(gw_servers):
    redis, server = gw_servers["redis"], gw_servers["gw-redis"]
    try:
        server.wait_healthy()
        key = make_key(server.data_dir, "--name", "shared", "--tpm", "280", redis_url=redis.url)
        check_burst(barrier_burst(server, key["secret"]), tpm=280, cost=9 + 5)
        # Redis lost at runtime: limiter_failure=closed (default) answers 503, nothing is admitted unmetered
        other = make_key(server.data_dir, "--name", "outage", "--tpm", "100000", redis_url=redis.url)
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
        server.stop()  # done with it: the memory goes back


# ---- issue 18: scope on the model the engine serves, every field counted, the rule for n ---------------------
def auth(secret):
    return {"Authorization": f"Bearer {secret}"}


def test_scope_applies_to_the_default_model_and_every_route(gw):
    """A key scoped to other models cannot reach the served model by leaving 'model' out, on any route."""
    server, data = gw
    client = httpx.Client(base_url=server.base_url, timeout=120)
    scoped = auth(make_key(data, "--name", "scope-bypass", "--models", "other-model")["secret"])
    for path, body in (("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/tokenize", {"prompt": "hi"}), ("/v1/tokens/count", {"prompt": "hi"})):
        for variant in ({}, {"model": None}, {"model": ""}, {"model": SERVED_NAME}):
            r = client.post(path, headers=scoped, json={**body, **variant})
            assert r.status_code == 403, (path, variant, r.text)
            assert r.json()["error"]["code"] == "model_not_allowed"
    assert client.get("/v1/models", headers=scoped).json()["data"] == []  # lists only the key's models
    own = auth(make_key(data, "--name", "scope-own", "--models", SERVED_NAME)["secret"])
    r = client.post("/v1/chat/completions", headers=own, json={"messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == SERVED_NAME
    assert [m["id"] for m in client.get("/v1/models", headers=own).json()["data"]] == [SERVED_NAME]
    assert client.post("/tokenize", headers=own, json={"prompt": "hi"}).status_code == 200


def test_reasoning_effort_is_reserved_exactly_and_tpm_never_overshoots(gw):
    """40 simultaneous requests with reasoning_effort "none" (4 more prompt tokens than without) under TPM 650."""
    server, data = gw
    key = make_key(data, "--name", "effort", "--tpm", "650", "--rpm", "10000")
    barrier = threading.Barrier(40)
    results = [None] * 40

    def worker(i):
        with httpx.Client(base_url=server.base_url, timeout=300) as client:
            barrier.wait()
            results[i] = chat(client, key["secret"], max_tokens=40, reasoning_effort="none")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted = [r for r in results if r.status_code == 200]
    assert all(r.status_code == 429 for r in results if r.status_code != 200)
    used = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    assert used <= 650 and len(admitted) == 650 // (13 + 40)  # prompt 9 + the empty think block's 4
    for r in admitted:
        assert int(r.headers["x-qwen-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"] == 13


def test_n_samples_are_charged_what_usage_says(gw):
    """n=2: the prompt is reserved and charged once (as usage counts it), the output twice."""
    server, data = gw
    key = make_key(data, "--name", "n-rule", "--tpm", "5000", "--rpm", "10000")
    client = httpx.Client(base_url=server.base_url, timeout=120)
    r = chat(client, key["secret"], max_tokens=24, n=2)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage == {**usage, "prompt_tokens": 9, "completion_tokens": 48, "total_tokens": 57}
    assert int(r.headers["x-qwen-reserved-tokens"]) == 57 and int(r.headers["x-ratelimit-remaining-tokens"]) == 5000 - 57
    time.sleep(1.0)  # reconciliation runs right after the ledger commit
    probe = chat(client, key["secret"], max_tokens=1)
    assert int(probe.headers["x-ratelimit-remaining-tokens"]) == 5000 - 57 - 10  # charged 57, not 57 + 9


def usage_counts(kind, response) -> tuple[int, int]:
    """(prompt tokens the engine computed, total tokens) from an OpenAI or Anthropic response's usage."""
    usage = response.json()["usage"]
    if kind != "messages":
        return usage["prompt_tokens"], usage["total_tokens"]
    prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + (
        usage.get("cache_creation_input_tokens") or 0)  # Anthropic's input_tokens excludes the cached part
    return prompt, prompt + usage["output_tokens"]


def run_field_mix(server, seed, count, name, model=SERVED_NAME):
    """Send the seeded field mix in chunks of one fresh key each; per request, the admission count must equal
    the engine's prompt tokens; per chunk, the key's TPM window must hold exactly what usage says was used."""
    from qwen_vllm_ext.bench.field_mix import PATHS, bodies, fields_set
    from qwen_vllm_ext.gateway.request_fields import FIELDS

    outcomes, covered = [], {kind: set() for kind in PATHS}
    mix = bodies(seed, count, model)
    client = httpx.Client(base_url=server.base_url, timeout=120)
    tpm, chunk = 10**6, 10  # 10 requests per key stay under the test server's spike threshold
    for start in range(0, len(mix), chunk):
        key = client.post("/qwen_ext/admin/keys", headers=auth(ADMIN), json={
            "name": f"{name}-{start}", "tpm": tpm, "rpm": 100000, "max_tokens_cap": 4}).json()
        began, used = time.monotonic(), 0
        for kind, body in mix[start:start + chunk]:
            covered[kind] |= fields_set(body, FIELDS[kind])
            r = client.post(PATHS[kind], headers=auth(key["key"]), json=body)
            error = r.json().get("error") if r.status_code != 200 else None
            outcomes.append((kind, body, r.status_code, error.get("code") if error else None))
            if r.status_code == 200:
                prompt, total = usage_counts(kind, r)
                assert int(r.headers["x-qwen-prompt-tokens"]) == prompt, (kind, body, r.json()["usage"])
                assert total <= int(r.headers["x-qwen-reserved-tokens"]), (kind, body, r.json()["usage"])
                used += total
            elif error.get("code") == "unsupported_parameter":
                assert r.status_code == 400 and error["param"], r.text
        time.sleep(0.3)  # the last reconciliation
        probe = chat(client, key["key"], max_tokens=1, model=model)
        assert time.monotonic() - began < 55, "a chunk outlived the 60 s window: the sum below would be wrong"
        assert int(probe.headers["x-ratelimit-remaining-tokens"]) == \
            tpm - used - int(probe.headers["x-qwen-reserved-tokens"]), (name, start)
    return outcomes, covered


@pytest.fixture(scope="module")
def gw_stock(gw_servers):
    """The gateway on the model's own (official Qwen3) chat template instead of the KV-reuse one."""
    server = gw_servers["stock"]
    server.wait_healthy()
    return server, server.data_dir


@pytest.mark.parametrize("template", ["qwen3-reuse", "qwen3"])
def test_field_coverage_admission_count_equals_engine_count(request, template):
    """Hundreds of seeded requests over every field that changes the prompt or the reservation, on both
    templates and every metered route: admitted -> reserved prompt == engine prompt tokens, charge == usage;
    refused -> a named 400."""
    from qwen_vllm_ext.gateway.request_fields import NONE, FIELDS
    from qwen_vllm_ext.gateway.vllm_requests import request_fields

    server, _ = request.getfixturevalue("gw" if template == "qwen3-reuse" else "gw_stock")
    health = httpx.get(server.base_url + "/qwen_ext/health", timeout=30).json()
    assert health["kv_reuse"]["reuse_template"] is (template == "qwen3-reuse")
    outcomes, covered = run_field_mix(server, seed=18 + len(template), count=450, name=f"mix-{template}")
    for kind, fields in request_fields().items():  # derived from vLLM's request models themselves
        assert fields <= set(FIELDS[kind]), f"{kind}: vLLM request fields the gateway does not classify"
        wanted = {f for f, handling in FIELDS[kind].items() if handling != NONE and f in fields}
        assert wanted <= covered[kind], f"{kind}: fields the mix never sets: {sorted(wanted - covered[kind])}"
    for kind in FIELDS:
        mine = [o for o in outcomes if o[0] == kind]
        admitted = [o for o in mine if o[2] == 200]
        assert len(admitted) >= 0.6 * len(mine), (kind, len(admitted), len(mine))
    assert any(o[3] == "unsupported_parameter" for o in outcomes)
    other = [o for o in outcomes if o[2] != 200 and o[3] != "unsupported_parameter"]
    assert all(o[2] == 400 for o in other), other  # vLLM's own 400s (e.g. tool_choice auto without a parser)
