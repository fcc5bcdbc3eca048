"""E2E: the in-server gateway on the demo server — keys, exact reserve-and-reconcile limits, budgets, headers,
spike breaker, clean errors for bad input; on SQLite, and with two API-server processes sharing Redis."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from qwen_vllm_ext.demo import SERVED_NAME

from ..helpers.gateway import ADMIN, HI, auth, barrier_burst, chat, make_key, run_field_mix
from ..redis_server import RedisServer
from .servers import early_then_stopped, gateway_server

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
    public = client.get("/qwen_ext/health").json()  # public route: no pids, paths, instance id or settings values
    assert "processes" not in public and "instance_id" not in public and "launch" not in public
    assert public["settings"]["gateway"] is True and "data_dir" not in public["settings"] and "details" in public
    assert "admin_key" not in public["settings"] and ADMIN not in json.dumps(public)
    full = client.get("/qwen_ext/health", headers={"Authorization": f"Bearer {ADMIN}"}).text  # the admin sees every setting, secrets masked
    assert ADMIN not in full and '"admin_key": "***"' in full.replace('":"', '": "') and '"instance_id"' in full


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
    """A key with a previous day of history (backdated in the real key store) whose 15-minute use passes the floor
    (this server: 400 units; its previous day: nothing) is suspended: 403 api_key_suspended with the time it lifts
    and Retry-After; `keys update --unsuspend` lifts it. A new key doing the same is never checked."""
    import dataclasses

    from qwen_vllm_ext.keys.stores import SqliteKeyStore

    server, data = gw
    key = make_key(data, "--name", "spiky")
    fresh = make_key(data, "--name", "fresh")
    store = SqliteKeyStore(str(data / "ledger.sqlite3"))
    store._mutate(key["key"]["key_id"], lambda k: dataclasses.replace(k, created_at=k.created_at - 3 * 86400))
    client = httpx.Client(base_url=server.base_url, timeout=120)
    # threshold: max(10 x baseline 0, floor 400 units, no limits) = 400 units per 15 min; each request ~ 279 units
    codes = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = chat(client, key["secret"], max_tokens=200)
        codes.append(r.status_code)
        if r.status_code == 403:
            error = r.json()["error"]
            assert error["code"] == "api_key_suspended" and error["type"] == "permission_error"
            assert "suspended until 20" in error["message"] and "usage spike" in error["message"]
            assert 800 <= int(r.headers["retry-after"]) <= 900
            break
        time.sleep(0.2)
    assert codes[-1] == 403 and 2 <= codes.index(403) <= 8, codes
    metrics = client.get("/metrics").text
    assert "qwen_ext_keys_suspended_total 1.0" in metrics
    assert all(chat(client, fresh["secret"], max_tokens=200).status_code == 200 for _ in range(5))
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", "update", key["key"]["key_id"], "--unsuspend"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "QWEN_VLLM_EXT_DATA_DIR": str(data)})
    assert proc.returncode == 0 and re.search(r"status\s+active", proc.stdout), proc.stdout + proc.stderr
    time.sleep(1.2)  # the key cache reads the store's version at most every 0.5 s
    assert chat(client, key["secret"], max_tokens=1).status_code == 200


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
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "reconcile", "--url", server.base_url,
                           "--admin-key", ADMIN], capture_output=True, text=True, timeout=60)
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


# ---- issue 45: nothing a client sends takes the server down or poisons the ledger ------------------------------------
FUZZ_PER_FIELD = None if os.environ.get("QWEN_VLLM_EXT_FUZZ_PER_FIELD") == "all" else int(
    os.environ.get("QWEN_VLLM_EXT_FUZZ_PER_FIELD", "3"))
"""Hostile values per request field in the abuse suite (``all``: every value of tests/hostile.py, ~5,000 requests)."""

FLOOD = int(os.environ.get("QWEN_VLLM_EXT_ABUSE_FLOOD", "4000"))
"""Hostile requests in the abuse suite's flood (the default keeps it to ~15 s; 10,000: ~38 s here)."""


