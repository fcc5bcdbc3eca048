"""E2E conformance: serving as an OpenRouter provider (issue 36), one test per requirement, against one real server.

The server: the Qwen3.6-family demo (hybrid attention, reasoning and tool parsers) with the gateway, ``openrouter=true``,
prices ($0.15 / $0.60 per million prompt / completion tokens, cache reads $0.075, $0.0001 per request),
SSE keep-alives every 0.1 s and capacity 429s above 1 s of expected queue wait.
"""
import json
import os
import subprocess
import sys
from decimal import Decimal

import httpx
import pytest

from qwen_v3_calculator.billing import PICO, Prices
from qwen_vllm_ext.demo import HYBRID_SERVED_NAME as MODEL
from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

from ..helpers.gateway import barrier_burst, make_key
from .servers import Server, early_then_stopped

PRICES = {"price_prompt": "0.15", "price_completion": "0.6", "price_cache_read": "0.075", "price_request": "0.0001"}
EXPECTED = Prices.per_million("0.15", "0.6", "0.075", "0.0001")
PRICE_PATTERN = r"^\d+(\.\d+)?$"
MAX_WAIT_S = 3.0  # refuses the capacity test's burst (tens of seconds of queue), not a token storm on a busy host
LONG = "hello world " * 1500  # ~3,000 prompt tokens: a prefill long enough for keep-alives and a queue


EARLY_GB = 6.5  # two servers


def start_early(tmp_path_factory) -> dict:
    """The provider server, and one whose listing would not describe its engine (the qwen3 demo runs float32
    weights; the setting says fp8), started together: the second's start-up, which ends in the refusal, overlaps
    the first's."""
    tmp = tmp_path_factory.mktemp("refused")
    refused = Server(["--qwen-openrouter", "true", "--qwen-price-prompt", "0.1", "--qwen-listing-quantization", "fp8"],
                     tmp / "refused.log", data_dir=tmp / "data")
    flags = [f for name, value in PRICES.items() for f in (f"--qwen-{name.replace('_', '-')}", value)]
    provider = Server(["--model", MODEL, "--qwen-gateway", "true",  # the spike breaker at its defaults
                       "--qwen-openrouter", "true", *flags, "--qwen-sse-keepalive-s", "0.1",
                       "--qwen-max-queue-wait-s", str(MAX_WAIT_S)],
                      tmp_path_factory.mktemp("logs") / "provider.log", data_dir=tmp_path_factory.mktemp("provider"))
    return {"refused": refused, "provider": provider}


@pytest.fixture(scope="module")
def started(request):
    yield from early_then_stopped(request, start_early)


@pytest.fixture(scope="module")
def refused_server(started):
    return started["refused"]


