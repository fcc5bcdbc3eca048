"""Unit tests of the pure-Python usage modules (no vLLM server, no GPU, fast).

Covers :mod:`qwen_vllm_ext.usage.accounting`, ``stream_usage`` (``rewrite_sse`` / ``billing_fields`` /
``complete_usage``),
``access_log`` (stratified sampling and the JSON-lines writer), ``reconcile`` (Prometheus parsing, drift) and the
pure helpers of ``middleware`` (``_status``, ``to_micro``, ``_parse_body``).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from decimal import Decimal

import pytest

from qwen_v3_calculator import Calculator
from qwen_v3_calculator.billing import get_policy
from qwen_v3_calculator.calculator import to_jsonable
from qwen_vllm_ext.usage import reconcile as rec
from qwen_vllm_ext.usage.access_log import AccessLog, StratifiedSampler, estimate_prompt_tokens
from qwen_vllm_ext.usage.accounting import AccountBook, EngineCounts, RequestTotals
from qwen_vllm_ext.usage.ledger import LedgerRecord
from qwen_v3_calculator.billing import to_micro
from qwen_vllm_ext.usage.middleware import _parse_body, _status
from qwen_v3_calculator.billing import Prices
from qwen_vllm_ext.usage.stream_usage import billing_fields, complete_usage, rewrite_sse

POLICY = get_policy("default")


@pytest.fixture(scope="module")
def calculator():
    return Calculator()


# =====================================================================================================
# accounting: EngineCounts, RequestTotals.from_parts, AccountBook
# =====================================================================================================

def counts(external_id="r", prompt=10, cached=0, completion=5, finish="stop", prefilled=True,
           arrival=1000.0, ttft=0.25, finished_at=None) -> EngineCounts:
    return EngineCounts(external_id=external_id, prompt_tokens=prompt, prefilled=prefilled, cached_tokens=cached,
                        completion_tokens=completion, finish_reason=finish, arrival_time=arrival,
                        first_token_latency=ttft, finished_at=time.time() if finished_at is None else finished_at)


def test_engine_prompt_tokens_only_once_prefilled():
    assert counts(prompt=42, prefilled=True).engine_prompt_tokens == 42
    assert counts(prompt=42, prefilled=False).engine_prompt_tokens == 0


def test_from_parts_empty_never_reached_engine():
    totals = RequestTotals.from_parts([])
    assert totals == RequestTotals(prompt_tokens=0, engine_prompt_tokens=0, cached_tokens=0, completion_tokens=0,
                                   finish=None, first_token_at=None, parts=0)


def test_from_parts_several_prompts_are_summed():
    parts = [counts("r-0", prompt=10, cached=4, completion=3, arrival=100.0, ttft=0.5),
             counts("r-1", prompt=20, cached=0, completion=7, arrival=100.0, ttft=0.2)]
    totals = RequestTotals.from_parts(parts)
    assert (totals.prompt_tokens, totals.engine_prompt_tokens, totals.cached_tokens, totals.completion_tokens) \
        == (30, 30, 4, 10)
    assert totals.parts == 2
    assert totals.finish == "stop"
    assert totals.first_token_at == pytest.approx(100.2)


def test_from_parts_parallel_samples_share_one_prompt():
    # n=3: three engine requests with the parent's id; usage counts the prompt once, vLLM's prompt counter thrice
    parts = [counts("r", prompt=12, cached=8, completion=c) for c in (4, 5, 6)]
    totals = RequestTotals.from_parts(parts)
    assert totals.prompt_tokens == 12
    assert totals.cached_tokens == 8
    assert totals.engine_prompt_tokens == 36
    assert totals.completion_tokens == 15
    assert totals.parts == 3


def test_from_parts_not_prefilled_prompt_is_not_engine_counted():
    totals = RequestTotals.from_parts([counts("r", prompt=50, completion=0, prefilled=False, finish="abort",
                                              ttft=None)])
    assert totals.prompt_tokens == 50
    assert totals.engine_prompt_tokens == 0
    assert totals.first_token_at is None
    assert totals.finish == "abort"


@pytest.mark.parametrize("reasons, expected", [
    (["stop"], "stop"),
    (["length"], "length"),
    (["stop", "length"], "length"),
    (["stop", "error", "length"], "error"),
    (["error", "abort"], "abort"),
    (["stop", "stop", "abort"], "abort"),
])
def test_from_parts_finish_priority(reasons, expected):
    parts = [counts(f"r-{i}", finish=r) for i, r in enumerate(reasons)]
    assert RequestTotals.from_parts(parts).finish == expected


def test_from_parts_first_token_is_earliest_over_parts():
    parts = [counts("r-0", arrival=10.0, ttft=5.0), counts("r-1", arrival=12.0, ttft=1.0),
             counts("r-2", arrival=9.0, ttft=None)]
    assert RequestTotals.from_parts(parts).first_token_at == pytest.approx(13.0)


def test_book_keeps_each_http_request_apart():
    """Counts are keyed by the HTTP request, never by matching vLLM id strings ("job" vs "job-retry")."""
    book = AccountBook()
    for key in ("job", "job-retry", "job-0"):
        book.engine_opened(key)
    book.engine_finished("job-retry", counts("chatcmpl-job-retry", prompt=7, completion=9))
    assert not book.pending("job-retry") and book.pending("job") and book.pending("job-0")
    book.engine_finished("job", counts("chatcmpl-job", prompt=3, completion=1))
    assert [p.completion_tokens for p in book.collect("job")] == [1]
    assert [p.completion_tokens for p in book.collect("job-retry")] == [9]
    assert book.collect("job") == []  # collected counts are removed
    assert book.pending("job-0")


def test_book_several_engine_requests_of_one_http_request():
    book = AccountBook()
    for _ in range(3):  # e.g. three prompts, or n=3 parallel samples
        book.engine_opened("h")
    book.engine_finished("h", counts("cmpl-h-0", completion=1))
    book.engine_finished("h", counts("cmpl-h-1", completion=2))
    assert book.pending("h")
    book.engine_finished("h", counts("cmpl-h-2", completion=3))
    assert not book.pending("h")
    assert sorted(c.completion_tokens for c in book.collect("h")) == [1, 2, 3]


def test_book_finish_without_open_is_recorded_and_not_pending():
    book = AccountBook()
    book.engine_finished("lonely", counts("lonely"))
    assert not book.pending("lonely")
    assert len(book.collect("lonely")) == 1


def test_current_http_request_reaches_tasks_started_inside_the_request():
    from qwen_vllm_ext.usage.accounting import CURRENT_HTTP_REQUEST

    seen = []

    async def engine_side():
        seen.append(CURRENT_HTTP_REQUEST.get())

    async def handler(key):
        token = CURRENT_HTTP_REQUEST.set(key)
        try:
            await asyncio.gather(asyncio.create_task(engine_side()), asyncio.create_task(engine_side()))
        finally:
            CURRENT_HTTP_REQUEST.reset(token)

    async def main():
        await asyncio.gather(handler("a"), handler("b"))
        await engine_side()  # outside any request

    asyncio.run(main())
    assert sorted(seen[:4]) == ["a", "a", "b", "b"] and seen[4] is None


def test_wait_settled_true_immediately_when_nothing_open():
    book = AccountBook()

    async def main():
        t0 = time.monotonic()
        ok = await book.wait_settled("x", timeout=5.0)
        return ok, time.monotonic() - t0

    ok, waited = asyncio.run(main())
    assert ok is True
    assert waited < 0.5


def test_wait_settled_wakes_when_engine_finishes():
    book = AccountBook()
    book.engine_opened("r")
    book.engine_opened("r")

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, book.engine_finished, "r", counts("r-0"))
        loop.call_later(0.05, book.engine_finished, "unrelated", counts("unrelated"))
        loop.call_later(0.08, book.engine_finished, "r", counts("r-1"))
        t0 = time.monotonic()
        ok = await book.wait_settled("r", timeout=5.0)
        return ok, time.monotonic() - t0

    ok, waited = asyncio.run(main())
    assert ok is True
    assert 0.07 <= waited < 2.0
    assert sorted(p.external_id for p in book.collect("r")) == ["r-0", "r-1"]


def test_wait_settled_times_out_when_still_open():
    book = AccountBook()
    book.engine_opened("slow")

    async def main():
        loop = asyncio.get_running_loop()
        # other requests finishing wake the waiter, which must keep waiting for its own
        loop.call_later(0.01, book.engine_finished, "other", counts("other"))
        loop.call_later(0.03, book.engine_finished, "slowpoke", counts("slowpoke"))
        t0 = time.monotonic()
        ok = await book.wait_settled("slow", timeout=0.15)
        return ok, time.monotonic() - t0

    ok, waited = asyncio.run(main())
    assert ok is False
    assert 0.14 <= waited < 2.0
    assert book.pending("slow")


def test_expire_drops_only_stale_uncollected_counts():
    book = AccountBook(retention_s=60.0)
    now = 10_000.0
    book.engine_finished("old", counts("old", finished_at=now - 61))
    book.engine_finished("fresh", counts("fresh", finished_at=now - 10))
    book.engine_finished("mixed", counts("mixed", finished_at=now - 100))
    book.engine_finished("mixed", counts("mixed", finished_at=now - 1))  # one part still fresh: keep it all
    assert book.expire(now=now) == 1
    assert book.collect("old") == []
    assert len(book.collect("fresh")) == 1
    assert len(book.collect("mixed")) == 2
    assert book.expire(now=now) == 0


def test_expire_default_now_uses_wall_clock():
    book = AccountBook(retention_s=0.0)
    book.engine_finished("x", counts("x", finished_at=time.time() - 1))
    assert book.expire() == 1
    assert book.collect("x") == []


# =====================================================================================================
# stream_usage: rewrite_sse / billing_fields
# =====================================================================================================

def sse(chunk: dict) -> str:
    return "data: " + json.dumps(chunk) + "\n\n"


def usage_chunk(prompt=100, completion=10, details=None, content="hi") -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if details is not None:
        usage["prompt_tokens_details"] = details
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}], "usage": usage}


def parse_event(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[6:])


def test_billing_fields_default_policy_exact_strings():
    bill = billing_fields(POLICY, {"prompt_tokens": 100, "completion_tokens": 10,
                                   "prompt_tokens_details": {"cached_tokens": 40}})
    assert bill == to_jsonable(POLICY.bill(100, 10, cached_tokens=40))
    assert bill["policy"] == "default"
    assert all(isinstance(bill[k], str) for k in ("prompt_units", "completion_units", "total_units"))
    assert Decimal(bill["completion_units"]) == Decimal("13.5")
    assert Decimal(bill["total_units"]) == Decimal("113.5")


def test_billing_fields_missing_details_or_null_cached():
    assert billing_fields(POLICY, {"prompt_tokens": 3, "completion_tokens": 2}) == to_jsonable(POLICY.bill(3, 2))
    assert billing_fields(POLICY, {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": None}) \
        == to_jsonable(POLICY.bill(3, 2))
    assert billing_fields(POLICY, {"prompt_tokens": 3, "completion_tokens": 2,
                                   "prompt_tokens_details": {"cached_tokens": None}}) == to_jsonable(POLICY.bill(3, 2))


def test_billing_fields_long_context_penalty():
    bill = billing_fields(POLICY, {"prompt_tokens": 32768 + 1000, "completion_tokens": 0})
    assert Decimal(bill["context_penalty_factor"]) == Decimal(1) + Decimal("0.00015") * 1000
    assert Decimal(bill["prompt_units"]) == Decimal(33768) * (Decimal(1) + Decimal("0.15"))


@pytest.mark.parametrize("event", [
    "",
    ": keep-alive\n\n",
    "event: error\ndata: {\"error\": {\"message\": \"x\"}}\n\n",
    "data: [DONE]\n\n",
    "data: {not json at all\n\n",
    "data: {\"usage\": {\"prompt_tokens\": 1, \n\n",
    "data:{\"usage\": {\"prompt_tokens\": 1, \"completion_tokens\": 1}}\n\n",  # no space: not vLLM's form
    "data: [1, 2, 3]\n\n",
    "id: 7\n\n",
])
def test_rewrite_sse_leaves_other_events_unchanged(event):
    assert rewrite_sse(event, 5, POLICY) == event


def test_rewrite_sse_chunk_without_usage_is_byte_identical():
    chunk = usage_chunk()
    del chunk["usage"]
    event = sse(chunk)
    assert rewrite_sse(event, 3, POLICY) == event
    null_usage = sse(dict(chunk, usage=None))
    assert rewrite_sse(null_usage, 3, POLICY) == null_usage
    list_usage = sse(dict(chunk, usage=[1]))
    assert rewrite_sse(list_usage, 3, POLICY) == list_usage


def test_rewrite_sse_adds_cached_and_billing():
    chunk = usage_chunk(prompt=100, completion=10)
    out = parse_event(rewrite_sse(sse(chunk), 40, POLICY))
    usage = out["usage"]
    assert usage["prompt_tokens"] == 100 and usage["completion_tokens"] == 10 and usage["total_tokens"] == 110
    assert usage["prompt_tokens_details"] == {"cached_tokens": 40}
    assert usage["billing"] == to_jsonable(POLICY.bill(100, 10, cached_tokens=40))
    # everything except usage is unchanged
    assert {k: v for k, v in out.items() if k != "usage"} == {k: v for k, v in chunk.items() if k != "usage"}


def test_rewrite_sse_zero_cached_is_written():
    out = parse_event(rewrite_sse(sse(usage_chunk(prompt=5, completion=0)), 0, POLICY))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_rewrite_sse_existing_details_kept_when_cached_unknown():
    chunk = usage_chunk(prompt=50, completion=5, details={"cached_tokens": 16, "audio_tokens": 0})
    out = parse_event(rewrite_sse(sse(chunk), None, POLICY))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 16, "audio_tokens": 0}
    assert out["usage"]["billing"] == to_jsonable(POLICY.bill(50, 5, cached_tokens=16))


def test_rewrite_sse_cached_overrides_existing_details_and_keeps_other_keys():
    chunk = usage_chunk(prompt=50, completion=5, details={"cached_tokens": 1, "audio_tokens": 2})
    out = parse_event(rewrite_sse(sse(chunk), 32, POLICY))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 32, "audio_tokens": 2}


def test_rewrite_sse_null_details_replaced():
    chunk = usage_chunk(prompt=50, completion=5)
    chunk["usage"]["prompt_tokens_details"] = None
    out = parse_event(rewrite_sse(sse(chunk), 8, POLICY))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_rewrite_sse_without_policy_adds_no_billing():
    out = parse_event(rewrite_sse(sse(usage_chunk()), 4, None))
    assert "billing" not in out["usage"]
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    unchanged = parse_event(rewrite_sse(sse(usage_chunk()), None, None))
    assert unchanged == usage_chunk()


def test_rewrite_sse_final_usage_chunk_with_empty_choices():
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    out = parse_event(rewrite_sse(sse(chunk), 0, POLICY))
    assert out["choices"] == []
    assert out["usage"]["billing"]["total_units"] == str(POLICY.bill(7, 3)["total_units"])


def test_rewrite_sse_preserves_non_ascii_content():
    text = "héllo wörld — 世界 🙂 \u2028 \"quoted\" \\ back"
    chunk = usage_chunk(content=text)
    event = "data: " + json.dumps(chunk, ensure_ascii=False) + "\n\n"
    out_event = rewrite_sse(event, 2, POLICY)
    assert "世界 🙂" in out_event and "héllo wörld" in out_event  # written as UTF-8, not \\u escapes
    assert parse_event(out_event)["choices"][0]["delta"]["content"] == text
    # ASCII-escaped input is decoded the same way
    assert parse_event(rewrite_sse(sse(chunk), 2, POLICY))["choices"][0]["delta"]["content"] == text


def test_rewrite_sse_output_is_one_event():
    out = rewrite_sse(sse(usage_chunk()), 1, POLICY)
    assert out.count("\n\n") == 1 and out.endswith("\n\n") and "\n" not in out[:-2]


def test_rewrite_sse_cached_above_chunk_prompt_does_not_break_the_stream():
    """BUG (see report): a multi-prompt streamed completion with continuous usage.

    vLLM 0.32's completion stream puts the *per-prompt* usage on each chunk (``prompt_tokens =
    num_prompt_tokens[prompt_idx]``), while ``install``'s completion wrapper passes the *sum* of cached tokens
    over all prompts seen so far. When that sum exceeds one prompt's length, ``policy.bill`` raises
    ``ValueError('cached_tokens cannot exceed prompt_tokens')`` inside the stream generator and the client's
    stream breaks. Cached tokens must never exceed the chunk's prompt tokens (per-prompt cached, clamped).
    """
    chunk = {"id": "cmpl-x-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 1, "text": "a", "finish_reason": None}],
             "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}
    out = parse_event(rewrite_sse(sse(chunk), 96, POLICY))  # prompt 0: 96 cached of 100; prompt 1: 10 tokens
    usage = out["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    assert "billing" in usage


# ---- complete_usage: the non-streamed response's usage object, completed in place ----------------------------------

class _Details:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _usage_info(prompt=100, completion=10, prompt_details=None, completion_details=None):
    """The shape of vLLM's ``UsageInfo`` as the serving classes build it (attributes, details may be None)."""
    return _Details(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    prompt_tokens_details=prompt_details, completion_tokens_details=completion_details)