def test_abuse_suite_keeps_the_server_healthy_the_ledger_exact_and_metrics_bounded(gw):
    """FLOOD hostile requests (distinct model names from a scoped and an unscoped key, keyless requests with
    client-chosen ids, the probe's lone-surrogate model) and every request field, header and admin field set to
    hostile values: each ends in a 4xx or a 200, never a 5xx; the server stays healthy; /metrics stays parseable and
    under 1 MB with no client string as a label; no record carries a client's model name or an unauthenticated
    client's ids; the ledger still equals the engine's counters."""
    import asyncio
    import sqlite3

    from prometheus_client.parser import text_string_to_metric_families

    from ..hostile import ADMIN_FIELDS, HEADERS, admin_cases, encode, field_cases

    server, data = gw
    scoped = make_key(data, "--name", "abuse-scoped", "--models", "some-other-model")["secret"]
    open_key = make_key(data, "--name", "abuse-open", "--rpm", "1000000")["secret"]
    started = time.time()

    async def flood():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
            gate = asyncio.Semaphore(32)

            async def one(i):
                kind = i % 4
                headers = {"content-type": "application/json"}
                if kind == 0:    # a key scoped elsewhere naming a new model each time: 403
                    headers["authorization"] = f"Bearer {scoped}"
                elif kind == 1:  # an unscoped key naming a model the server does not serve: vLLM's 404
                    headers["authorization"] = f"Bearer {open_key}"
                elif kind == 2:  # no key, client-chosen ids: 401
                    headers.update({"x-request-id": f"attacker-{i}", "x-session-id": f"attacker-session-{i}"})
                else:            # the probe's poison: a lone surrogate as the model, with a valid key
                    headers["authorization"] = f"Bearer {scoped if i % 8 == 3 else open_key}"
                model = "\ud800" if kind == 3 else f"model-{i}-\u00e9"
                body = encode({"model": model, "messages": HI, "max_tokens": 2, "user": f"user-{i}"})
                async with gate:
                    try:
                        r = await client.post("/v1/chat/completions", headers=headers, content=body)
                    except (httpx.ReadError, httpx.RemoteProtocolError):
                        # the keep-alive race: the server closed an idle pooled connection as the client reused it
                        # (a starved client on 2 cores); counted and bounded below, sent again on a new connection
                        races.append(i)
                        r = await client.post("/v1/chat/completions", headers=headers, content=body)
                return kind, r.status_code, r.json()["error"]["code"]

            return await asyncio.gather(*(one(i) for i in range(FLOOD)))

    races: list[int] = []
    outcomes = asyncio.run(flood())
    assert len(races) <= max(10, FLOOD // 1000), f"{len(races)} of {FLOOD} requests lost their connection"
    flood_s = time.time() - started
    fuzz_started = time.monotonic()
    expected = {0: (403, "model_not_allowed"), 2: (401, "invalid_api_key"), 3: (400, "invalid_value")}
    for kind, status, code in outcomes:
        if kind == 1:
            assert status == 404, (kind, status, code)
        else:
            assert (status, code) == expected[kind], (kind, status, code)

    client = httpx.Client(base_url=server.base_url, timeout=120)
    # every request field set to hostile values (a fresh key every 40 requests: the test server's spike threshold)
    statuses = []
    for kind, path, base in (("chat", "/v1/chat/completions", {"model": SERVED_NAME, "messages": HI, "max_tokens": 2}),
                             ("completion", "/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2})):
        for i, (field, value, body) in enumerate(field_cases(kind, base, seed=45, per_field=FUZZ_PER_FIELD)):
            if i % 40 == 0:
                secret = make_key(data, "--name", f"fuzz-{kind}-{i}")["secret"]
            try:
                r = client.post(path, headers={**auth(secret), "content-type": "application/json"},
                                content=encode(body))
            except httpx.TransportError as exc:  # the server dropped the connection: as bad as a 5xx
                statuses.append((field, repr(value)[:40], 599, repr(exc)))
                continue
            statuses.append((field, repr(value)[:40], r.status_code, r.text[:200]))
    for name, values in HEADERS.items():
        for value in values:
            headers = {**auth(open_key), "content-type": "application/json", name: value.encode("utf-8", "surrogatepass")}
            try:
                r = client.post("/v1/chat/completions", headers=headers, content=encode(
                    {"model": SERVED_NAME, "messages": HI, "max_tokens": 1}))
            except httpx.LocalProtocolError:  # a value HTTP cannot carry (h11 refuses to send it): nothing to test
                continue
            statuses.append((name, repr(value)[:40], r.status_code, r.text[:200]))
    for field, value, body in admin_cases(seed=45, per_field=4):
        r = client.post("/qwen_ext/admin/keys", headers={**auth(ADMIN), "content-type": "application/json"},
                        content=encode(body))
        statuses.append((f"admin.{field}", repr(value)[:40], r.status_code, r.text[:200]))
    failed = [s for s in statuses if s[2] >= 500]
    assert not failed, "\n".join(map(repr, failed))
    assert len({s[0] for s in statuses}) >= len(_request_field_names()) + len(HEADERS) + len(ADMIN_FIELDS) - 1
    # the admin listing still answers: no key was created with a field it cannot show
    assert client.get("/qwen_ext/admin/keys", headers=auth(ADMIN)).status_code == 200

    # healthy, serving, and the ledger equals the engine's counters
    assert client.get("/health").status_code == 200
    assert chat(client, open_key, max_tokens=2).status_code == 200
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and len(metrics.content) < 1 << 20, len(metrics.content)
    families = list(text_string_to_metric_families(metrics.text))
    labels = {v for f in families for s in f.samples for v in s.labels.values()}
    assert not [v for v in labels if v.startswith("model-") or "\ud800" in v or "attacker" in v]
    time.sleep(1.0)  # the last records are committed
    with sqlite3.connect(data / "ledger.sqlite3") as db:
        models = {m for (m,) in db.execute("SELECT DISTINCT model FROM requests WHERE received_at >= ?", (started,))}
        unauth = db.execute("SELECT request_id, conversation_id FROM requests WHERE http_status = 401 AND "
                            "received_at BETWEEN ? AND ?", (started, started + flood_s)).fetchall()
    assert models <= {SERVED_NAME, ""}, sorted(models)[:10]
    assert 1 <= len(unauth) <= flood_s * 1.0 + 2, (len(unauth), flood_s)  # unauthenticated_records_per_s = 1
    assert all(rid.startswith("unauth-") and conv is None for rid, conv in unauth)
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "reconcile", "--url", server.base_url],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "QWEN_VLLM_EXT_ADMIN_KEY": ADMIN})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"abuse suite: {FLOOD} hostile requests in {flood_s:.1f} s, {len(statuses)} fuzzed fields in "
          f"{time.monotonic() - fuzz_started:.1f} s, "
          f"/metrics {len(metrics.content)} bytes")


