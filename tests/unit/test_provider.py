"""Serving as an OpenRouter provider, the pure parts: prices (exact pico-dollars), the listing (both formats), what
start-up refuses (the setting named), capacity 429s' drain-rate estimate, and the SSE keep-alive layer."""
from __future__ import annotations

import asyncio
import re
from decimal import Decimal

import pytest

from qwen_v3_calculator.billing import PRESETS, PICO, BillingPolicy, Prices, usd
from qwen_vllm_ext.config import Settings, SettingsError
from qwen_vllm_ext.gateway.capacity import Backlog, DrainRate
from qwen_vllm_ext.gateway.request_fields import CHAT_FIELDS, REJECT
from qwen_vllm_ext.provider import listing as L
from qwen_vllm_ext.provider.keepalive import COMMENT, KeepAliveMiddleware

PRICE = re.compile(r"^\d+(\.\d+)?$")  # the aggregator's cost_usd pattern


# ---- prices --------------------------------------------------------------------------------------------------
def test_prices_per_million_are_exact_per_token_strings():
    p = Prices.per_million("0.15", "0.6", "0.075", "0.0002")
    assert p.per_token() == {"prompt": "0.00000015", "completion": "0.0000006", "input_cache_read": "0.000000075",
                             "request": "0.0002"}
    # 700 uncached x 0.15/M + 300 cached x 0.075/M + 200 x 0.6/M + the request price, in whole pico-dollars
    assert p.cost_pico(1000, 200, 300) == 700 * 150_000 + 300 * 75_000 + 200 * 600_000 + 200_000_000
    assert p.cost(1000, 200, 300) * PICO == p.cost_pico(1000, 200, 300)
    assert p.cost_pico(0, 0) == 0  # never reached the engine: not even the request price


def test_cache_read_defaults_to_the_prompt_price():
    p = Prices.per_million("0.2", "1")
    assert p.cache_read_price == p.prompt and p.cost_pico(100, 0, 60) == p.cost_pico(100, 0, 0)


@pytest.mark.parametrize("bad, why", [("1e-3", "plain"), ("-0.1", "plain"), ("0.1234567", "pico-dollars"),
                                      ("abc", "plain"), ("0,1", "plain"), (" ", "plain")])
def test_prices_that_cannot_be_billed_exactly_are_refused_naming_the_setting(bad, why):
    with pytest.raises(SettingsError, match=f"setting 'price_completion'.*{why}"):
        Settings.from_flat({"price_completion": bad})


def test_settings_without_prices_have_none_and_negative_bounds_are_refused():
    assert Settings().prices() is None
    assert Settings.from_flat({"price_request": "0.001"}).prices().request == Decimal("0.001")
    for name in ("max_queue_wait_s", "sse_keepalive_s", "listing_context_length"):
        with pytest.raises(SettingsError, match=name):
            Settings.from_flat({name: -1})


def test_usd_rounds_only_on_export():
    assert usd(247_500_000) == "0.000248" and usd(247_500_000, 12) == "0.000247500000"
    assert usd(2_500_000, 6) == "0.000002" and usd(3_500_000, 6) == "0.000004"  # half-even


def test_context_penalty_cost_is_rounded_half_even_to_a_pico_dollar():
    p, policy = Prices.per_million("0.3", "1"), PRESETS["default"]
    exact = p.cost(40_000, 10, policy=policy)
    assert exact != exact.to_integral_value() and p.cost_pico(40_000, 10, policy=policy) == round(exact * PICO)


def test_flat_problem_names_what_the_listing_cannot_express():
    assert PRESETS["default"].flat_problem(32768) is None
    assert "context penalty" in PRESETS["default"].flat_problem(32769)
    assert "surcharge" in PRESETS["code-surcharge"].flat_problem(100)
    assert "system" in PRESETS["field-report"].flat_problem(100)
    assert BillingPolicy(context_penalty_per_token=0).flat_problem(10**6) is None


# ---- the listing ---------------------------------------------------------------------------------------------
FACTS = L.ModelFacts(id="qwen36-demo", name="Qwen3.6 demo", created=1_700_000_000, context_length=16384,
                     max_output_length=4096, quantization="bf16", tokenizer="Qwen3.5",
                     features=("tools", "json_mode", "structured_outputs", "reasoning"))
PRICES = Prices.per_million("0.15", "0.6", "0.075")