def test_complete_usage_adds_cached_billing_and_cost_as_the_stream_and_the_ledger_do():
    prices = Prices.per_million(prompt="0.5", completion="1.5", cache_read="0.05")
    usage = _usage_info()  # vLLM without --enable-prompt-tokens-details: no prompt details at all
    complete_usage(usage, 40, None, POLICY, prices, _Details)
    assert usage.prompt_tokens_details.cached_tokens == 40
    assert usage.completion_tokens_details is None  # no reasoning parser: vLLM reports none, neither do we
    assert usage.billing == billing_fields(POLICY, {"prompt_tokens": 100, "completion_tokens": 10,
                                                    "prompt_tokens_details": {"cached_tokens": 40}}, prices)
    assert Decimal(repr(usage.cost)) == prices.cost(100, 10, 40, policy=POLICY)
    assert Decimal(repr(usage.cost)) * 10**12 == prices.cost_pico(100, 10, 40, policy=POLICY)  # the ledger's figure
    # the streamed final chunk carries the same figures
    streamed = parse_event(rewrite_sse(sse(usage_chunk(100, 10)), 40, POLICY, prices=prices))["usage"]
    assert (streamed["billing"], streamed["cost"]) == (usage.billing, usage.cost)


def test_complete_usage_keeps_vllms_details_clamps_and_replaces_reasoning():
    details = _Details(cached_tokens=None, created_cache_tokens=None)
    usage = _usage_info(prompt=8, completion=30, prompt_details=details,
                        completion_details=_Details(reasoning_tokens=0))
    complete_usage(usage, 12, 25, POLICY, None, _Details)
    assert usage.prompt_tokens_details is details and details.cached_tokens == 8  # never more than the prompt
    assert usage.completion_tokens_details.reasoning_tokens == 25
    assert usage.billing == to_jsonable(POLICY.bill(8, 30, cached_tokens=8)) and not hasattr(usage, "cost")