def test_every_request_field_alone_and_in_mixed_batches_keeps_the_engine_up(gw):
    """Issue 46: every field vLLM's request models accept, alone and mixed in concurrent batches (tests/e2e/
    field_sweep.py): a 200 or a 400 naming the field, never a 5xx or a dropped connection; the engine stays up."""
    from .field_sweep import sweep

    server, _ = gw

    def new_key():
        return httpx.post(server.base_url + "/qwen_ext/admin/keys", headers=auth(ADMIN), timeout=60,
                          json={"name": "field-sweep", "rpm": 100000, "tpm": 10**8}).json()["key"]

    print(sweep(server.base_url, new_key, SERVED_NAME, per_key=25))


def test_every_error_of_every_route_has_the_one_shape(gw):
    """Issue 47: the gateway's errors, vLLM's (unknown model, context overflow, bad token ids, /tokenize), Starlette's
    (unknown route, wrong method) and the admin routes' all come as {"error": {message, type, param, code}} with a
    string code and a type from the documented vocabulary (docs/gateway.md, 'Errors')."""
    from qwen_vllm_ext.common.errors import TYPES

    server, data = gw
    secret = make_key(data, "--name", "errors")["secret"]
    c = httpx.Client(base_url=server.base_url, timeout=120)
    good = {"model": SERVED_NAME, "messages": HI, "max_tokens": 2}
    cases = {
        "no key": ("POST", "/v1/chat/completions", {}, good, 401, "invalid_api_key"),
        "wrong key": ("POST", "/v1/chat/completions", auth("qve-" + "x" * 43), good, 401, "invalid_api_key"),
        "unknown model (vLLM)": ("POST", "/v1/chat/completions", auth(secret), {**good, "model": "gpt-9"}, 404,
                                 "model_not_found"),
        "over the context": ("POST", "/v1/chat/completions", auth(secret), {**good, "max_tokens": 10**6}, 400, None),
        "unknown field": ("POST", "/v1/chat/completions", auth(secret), {**good, "frobnicate": True}, 400,
                          "unknown_parameter"),
        "bad JSON": ("POST", "/v1/chat/completions", auth(secret), b"{not json", 400, None),
        "token id out of the vocabulary (vLLM)": ("POST", "/v1/completions", auth(secret),
                                                  {"model": SERVED_NAME, "prompt": [10**7], "max_tokens": 1}, 400,
                                                  None),
        "unknown route": ("GET", "/v1/nowhere", auth(secret), None, 404, "not_found"),
        "wrong method": ("GET", "/v1/chat/completions", auth(secret), None, 405, "method_not_allowed"),
        "refused route": ("POST", "/v1/responses", auth(secret), {"model": SERVED_NAME, "input": "hi"}, 403, None),
        "bad admin key": ("GET", "/qwen_ext/admin/keys", auth("nope"), None, 401, None),
        "/tokenize without a prompt (vLLM)": ("POST", "/tokenize", auth(secret), {"model": SERVED_NAME}, 400, None),
    }
    seen = {}
    for name, (method, path, headers, body, status, code) in cases.items():
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
        r = c.request(method, path, headers={**headers, "content-type": "application/json"}, **kwargs)
        err = r.json().get("error")
        seen[name] = (r.status_code, err)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        assert isinstance(err, dict) and isinstance(err["message"], str) and err["message"], (name, r.text)
        assert err["type"] in TYPES and isinstance(err["code"], str) and err["code"], (name, err)
        assert err.get("param") is None or isinstance(err["param"], str), (name, err)
        if code:
            assert err["code"] == code, (name, err)
    assert seen["unknown field"][1]["param"] == "frobnicate"
    print({k: (s, e["type"], e["code"]) for k, (s, e) in seen.items()})


def _request_field_names():
    from qwen_vllm_ext.gateway.request_fields import CHAT_FIELDS, COMPLETION_FIELDS

    return set(CHAT_FIELDS) | set(COMPLETION_FIELDS)