@pytest.fixture(scope="module")
def provider(started):
    server = started["provider"]
    server.wait_healthy()
    key = make_key(server.data_dir, "--name", "openrouter", "--no-spike-breaker")["secret"]  # as docs/openrouter.md
    with httpx.Client(base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as client:
        yield server, server.data_dir, key, client


def listing(client, fmt):
    r = client.get("/v1/models", params={"format": fmt})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def ledger(data):
    return SqliteLedgerStore(str(data / "ledger.sqlite3"))


# ---- 1. the listing ----------------------------------------------------------------------------------------------
def test_listing_current_format_describes_the_engine(provider):
    _, _, _, client = provider
    engine = {m["id"]: m for m in client.get("/v1/models").json()["data"]}[MODEL]  # vLLM's own listing
    entry, = listing(client, "openrouter")
    assert entry["schema_version"] == "2.4" and entry["id"] == MODEL and entry["name"] == MODEL
    assert entry["quantization"] == "bf16"  # the hybrid demo runs unquantized bfloat16 on the CPU build
    assert entry["tokenizer"] == "Qwen3.5"
    text_in, = entry["input_modalities"]
    assert text_in["supported_inputs"]["max_context_length"]["value"] == engine["max_model_len"]
    prices = {p["type"]: p["cost_usd"] for p in text_in["pricing"]}
    assert prices == {"prompt": "0.00000015", "cached_prompt": "0.000000075"}
    out, = entry["output_modalities"]
    assert {p["type"]: p["cost_usd"] for p in out["pricing"]} == {"completion": "0.0000006",
                                                                 "internal_reasoning": "0.0000006"}
    assert entry["pricing"] == [{"type": "request", "unit": "request", "cost_usd": "0.0001"}]
    for p in (*text_in["pricing"], *out["pricing"], *entry["pricing"]):
        assert __import__("re").match(PRICE_PATTERN, p["cost_usd"]), p
    assert {"temperature", "top_p", "max_tokens", "seed", "stop"} <= set(out["supported_parameters"])
    assert {"tools", "structured_outputs", "reasoning"} <= set(out["supported_parameters"])


def test_listing_legacy_format(provider):
    _, _, _, client = provider
    entry, = listing(client, "openrouter-legacy")
    assert entry["pricing"] == {"prompt": "0.00000015", "completion": "0.0000006", "image": "0", "request": "0.0001",
                                "input_cache_read": "0.000000075"}
    assert entry["context_length"] == entry["max_output_length"] == 16384 and entry["quantization"] == "bf16"
    assert entry["supported_features"] == ["tools", "json_mode", "structured_outputs", "reasoning"]


def test_listing_is_scoped_and_bad_requests_get_clear_errors(provider):
    server, data, _, client = provider
    other = make_key(data, "--name", "other-model-only", "--models", "some-other-model")["secret"]
    for fmt in ("openrouter", "openrouter-legacy"):
        r = httpx.get(server.base_url + "/v1/models", params={"format": fmt},
                      headers={"Authorization": f"Bearer {other}"}, timeout=30)
        assert r.status_code == 200 and r.json()["data"] == []  # a key scoped to another model does not see this one
    r = httpx.get(server.base_url + "/v1/models", params={"format": "openrouter"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.get("/v1/models", params={"format": "huggingface"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "format"
    assert "openrouter-legacy" in r.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL  # no format: vLLM's listing, unchanged


# ---- 2. usage on every response --------------------------------------------------------------------------------
def check_usage(usage):
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert isinstance(usage["completion_tokens_details"]["reasoning_tokens"], int)


def test_usage_on_every_response_without_opting_in(provider):
    _, data, _, client = provider
    body = {"model": MODEL, "messages": [{"role": "user", "content": "usage please"}], "max_tokens": 8}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    check_usage(r.json()["usage"])
    assert r.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8  # the demo thinks first
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:  # no stream_options
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        rid = s.headers["x-request-id"]
    final = events[-1]
    assert final["choices"] == [] and all("usage" in e for e in events)
    check_usage(final["usage"])
    # non-streamed chat and completions: the same complete usage, with cost (issue 46)
    full = {"chat": (r.headers["x-request-id"], r.json()["usage"])}
    c = client.post("/v1/completions", json={"model": MODEL, "prompt": "usage please", "max_tokens": 5})
    assert c.status_code == 200
    full["completion"] = (c.headers["x-request-id"], c.json()["usage"])
    store = ledger(data)
    record = store.get(rid)
    full_records = {kind: store.get(full_rid) for kind, (full_rid, _) in full.items()}
    store.close()
    assert Decimal(repr(final["usage"]["cost"])) * PICO == record.cost_pico_usd == EXPECTED.cost_pico(
        final["usage"]["prompt_tokens"], final["usage"]["completion_tokens"],
        final["usage"]["prompt_tokens_details"]["cached_tokens"])
    for kind, (_, usage) in full.items():
        rec = full_records[kind]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) \
            == (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens), kind
        assert Decimal(repr(usage["cost"])) * PICO == rec.cost_pico_usd > 0, kind
        assert Decimal(usage["billing"]["cost_usd"]) == Decimal(repr(usage["cost"])), kind
    assert full["chat"][1]["completion_tokens_details"]["reasoning_tokens"] == full_records["chat"].reasoning_tokens


# ---- 3. each listed feature, exercised once --------------------------------------------------------------------
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
FEATURE_REQUESTS = {
    "tools": {"max_tokens": 40, "tool_choice": "required", **NO_THINK,
              "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                  "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                  "required": ["city"]}}}]},
    "json_mode": {"max_tokens": 40, "response_format": {"type": "json_object"}, **NO_THINK},
    "structured_outputs": {"max_tokens": 20, **NO_THINK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}}},
    "reasoning": {"max_tokens": 12},
}