def test_complete_usage_leaves_cached_alone_when_unknown_and_skips_billing_without_policy():
    usage = _usage_info(completion_details=_Details(reasoning_tokens=3))
    complete_usage(usage, None, None, None)
    assert usage.prompt_tokens_details is None and usage.completion_tokens_details.reasoning_tokens == 3
    assert not hasattr(usage, "billing") and not hasattr(usage, "cost")


# =====================================================================================================
# access_log: StratifiedSampler, estimate_prompt_tokens, AccessLog
# =====================================================================================================

def test_sampler_defaults():
    s = StratifiedSampler()
    assert (s.slow_s, s.slow_rate, s.rate, s.error_rate) == (5.0, 0.1, 0.01, 1.0)


@pytest.mark.parametrize("http_status, status, latency, expected", [
    (200, "stop", 0.1, ("normal", 0.01)),
    (200, "length", 0.1, ("normal", 0.01)),
    (399, "stop", 0.1, ("normal", 0.01)),
    (200, "stop", 5.0, ("normal", 0.01)),          # "slower than": strictly above the threshold
    (200, "stop", 5.0001, ("slow", 0.1)),
    (200, "length", 60.0, ("slow", 0.1)),
    (400, "stop", 0.1, ("error", 1.0)),
    (404, "error", 0.1, ("error", 1.0)),
    (500, "stop", 60.0, ("error", 1.0)),           # errors win over slow
    (200, "client_disconnected", 0.1, ("error", 1.0)),
    (200, "client_disconnected", 60.0, ("error", 1.0)),
    (200, "aborted", 0.1, ("error", 1.0)),
    (200, "error", 0.1, ("error", 1.0)),
    (499, "client_disconnected", 1.0, ("error", 1.0)),
])
def test_sampler_strata(http_status, status, latency, expected):
    assert StratifiedSampler().stratum(http_status, status, latency) == expected


