"""E2E: the client SDK and TokenStorm against the demo server with the gateway and the SQLite ledger on.

* real streams recorded from the server parse to the same events when re-chunked at every byte boundary;
* the SDK sends X-Request-ID (the server echoes it), exposes usage per chunk, maps errors to typed exceptions;
* short bounded TokenStorm runs (open loop with a TPM limit that denies part of the load; closed-loop multi-turn
  sessions) report zero accounting mismatches (ledger included) and zero header-honesty violations.
"""
import json
import subprocess
import sys
import time

import httpx
import pytest

from qwen_vllm_ext.client import AuthenticationError, Client, NO_RETRIES, RateLimitError, SSEParser, StreamDecoder
from qwen_vllm_ext.demo import SERVED_NAME
from qwen_vllm_ext.usage.metrics import TOTALS_EVERY_S
from qwen_vllm_ext.usage.reconcile import parse_counters

from ..helpers.gateway import ADMIN, make_key
from ..redis_server import RedisServer
from .servers import early_then_stopped, gateway_server


EARLY_GB = 7  # two servers, one with two API-server processes


def start_early(tmp_path_factory) -> dict:
    """The module's servers, started together (their start-ups overlap); the spike breaker off on both (a load
    test is a spike by design)."""
    redis = RedisServer().start()
    return {"redis": redis,
            "storm-redis": gateway_server(tmp_path_factory, "storm-redis", (
                "--api-server-count", "2", "--qwen-ledger-backend", "redis", "--qwen-ledger-redis-url", redis.url,
                "--qwen-limiter-backend", "redis", "--qwen-spike-factor", "0")),
            "storm": gateway_server(tmp_path_factory, "storm", extra=["--qwen-spike-factor", "0"])}


@pytest.fixture(scope="module")
def storm_servers(request):
    yield from early_then_stopped(request, start_early)


def test_token_storm_on_two_api_servers_sharing_redis(storm_servers, tmp_path):
    """Ledger and limiter in Redis, two API-server processes: zero mismatches against the Redis ledger, zero
    header violations, zero overshoot of the shared TPM limit under concurrency."""
    redis, server = storm_servers["redis"], storm_servers["storm-redis"]
    data = server.data_dir
    try:
        server.wait_healthy()
        key = make_key(data, "--name", "storm-redis", "--tpm", "5000", "--rpm", "1000",
                       redis_url=redis.url)["secret"]
        rep, out = run_storm(server, data, key, tmp_path, "--distribution", "normal", "--input-len", "120",
                             "--output-len", "20", "--concurrency", "16", "--num-requests", "80",
                             "--duration", "40", "--ledger", redis.url)
        time.sleep(TOTALS_EVERY_S + 1)  # the ledger totals gauge is refreshed on a timer
        scrapes = [httpx.get(server.base_url + "/metrics", timeout=30).text for _ in range(6)]
        instance = httpx.get(server.base_url + "/qwen_ext/health", timeout=30,
                             headers={"Authorization": f"Bearer {ADMIN}"}).json()["instance_id"]
        from qwen_vllm_ext.usage.ledger import RedisLedgerStore

        store = RedisLedgerStore(redis.url)
        ledger_tokens, ledger_records = store.instance_tokens(instance), store.totals(instance)["requests"]
        store.close()
    finally:
        server.stop()
    # /metrics with two API-server processes (prometheus_client multiprocess mode): the extension's collectors are
    # there whichever process answers, and the per-process counters aggregate
    for text in scrapes:
        samples = parse_counters(text, ["qwen_ext_build_info", "qwen_ext_ledger_records_total",
                                        "qwen_ext_gateway_admissions_total"])
        assert samples["qwen_ext_build_info"] == 1
        assert samples["qwen_ext_ledger_records_total"] == ledger_records
        assert samples["qwen_ext_gateway_admissions_total"] == rep["throughput"]["completed"]
        assert f'qwen_ext_ledger_instance_tokens{{kind="completion"}} {float(ledger_tokens["completion_tokens"])}' in text
        assert "qwen_ext_runtime_patch_active{" in text
    assert rep["accounting"]["mismatches"] == [] and rep["accounting"]["ledger_checked"]
    hh = rep["header_honesty"]
    assert hh["violations"] == [] and hh["overshoot"]["overshoot_tokens"] == 0, out
    assert 10 <= rep["throughput"]["completed"] < 80 and set(rep["errors"]) == {"429 rate_limit_exceeded"}
    assert hh["overshoot"]["max_admitted_tokens"] <= 5000


@pytest.fixture(scope="module")
def storm_gw(storm_servers):
    server = storm_servers["storm"]
    server.wait_healthy()
    return server, server.data_dir


def record_stream(server, secret, path, body) -> bytes:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        with c.stream("POST", path, headers={"Authorization": f"Bearer {secret}"}, json=body) as r:
            assert r.status_code == 200, r.read()
            return b"".join(r.iter_raw())


def parse(raw: bytes, cuts):
    p = SSEParser()
    out, pos = [], 0
    for c in [*cuts, len(raw)]:
        out += [(e.event, e.data) for e in p.feed(raw[pos:c])]
        pos = c
    p.close()
    return out