def check_feature(feature, response):
    message, usage = response["choices"][0]["message"], response["usage"]
    if feature == "tools":
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    elif feature == "json_mode":
        # the grammar constrains every token, but a random-weight model may still be inside a JSON string when
        # max_tokens ends it: a finished answer parses, a cut one is the start of an object
        if response["choices"][0]["finish_reason"] == "stop":
            json.loads(message["content"])
        else:
            assert response["choices"][0]["finish_reason"] == "length" and message["content"].lstrip().startswith("{")
    elif feature == "structured_outputs":
        assert json.loads(message["content"]) in ("yes", "no")
    else:
        assert message["reasoning"] and usage["completion_tokens_details"]["reasoning_tokens"] == 12


def test_every_listed_feature_is_exercised(provider):
    _, _, _, client = provider
    features = listing(client, "openrouter-legacy")[0]["supported_features"]
    assert set(features) == set(FEATURE_REQUESTS)  # nothing listed that this test does not exercise
    for feature in features:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": f"{feature}: weather in Paris?"}], **FEATURE_REQUESTS[feature]})
        assert r.status_code == 200, (feature, r.text)
        check_feature(feature, r.json())


# ---- 4. prices and ledger agree ---------------------------------------------------------------------------------
def test_prices_and_ledger_agree_over_a_token_storm_run(provider, tmp_path):
    server, data, key, _ = provider
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.bench.token_storm", "--base-url", server.base_url,
                           "--model", MODEL, "--api-key", key, "--ledger", str(data / "ledger.sqlite3"),
                           "--check-prices", "--output-dir", str(tmp_path), "--strict", "--no-progress", "--no-plot",
                           "--distribution", "normal", "--input-len", "200", "--output-len", "16", "--turns", "3",
                           "--concurrency", "4", "--num-requests", "24", "--duration", "240", "--seed", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((tmp_path / "token_storm.json").read_text())
    acc = rep["accounting"]
    assert acc["prices_checked"] and acc["ledger_checked"] and acc["mismatches"] == [], acc["mismatches"]
    assert acc["checked_requests"] == rep["throughput"]["completed"] >= 20
    ids = [r["request_id"] for r in rep["records"] if r["status"] == "ok"]
    store = ledger(data)
    records = [store.get(i) for i in ids]
    store.close()
    assert sum(r.cached_tokens for r in records) > 0  # later turns read the cache: priced at input_cache_read


# ---- 5. keep-alives -----------------------------------------------------------------------------------------------
def test_keepalive_comments_fill_a_long_prefill_and_change_no_accounting(provider):
    server, data, key, client = provider
    body = {"model": MODEL, "messages": [{"role": "user", "content": "keepalive " + LONG}], "max_tokens": 4,
            "stream": True, **NO_THINK}
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        lines = [line for line in s.iter_lines() if line]
        rid = s.headers["x-request-id"]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data >= 1 and set(lines[:first_data]) == {": keep-alive"}  # comments while the prompt prefilled
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    store = ledger(data)
    record = store.get(rid)
    store.close()
    usage = events[-1]["usage"]
    assert (record.prompt_tokens, record.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    # the openai SDK reads the same kind of stream (comments included) without noticing them
    import openai

    sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=300)
    chunks = list(sdk.chat.completions.create(model=MODEL, max_tokens=4, stream=True, extra_body=NO_THINK,
                                              messages=[{"role": "user", "content": "keepalive sdk " + LONG}]))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []


# ---- 6. capacity 429s ----------------------------------------------------------------------------------------------
def burst(server, key, n, tag):
    """n prompts of ~3,000 tokens released at once."""
    return barrier_burst(server, key, n, request=lambda c, i: c.post(
        "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": f"{tag} {i} {LONG}"}], "max_tokens": 4,
              **NO_THINK}))