def test_sampler_custom_rates_and_threshold():
    s = StratifiedSampler(slow_s=1.0, slow_rate=0.5, rate=0.2, error_rate=0.9)
    assert s.stratum(200, "stop", 1.5) == ("slow", 0.5)
    assert s.stratum(200, "stop", 0.5) == ("normal", 0.2)
    assert s.stratum(503, "stop", 0.5) == ("error", 0.9)


@pytest.mark.parametrize("name", ["slow_rate", "rate", "error_rate"])
@pytest.mark.parametrize("bad", [-0.01, 1.01, 2, -1, float("nan"), float("inf")])
def test_sampler_rejects_bad_rates(name, bad):
    with pytest.raises(ValueError, match=name):
        StratifiedSampler(**{name: bad})


@pytest.mark.parametrize("name", ["slow_rate", "rate", "error_rate"])
@pytest.mark.parametrize("ok", [0, 0.0, 0.5, 1, 1.0])
def test_sampler_accepts_bounds(name, ok):
    assert getattr(StratifiedSampler(**{name: ok}), name) == ok


def test_draw_deterministic_and_in_unit_interval():
    ids = [f"req-{i}" for i in range(2000)]
    draws = [StratifiedSampler.draw(r) for r in ids]
    assert draws == [StratifiedSampler().draw(r) for r in ids]  # same id, same number (any instance)
    assert all(0.0 <= d < 1.0 for d in draws)
    assert len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert StratifiedSampler.draw("") == StratifiedSampler.draw("")
    assert 0.0 <= StratifiedSampler.draw("é世🙂") < 1.0