def test_current_format_entry():
    e = L.listing([FACTS], PRICES, "openrouter")["data"][0]
    for field in ("schema_version", "id", "name", "input_modalities", "output_modalities"):  # the required ones
        assert field in e
    assert e["schema_version"] == "2.4" and e["quantization"] == "bf16"
    text_in, = e["input_modalities"]
    assert text_in["supported_inputs"]["max_context_length"] == {"value": 16384, "unit": "token"}
    assert {p["type"]: p["cost_usd"] for p in text_in["pricing"]} == {"prompt": "0.00000015",
                                                                     "cached_prompt": "0.000000075"}
    out, = e["output_modalities"]
    assert out["max_length"] == {"value": 4096, "unit": "token"}
    assert {p["type"]: p["cost_usd"] for p in out["pricing"]} == {"completion": "0.0000006",
                                                                 "internal_reasoning": "0.0000006"}
    params = out["supported_parameters"]
    assert params["max_tokens"] == {"type": "integer", "min": 1, "max": 4096, "unit": "token"}
    assert params["tools"] == params["reasoning"] == params["structured_outputs"] == {"type": "boolean"}
    for entry in (*text_in["pricing"], *out["pricing"]):
        assert PRICE.match(entry["cost_usd"])
    assert "pricing" not in e and e["is_free"] is False  # no request price: no root pricing


def test_legacy_format_entry():
    e = L.listing([FACTS], Prices.per_million("0.15", "0.6", None, "0.001"), "openrouter-legacy")["data"][0]
    assert e["context_length"] == 16384 and e["max_output_length"] == 4096
    assert e["pricing"] == {"prompt": "0.00000015", "completion": "0.0000006", "image": "0", "request": "0.001",
                            "input_cache_read": "0.00000015"}
    assert e["supported_features"] == ["tools", "json_mode", "structured_outputs", "reasoning"]
    assert all(PRICE.match(v) for v in e["pricing"].values())


def test_sampling_parameters_come_from_the_gateway_table():
    names = L.sampling_parameters()
    assert {"temperature", "top_p", "top_k", "seed", "max_tokens", "stop"} <= set(names)
    assert all(CHAT_FIELDS[n] != REJECT for n in names)


def test_features_follow_the_servers_parsers():
    assert L.features(False, False, True) == ("json_mode", "structured_outputs")
    assert L.features(True, True, True) == ("tools", "json_mode", "structured_outputs", "reasoning")
    e = L.entry(L.ModelFacts("m", "m", 0, 100, 100, "fp32"), PRICES)
    assert {p["type"] for p in e["output_modalities"][0]["pricing"]} == {"completion"}


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown listing format"):
        L.listing([FACTS], PRICES, "huggingface")


@pytest.mark.parametrize("method, dtype, bits, wanted, expected", [
    (None, "torch.bfloat16", None, "", "bf16"), (None, "torch.float32", None, "", "fp32"),
    ("fp8", "torch.bfloat16", None, "", "fp8"), ("awq", "torch.float16", 4, "", "int4"),
    ("gptq", "torch.float16", 8, "", "int8"), ("gptq", "torch.float16", None, "int4", "int4"),
    ("compressed-tensors", "torch.bfloat16", None, "fp8", "fp8"),
])
def test_quantization_the_engine_runs(method, dtype, bits, wanted, expected):
    assert L.quantization(method, dtype, bits, wanted) == expected


@pytest.mark.parametrize("method, dtype, wanted, message", [
    (None, "torch.bfloat16", "fp8", "the engine runs unquantized torch.bfloat16 weights, which is not 'fp8'"),
    ("awq", "torch.float16", "fp8", "quantization method 'awq', which is not 'fp8'"),
    (None, "torch.float16", "q4_k_m", "not a listing value"),
    ("compressed-tensors", "torch.bfloat16", "", "cannot tell"),
    ("some_new_method", "torch.bfloat16", "", "cannot tell"),
])
def test_a_quantization_the_server_cannot_report_is_refused(method, dtype, wanted, message):
    with pytest.raises(L.ListingError, match="setting 'listing_quantization'") as exc:
        L.quantization(method, dtype, None, wanted)
    assert message in str(exc.value)


def test_context_and_output_lengths_are_checked_against_the_engine():
    assert L.context_length(4096, 0) == 4096 and L.context_length(4096, 2048) == 2048
    with pytest.raises(L.ListingError, match="setting 'listing_context_length'.*4097.*4096"):
        L.context_length(4096, 4097)
    assert L.max_output(2048, 0) == 2048
    with pytest.raises(L.ListingError, match="setting 'listing_max_output'"):
        L.max_output(2048, 4096)