def test_capacity_429s_refuse_early_and_charge_nothing(provider):
    server, data, key, client = provider
    for wave in range(3):  # measure the drain rate: a few seconds of busy engine (the rate may already be known)
        assert all(r.status_code in (200, 429) for r in burst(server, key, 6, f"warm{wave}"))
    results = burst(server, key, 30, "burst")
    refused = [r for r in results if r.status_code == 429]
    assert len(refused) + sum(r.status_code == 200 for r in results) == 30
    assert refused and len(refused) < 30, [r.status_code for r in results]
    for r in refused:
        error = r.json()["error"]
        assert error["code"] == "capacity_exceeded" and error["type"] == "requests" and "retry after" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert "x-qwen-prompt-tokens" not in r.headers  # refused before admission counted or reserved anything
    store = ledger(data)
    records = [store.get(r.headers["x-request-id"]) for r in refused]
    store.close()
    for record in records:  # each refusal has its record; nothing billed, the engine never saw it
        assert record.http_status == 429 and record.status == "error"
        assert (record.prompt_tokens, record.completion_tokens, record.cost_pico_usd, record.billed_total_micro) == \
            (0, 0, 0, 0)
    gauge = [line for line in client.get("/metrics").text.splitlines()
             if line.startswith("qwen_ext_expected_queue_wait_seconds ")]
    assert gauge and float(gauge[0].split()[1]) >= 0


# ---- 7. start-up refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, setting", [
    (["--qwen-openrouter", "true", "--qwen-price-prompt", "0.15", "--qwen-price-completion", "1e-6"],
     "price_completion"),
    (["--qwen-openrouter", "true", "--qwen-price-prompt", "0.1234567"], "price_prompt"),
    (["--qwen-openrouter", "true"], "price_prompt"),
    (["--qwen-max-queue-wait-s", "2"], "max_queue_wait_s"),
    (["--qwen-openrouter", "true", "--qwen-price-prompt", "0.1", "--qwen-listing-context-length", "5000"],
     "listing_context_length"),  # the CPU profile's --max-model-len is 4096
])
def test_launcher_refuses_bad_provider_settings(flags, setting):
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.serve", *flags, "--print-command"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"setting '{setting}'" in proc.stderr.replace("settings '", "setting '"), \
        proc.stderr


def test_server_refuses_a_listing_that_does_not_describe_the_engine(refused_server):
    """The API server checks the listing against the engine it runs: the qwen3 demo runs float32 weights."""
    refused_server.proc.wait(timeout=600)
    log = refused_server.log_tail(200)
    assert refused_server.proc.returncode != 0
    assert "setting 'listing_quantization': the engine runs unquantized torch.float32 weights, which is not 'fp8'" in log


# ---- 8. the doctor on a live provider -------------------------------------------------------------------------------
def test_doctor_checks_the_listing_and_the_usage_fields(provider):
    server, _, key, _ = provider
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.doctor", "--url", server.base_url, "--api-key", key,
                           "--json"], capture_output=True, text=True, timeout=600)
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["openrouter: listing"]["status"] == "PASS", checks["openrouter: listing"]
    assert "0.00000015" in checks["openrouter: listing"]["seen"]
    assert checks["openrouter: usage"]["status"] == "PASS", checks["openrouter: usage"]
    assert "openrouter: keep-alives" not in checks and "openrouter: early 429s" not in checks  # both are set here
    # issue 47: the page followed top to bottom, the doctor included, leaves the key active and the doctor without FAIL
    assert not [c for c in checks.values() if c["status"] == "FAIL"], [c for c in checks.values()
                                                                        if c["status"] == "FAIL"]
    assert checks["api key"]["status"] == "PASS" and checks["gateway: limits"]["status"] == "PASS", checks
    shown = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", "list", "--json"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "QWEN_VLLM_EXT_DATA_DIR": str(server.data_dir)})
    keys = {k["name"]: k for k in json.loads(shown.stdout)}
    assert keys["openrouter"]["status"] == "active" and keys["openrouter"]["spike_breaker"] is False