def test_decide_follows_draw_and_rate():
    s = StratifiedSampler(rate=0.3)
    for i in range(500):
        rid = f"id-{i}"
        expected = ("normal", 0.3) if StratifiedSampler.draw(rid) < 0.3 else None
        assert s.decide(rid, 200, "stop", 0.1) == expected
        assert s.decide(rid, 200, "stop", 0.1) == expected  # reproducible


def test_decide_rate_zero_and_one():
    never = StratifiedSampler(rate=0.0, slow_rate=0.0, error_rate=0.0)
    always = StratifiedSampler(rate=1.0, slow_rate=1.0, error_rate=1.0)
    for i in range(300):
        rid = f"x{i}"
        for args in ((200, "stop", 0.1), (200, "stop", 9.0), (500, "error", 0.1)):
            assert never.decide(rid, *args) is None
            assert always.decide(rid, *args) is not None
    # the default error stratum keeps every failure
    assert all(StratifiedSampler().decide(f"e{i}", 500, "error", 0.1) == ("error", 1.0) for i in range(300))


def test_decide_samples_are_nested_across_rates():
    ids = [f"n-{i}" for i in range(3000)]
    low = {r for r in ids if StratifiedSampler(rate=0.05).decide(r, 200, "stop", 0.1)}
    high = {r for r in ids if StratifiedSampler(rate=0.2).decide(r, 200, "stop", 0.1)}
    assert low and low <= high and len(high) > len(low)


@pytest.mark.parametrize("rate", [0.01, 0.1, 0.5])
def test_sampled_fraction_approximates_rate(rate):
    n = 40_000
    sampler = StratifiedSampler(rate=rate)
    hits = sum(1 for i in range(n) if sampler.decide(f"chatcmpl-{i:08x}", 200, "stop", 0.2))
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(hits - n * rate) < 5 * sd
    assert abs(hits / n - rate) < max(0.1 * rate, 0.002)


def make_record(rid: str, http_status=200, status="stop", latency=0.5, prompt=100, cached=0, completion=20,
                api_key_id="key-a", model="Qwen/Qwen3-0.6B") -> LedgerRecord:
    return LedgerRecord(request_id=rid, instance_id="inst-1", model=model, endpoint="/v1/chat/completions",
                        status=status, http_status=http_status, prompt_tokens=prompt, cached_tokens=cached,
                        completion_tokens=completion, reasoning_tokens=0, engine_prompt_tokens=prompt,
                        billed_prompt_micro=prompt * 1_000_000, billed_completion_micro=completion * 1_350_000,
                        received_at=1_700_000_000.0, finished_at=1_700_000_000.0 + latency,
                        ttft_s=min(0.05, latency), latency_s=latency, streamed=True, api_key_id=api_key_id)