def test_recorded_streams_parse_identically_at_every_byte_boundary(storm_gw):
    server, data = storm_gw
    key = make_key(data, "--name", "sse")["secret"]
    msgs = [{"role": "user", "content": "写一句话。Say hi in code: `print('hi')`"}]
    raws = [
        record_stream(server, key, "/v1/chat/completions", {"model": SERVED_NAME, "messages": msgs, "max_tokens": 6,
                                                             "stream": True, "ignore_eos": True}),
        record_stream(server, key, "/v1/chat/completions", {"model": SERVED_NAME, "messages": msgs, "max_tokens": 4,
                                                             "stream": True, "return_token_ids": True}),
        record_stream(server, key, "/v1/completions", {"model": SERVED_NAME, "prompt": "你好, world", "max_tokens": 5,
                                                        "stream": True, "ignore_eos": True}),
    ]
    for raw in raws:
        whole = parse(raw, [])
        assert whole[-1] == ("message", "[DONE]") and len(whole) >= 4
        for i in range(len(raw) + 1):
            assert parse(raw, [i]) == whole, i
        assert parse(raw, list(range(1, len(raw)))) == whole  # one byte per read
        d = StreamDecoder()
        chunks = [c for i in range(0, len(raw), 7) for c in d.feed(raw[i:i + 7])]
        d.close()
        usages = [c.usage for c in chunks]
        assert all(u is not None for u in usages)  # the server's per-chunk usage
        assert chunks[-1].is_usage_only and d.done


def test_sdk_against_the_server(storm_gw):
    server, data = storm_gw
    key = make_key(data, "--name", "sdk", "--tpm", "200", "--rpm", "1000")["secret"]
    with Client(server.base_url, key, retry=NO_RETRIES) as c:
        s = c.chat([{"role": "user", "content": "hi"}], model=SERVED_NAME, stream=True, max_tokens=5,
                   ignore_eos=True, request_id="tsk-e2e-sdk-1")
        chunks = list(s)
        assert s.request_id == "tsk-e2e-sdk-1" and "x-ratelimit-remaining-tokens" in s.headers
        completions = [ch.usage["completion_tokens"] for ch in chunks if ch.usage]
        assert completions == sorted(completions) and s.usage["completion_tokens"] == 5
        with pytest.raises(RateLimitError) as ei:
            c.chat([{"role": "user", "content": "hi"}], model=SERVED_NAME, max_tokens=190)
        assert ei.value.code == "rate_limit_exceeded" and ei.value.request_id
    with Client(server.base_url, "qve-" + "x" * 43, retry=NO_RETRIES) as c, pytest.raises(AuthenticationError) as ei:
        c.chat([{"role": "user", "content": "hi"}], model=SERVED_NAME)
    assert ei.value.status_code == 401 and ei.value.code == "invalid_api_key"


def run_storm(server, data, secret, out, *args):
    ledger = [] if "--ledger" in args else ["--ledger", str(data / "ledger.sqlite3")]
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.bench.token_storm", "--base-url", server.base_url,
                           "--model", SERVED_NAME, "--api-key", secret, *ledger,
                           "--output-dir", str(out), "--strict", "--no-progress", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((out / "token_storm.json").read_text())
    assert (out / "token_storm.png").read_bytes()[:4] == b"\x89PNG"
    return rep, proc.stdout


def test_token_storm_open_loop_under_a_tpm_limit_is_clean(storm_gw, tmp_path):
    server, data = storm_gw
    key = make_key(data, "--name", "storm-open", "--tpm", "6000", "--rpm", "1000")["secret"]
    rep, out = run_storm(server, data, key, tmp_path, "--distribution", "long_tail", "--input-len", "150",
                         "--tail-max", "1500", "--output-len", "24", "--rate", "20", "--num-requests", "60",
                         "--duration", "30", "--seed", "7", "--field-mix", "0.6")
    acc, hh = rep["accounting"], rep["header_honesty"]
    # the workload carries prompt-changing fields and n=2 (issue 18): counts and costs still agree
    assert {r["n"] for r in rep["records"]} == {1, 2}
    assert acc["ledger_checked"] and acc["mismatches"] == [], acc["mismatches"]
    assert hh["violations"] == [] and hh["denials_checked"] > 0, out
    assert hh["overshoot"]["overshoot_tokens"] == 0 and hh["overshoot"]["limit_tokens"] == 6000
    tp = rep["throughput"]
    assert tp["requests"] == 60 and 10 <= tp["completed"] < 60
    assert set(rep["errors"]) == {"429 rate_limit_exceeded"}
    assert rep["latency"]["ttft_s"]["n"] == tp["completed"] and rep["latency"]["itl_s"]["p99"] is not None
    assert "0 mismatches" in out and "0 violations" in out


def test_token_storm_multi_turn_closed_loop_is_clean(storm_gw, tmp_path):
    server, data = storm_gw
    key = make_key(data, "--name", "storm-turns")["secret"]
    rep, _ = run_storm(server, data, key, tmp_path, "--distribution", "normal", "--input-len", "300",
                       "--output-len", "16", "--concurrency", "4", "--turns", "3", "--num-requests", "12",
                       "--duration", "60", "--slo-ttft-ms", "5000")
    assert rep["throughput"]["completed"] == 12 and rep["errors"] == {}
    assert rep["accounting"]["mismatches"] == [] and rep["accounting"]["checked_requests"] == 12
    turns = sorted((r["session"], r["turn"], r["prompt_tokens_calc"]) for r in rep["records"])
    for (s1, t1, p1), (s2, t2, p2) in zip(turns, turns[1:]):
        if s1 == s2:
            assert t2 == t1 + 1 and p2 > p1 + 16  # the history grows with every turn