def test_a_policy_the_listing_cannot_express_is_refused():
    L.check_policy(PRESETS["default"], 32768)
    with pytest.raises(L.ListingError, match="setting 'billing_policy'.*context penalty"):
        L.check_policy(PRESETS["default"], 40960)


# ---- capacity ------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_drain_rate_counts_busy_time_only():
    clock = Clock()
    rate = DrainRate(window_s=60, min_busy_s=2, clock=clock)
    rate.observe(0)
    clock.t = 100.0  # idle: nothing was queued, so these 100 s are not credited
    rate.observe(500)
    assert rate.rate() is None  # no busy time yet
    clock.t = 104.0
    rate.observe(0, finished_tokens=2000)  # 4 busy seconds, 2000 tokens finished
    assert rate.rate() == 500.0
    clock.t = 200.0  # the window slides past every event
    rate.observe(0)
    assert rate.rate() is None


def test_backlog_verdict_and_retry_after():
    clock = Clock()
    queued = {"n": 1000}
    backlog = Backlog(max_wait_s=2.0, queued_tokens=lambda: queued["n"], rate=DrainRate(clock=clock))
    assert backlog.verdict() is None  # no measurement: admit
    clock.t = 4.0
    backlog.finished(2000)  # 4 busy seconds, 2000 tokens: 500 tokens/s
    queued["n"] = 900  # 1.8 s of work ahead: admitted
    assert backlog.verdict() is None
    queued["n"] = 3000  # 6 s ahead, bound 2 s: 429, retry after the 4 s the excess needs to drain
    retry, wait = backlog.verdict()
    assert retry == 4 and wait == pytest.approx(3000 / backlog.rate.rate())


def test_backlog_counts_admitted_requests_until_vllm_adds_them():
    clock = Clock()
    queued = {"n": 0}
    backlog = Backlog(max_wait_s=2.0, queued_tokens=lambda: queued["n"], rate=DrainRate(clock=clock))
    clock.t = 4.0
    backlog.rate.observe(100)
    clock.t = 8.0
    backlog.finished(2000)  # 4 busy seconds: 500 tokens/s
    started = [backlog.admitted(300) for _ in range(3)]  # a burst: admitted, not yet in vLLM's queue
    assert backlog.backlog() == 900 and backlog.verdict() is None  # 1.8 s of work ahead: under the 2 s bound
    backlog.admitted(300)
    assert backlog.verdict() == (1, 2.4)  # 1,200 tokens ahead at 500/s: over the bound
    for s in started:
        s()
        s()  # idempotent: the ledger middleware may fire it again at the end
    assert backlog.pending == 300


# ---- keep-alives ---------------------------------------------------------------------------------------------
def _run(app, interval, method="POST"):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": method, "path": "/v1/chat/completions"}
    asyncio.run(KeepAliveMiddleware(app, interval)(scope, receive, send))
    return [m.get("body") for m in sent if m["type"] == "http.response.body"]


def _sse_app(gaps, content_type=b"text/event-stream"):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    return app


def test_keepalive_comments_fill_silences_only():
    bodies = _run(_sse_app([0.35, 0.01, 0.01]), 0.1)
    first = bodies.index(b"data: 0\n\n")
    assert 2 <= first <= 4 and set(bodies[:first]) == {COMMENT}  # ~3 comments in the 0.35 s silence
    assert bodies[first:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]


def test_keepalive_leaves_json_responses_and_gets_alone():
    assert _run(_sse_app([0.3], content_type=b"application/json"), 0.05).count(COMMENT) == 0
    assert COMMENT not in _run(_sse_app([0.3]), 0.05, method="GET")


def test_keepalive_comments_are_ignored_by_the_client_decoder():
    from qwen_vllm_ext.client.sse import StreamDecoder  # the SDK's decoder, which TokenStorm uses

    chunk = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    plain_stream = StreamDecoder().feed(chunk + b"data: [DONE]\n\n")
    with_comments = StreamDecoder().feed(COMMENT + COMMENT + chunk + COMMENT + b"data: [DONE]\n\n")
    assert len(with_comments) == len(plain_stream) == 1  # [DONE] ends the stream: no chunk of its own
    assert with_comments[0].raw == plain_stream[0].raw