def read_lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_access_log_line_fields_and_no_secrets(tmp_path, calculator):
    secret_prompt = "TOP-SECRET-PROMPT: the launch codes are 0000 ünïcödé 机密"
    secret_key = "sk-live-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
    path = tmp_path / "access.jsonl"
    log = AccessLog(str(path), StratifiedSampler(rate=1.0, slow_rate=1.0, error_rate=1.0), calculator)
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": secret_prompt}]
    chat_body = {"model": "Qwen/Qwen3-0.6B", "messages": messages, "api_key": secret_key, "user": secret_key}
    completion_body = {"model": "Qwen/Qwen3-0.6B", "prompt": secret_prompt, "api_key": secret_key}
    assert log.log(make_record("r-normal", latency=0.5, prompt=31, completion=7), chat_body) is True
    assert log.log(make_record("r-slow", latency=9.0), completion_body) is True
    assert log.log(make_record("r-err", http_status=500, status="error", latency=0.1, completion=0), chat_body)
    assert log.log(make_record("r-mm", api_key_id=None), {"messages": "not a list"}) is True
    log.close()

    raw = path.read_text(encoding="utf-8")
    assert secret_prompt not in raw and "TOP-SECRET" not in raw and "机密" not in raw
    assert secret_key not in raw and "sk-live" not in raw
    lines = {line["request_id"]: line for line in read_lines(path)}
    assert set(lines) == {"r-normal", "r-slow", "r-err", "r-mm"}

    normal = lines["r-normal"]
    assert normal["stratum"] == "normal" and normal["sample_weight"] == 1.0
    assert normal["estimate_prompt_tokens"] == calculator.count_chat(messages)
    assert normal["estimate_prompt_tokens"] > 0
    assert (normal["prompt_tokens"], normal["completion_tokens"], normal["cached_tokens"]) == (31, 7, 0)
    assert normal["billed_micro"] == 31 * 1_000_000 + 7 * 1_350_000
    assert normal["api_key_id"] == "key-a" and normal["model"] == "Qwen/Qwen3-0.6B"
    assert normal["http_status"] == 200 and normal["status"] == "stop" and normal["streamed"] is True
    assert normal["latency_s"] == pytest.approx(0.5) and normal["ttft_s"] == pytest.approx(0.05)

    assert lines["r-slow"]["stratum"] == "slow"
    assert lines["r-slow"]["estimate_prompt_tokens"] == calculator.count_tokens(secret_prompt)
    assert lines["r-err"]["stratum"] == "error" and lines["r-err"]["http_status"] == 500
    assert lines["r-mm"]["estimate_prompt_tokens"] is None and lines["r-mm"]["api_key_id"] is None
    for line in lines.values():
        assert "messages" not in line and "prompt" not in line and "api_key" not in line


def test_access_log_weights_follow_rates(tmp_path):
    path = tmp_path / "a.jsonl"
    log = AccessLog(str(path), StratifiedSampler(rate=1.0, slow_rate=0.5, error_rate=0.25), None)
    # find ids the sampler keeps in each stratum
    keep_slow = next(f"s{i}" for i in range(1000) if StratifiedSampler.draw(f"s{i}") < 0.5)
    keep_err = next(f"e{i}" for i in range(1000) if StratifiedSampler.draw(f"e{i}") < 0.25)
    drop_err = next(f"d{i}" for i in range(1000) if StratifiedSampler.draw(f"d{i}") >= 0.25)
    assert log.log(make_record(keep_slow, latency=10.0), {}) is True
    assert log.log(make_record(keep_err, http_status=502, status="error"), {}) is True
    assert log.log(make_record(drop_err, http_status=502, status="error"), {}) is False
    log.close()
    lines = {line["request_id"]: line for line in read_lines(path)}
    assert set(lines) == {keep_slow, keep_err}
    assert lines[keep_slow]["sample_weight"] == 2.0 and lines[keep_slow]["stratum"] == "slow"
    assert lines[keep_err]["sample_weight"] == 4.0 and lines[keep_err]["stratum"] == "error"
    assert lines[keep_err]["estimate_prompt_tokens"] is None  # no calculator given


def test_access_log_close_flushes_and_appends(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"pre": "existing"}\n', encoding="utf-8")
    log = AccessLog(str(path), StratifiedSampler(rate=1.0), None)
    for i in range(500):
        assert log.log(make_record(f"r{i}"), {"model": "m"})
    log.close()
    lines = read_lines(path)
    assert lines[0] == {"pre": "existing"}
    assert [line["request_id"] for line in lines[1:]] == [f"r{i}" for i in range(500)]


def test_access_log_reconstructs_totals(tmp_path):
    """sum(sample_weight) over sampled lines estimates the true count of each stratum (and of tokens)."""
    path = tmp_path / "strat.jsonl"
    sampler = StratifiedSampler(slow_s=5.0, slow_rate=0.2, rate=0.05)
    log = AccessLog(str(path), sampler, None)
    n = 30_000
    true_count = {"error": 0, "slow": 0, "normal": 0}
    true_completion = {"error": 0, "slow": 0, "normal": 0}
    written = 0
    for i in range(n):
        completion = 1 + (i * 7919) % 200
        if i % 20 == 0:
            rec_ = make_record(f"req-{i:06d}", http_status=500, status="error", completion=completion)
        elif i % 20 == 1:
            rec_ = make_record(f"req-{i:06d}", status="client_disconnected", http_status=200, completion=completion)
        elif i % 10 in (2, 3):
            rec_ = make_record(f"req-{i:06d}", latency=7.5, completion=completion)
        else:
            rec_ = make_record(f"req-{i:06d}", latency=0.4, completion=completion)
        stratum = sampler.stratum(rec_.http_status, rec_.status, rec_.latency_s)[0]
        true_count[stratum] += 1
        true_completion[stratum] += completion
        written += log.log(rec_, {})
    log.close()

    lines = read_lines(path)
    assert len(lines) == written
    assert len({line["request_id"] for line in lines}) == written
    est_count = {k: 0.0 for k in true_count}
    est_completion = {k: 0.0 for k in true_count}
    for line in lines:
        est_count[line["stratum"]] += line["sample_weight"]
        est_completion[line["stratum"]] += line["sample_weight"] * line["completion_tokens"]
    # every failure is kept: exact
    assert est_count["error"] == true_count["error"] == 3000
    assert est_completion["error"] == true_completion["error"]
    for stratum in ("slow", "normal"):
        assert est_count[stratum] == pytest.approx(true_count[stratum], rel=0.10)
        assert est_completion[stratum] == pytest.approx(true_completion[stratum], rel=0.12)
    assert sum(est_count.values()) == pytest.approx(n, rel=0.05)
    assert sum(est_completion.values()) == pytest.approx(sum(true_completion.values()), rel=0.06)
    # far fewer lines than requests
    assert written < 0.25 * n


def test_estimate_prompt_tokens(calculator):
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    assert estimate_prompt_tokens({"messages": messages}, calculator) == calculator.count_chat(messages)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with_tools = estimate_prompt_tokens({"messages": messages, "tools": tools}, calculator)
    assert with_tools == calculator.count_chat(messages, tools=tools)
    assert with_tools > estimate_prompt_tokens({"messages": messages}, calculator)
    assert estimate_prompt_tokens({"prompt": "hello world"}, calculator) == calculator.count_tokens("hello world")
    # not countable: None, never an exception
    assert estimate_prompt_tokens({}, calculator) is None
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}, calculator) is None
    assert estimate_prompt_tokens({"messages": [1, 2]}, calculator) is None
    assert estimate_prompt_tokens({"messages": messages, "chat_template_kwargs": ["x"]}, calculator) is None


# =====================================================================================================
# reconcile: parse_counters, drift
# =====================================================================================================

PROM_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} NaN
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1234.0
vllm:prompt_tokens_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 766.0
vllm:prompt_tokens_total{engine="2",model_name="Qwen/Qwen3-0.6B"} 1.5e+03
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7000000001e+09
vllm:prompt_tokens_created{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.7000000001e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 4000.0
vllm:generation_tokens_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 321.0
vllm:generation_tokens_total{engine="2",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:request_prompt_tokens Number of prefill tokens processed.
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 12.0
vllm:request_prompt_tokens_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 12.0
vllm:request_prompt_tokens_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 1234.0
vllm:prompt_tokens_total_by_source{engine="0",source="local_compute"} 999.0
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} NaN
vllm:spec_decode_acceptance{engine="0"} +Inf
# vllm:prompt_tokens_total{engine="9"} 1000000.0
qwen_ext_billed_units_total 77.5

"""
NAMES = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def test_parse_counters_sums_engines_and_ignores_the_rest():
    got = rec.parse_counters(PROM_TEXT, NAMES)
    assert got == {"vllm:prompt_tokens_total": 3500.0, "vllm:generation_tokens_total": 4321.0}
    assert not any(math.isnan(v) for v in got.values())


def test_parse_counters_unlabelled_and_other_names():
    text = "foo_total 5\nfoo_total{a=\"1\"} 2.5\n   \nbar 1\n#foo_total 100\n"
    assert rec.parse_counters(text, ["foo_total", "missing_total"]) == {"foo_total": 7.5, "missing_total": 0.0}
    assert rec.parse_counters("", NAMES) == {n: 0.0 for n in NAMES}


def test_parse_counters_crlf_and_surrounding_space():
    text = PROM_TEXT.replace("\n", "\r\n")
    assert rec.parse_counters(text, NAMES) == {"vllm:prompt_tokens_total": 3500.0,
                                              "vllm:generation_tokens_total": 4321.0}


def test_parse_counters_accepts_sample_timestamps():
    """BUG (low severity, see report): the exposition format allows ``name{labels} value [timestamp]``.

    A sample with a timestamp (federation, a relabelling proxy) does not match ``_SAMPLE`` and is silently
    dropped, so ``reconcile`` would report a false drift.
    """
    text = ('vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0 1700000000000\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 40 1700000000000\n')
    assert rec.parse_counters(text, NAMES) == {"vllm:prompt_tokens_total": 100.0,
                                              "vllm:generation_tokens_total": 40.0}


def test_parse_counters_label_value_with_brace():
    """BUG (low severity, see report): label values may contain ``}`` (e.g. ``--served-model-name 'q{x}'``);
    ``\\{[^}]*\\}`` cuts the label set there and the sample is silently dropped."""
    text = 'vllm:prompt_tokens_total{engine="0",model_name="q{x}"} 10.0\n'
    assert rec.parse_counters(text, NAMES)["vllm:prompt_tokens_total"] == 10.0


def test_drift_uses_engine_prompt_tokens():
    server = rec.parse_counters(PROM_TEXT, NAMES)
    zero = rec.drift(server, {"engine_prompt_tokens": 3500, "prompt_tokens": 9999, "completion_tokens": 4321})
    assert zero == {"prompt_tokens": 0, "completion_tokens": 0}
    assert rec.drift(server, {"engine_prompt_tokens": 3400, "completion_tokens": 4400}) \
        == {"prompt_tokens": 100, "completion_tokens": -79}


def test_reconcile_with_fake_fetch_and_store(monkeypatch):
    pages = {"/qwen_ext/health": json.dumps({"instance_id": "inst-7"}), "/metrics": PROM_TEXT}
    seen = []

    def fake_fetch(url, path, timeout=10.0, token=None):
        seen.append((url, path, token))
        return pages[path]

    class Store:
        def totals(self, instance_id=None):
            assert instance_id == "inst-7"
            return {"engine_prompt_tokens": 3500, "completion_tokens": 4320, "prompt_tokens": 3600}

    monkeypatch.setattr(rec, "fetch", fake_fetch)
    out = rec.reconcile("http://h:8000", Store(), admin_key="adm")
    assert out["instance_id"] == "inst-7"
    assert out["drift"] == {"prompt_tokens": 0, "completion_tokens": 1}
    assert out["server"]["vllm:generation_tokens_total"] == 4321.0
    assert {(p, t) for _, p, t in seen} == {("/qwen_ext/health", "adm"), ("/metrics", "adm")}
    # the gateway's public health view has no instance id: reconcile says how to get it instead of a KeyError
    pages["/qwen_ext/health"] = json.dumps({"details": "admin only"})
    with pytest.raises(ValueError, match="--admin-key"):
        rec.reconcile("http://h:8000", Store())


# =====================================================================================================
# middleware pure helpers: _status, to_micro, _parse_body
# =====================================================================================================

def _totals(finish):
    return RequestTotals(finish=finish)


STATUS_TABLE = {
    # finish: (connected, disconnected) -- independent of the HTTP status unless noted below
    "stop": ("stop", "stop"),
    "length": ("length", "length"),
    "abort": ("aborted", "client_disconnected"),
    "error": ("error", "error"),
    None: ("error", "client_disconnected"),
}


@pytest.mark.parametrize("finish", ["stop", "length", "abort", "error", None])
@pytest.mark.parametrize("http_status", [200, 201, 399, 400, 404, 422, 499, 500, 503])
@pytest.mark.parametrize("disconnected", [False, True])
def test_status_every_combination(finish, http_status, disconnected):
    expected = STATUS_TABLE[finish][1 if disconnected else 0]
    assert _status(_totals(finish), http_status, disconnected) == expected


def test_status_unknown_engine_reason():
    assert _status(_totals("weird"), 200, False) == "aborted"
    assert _status(_totals("weird"), 500, False) == "error"
    assert _status(_totals("weird"), 200, True) == "aborted"


@pytest.mark.parametrize("units, micro", [
    (Decimal("0"), 0),
    (Decimal("1"), 1_000_000),
    (Decimal("13.5"), 13_500_000),
    (Decimal("1.35") * 7, 9_450_000),
    (Decimal("0.0000004"), 0),
    (Decimal("0.0000005"), 0),      # half-even: .5 -> 0
    (Decimal("0.0000015"), 2),      # 1.5 -> 2
    (Decimal("0.0000025"), 2),      # 2.5 -> 2
    (Decimal("0.0000035"), 4),
    (Decimal("0.00000051"), 1),
    (Decimal("1.2345675"), 1_234_568),
    (Decimal("1.2345665"), 1_234_566),
    (Decimal("12345678901.234567"), 12_345_678_901_234_567),
    (Decimal("33768") * (Decimal(1) + Decimal("0.00015") * 1000), 38_833_200_000),
])
def test_to_micro_half_even(units, micro):
    got = to_micro(units)
    assert type(got) is int
    assert got == micro


def test_to_micro_matches_policy_figures():
    bill = POLICY.bill(32768 + 333, 77, cached_tokens=1000)
    assert to_micro(bill["prompt_units"]) == int((bill["prompt_units"] * 10**6).to_integral_value())
    assert to_micro(bill["completion_units"]) == 77 * 1_350_000


@pytest.mark.parametrize("raw", [
    b"", b"not json", b"{", b"{\"model\": }", b"[1, 2]", b"[]", b"\"string\"", b"42", b"null", b"true",
    b"\xff\xfe\x00garbage", b"{\"a\": 1} trailing",
])
def test_parse_body_invalid_or_not_an_object(raw):
    assert _parse_body(bytearray(raw)) == {}


def test_parse_body_object():
    body = {"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "héllo 世界"}], "stream": True}
    assert _parse_body(bytearray(json.dumps(body, ensure_ascii=False).encode())) == body
    assert _parse_body(bytearray(b"  {}  ")) == {}


def test_parse_body_deeply_nested_does_not_raise():
    """BUG (see report): ``json.loads`` raises ``RecursionError`` (not a ``ValueError``) on deeply nested input.

    A client POSTing ``[[[[...`` (100k deep) to /v1/chat/completions gets an error response from vLLM, and
    the middleware's background ``_record`` then dies in ``_parse_body``: no ledger record for the request.
    """
    assert _parse_body(bytearray(b"[" * 100_000)) == {}
    assert _parse_body(bytearray(b'{"a":' * 100_000)) == {}
