"""Issue 49: the hybrid demo with an MTP head, served with MTP speculative decoding and prefix caching through the
launcher (``--qwen-mtp-speculative-tokens 2``). The ``qwen36-mtp-half`` variant accepts about half of its drafts, so
one server shows accepted and rejected drafts; counts stay exact on every streamed chunk (a chunk can carry several
tokens) and in the ledger. Prefix caching on needs the CPU implementations of the two fused Triton kernels that
speculative decoding on a hybrid model launches (``qwen_vllm_ext/spec/cpu_mamba_kernels.py``): without them the engine
dies on the first request."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from .conftest import Server, early_then_stopped
from .test_hybrid_demo import END_THINK, ledger_row

MODEL = "qwen36-mtp-half"
EARLY_GB = 3  # one server


def start_early(tmp_path_factory) -> dict:
    return {"mtp": Server(["--model", MODEL, "--qwen-mtp-speculative-tokens", "2"],
                          tmp_path_factory.mktemp("logs") / "mtp.log", data_dir=tmp_path_factory.mktemp("mtp"))}


@pytest.fixture(scope="module")
def mtp(request):
    for started in early_then_stopped(request, start_early):
        started["mtp"].wait_healthy()
        yield started["mtp"]


def spec_counters(server) -> dict:
    from qwen_vllm_ext.usage.reconcile import parse_counters

    names = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total"]
    return parse_counters(httpx.get(server.base_url + "/metrics", timeout=30).text, names)


def stream(c, body: dict, rid: str) -> tuple[list[int], list[tuple[int, dict]]]:
    """Generated ids and (ids so far, usage) of every chunk of one streamed chat request."""
    ids, usages = [], []
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "return_token_ids": True},
                  headers={"x-request-id": rid}) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for ch in chunk["choices"]:
                    ids += ch.get("token_ids") or []
                if chunk.get("usage"):
                    usages.append((len(ids), chunk["usage"]))
    return ids, usages


@pytest.mark.parametrize("thinking", [True, False])
def test_drafts_are_accepted_and_rejected_and_every_chunk_counts_exactly(mtp, thinking):
    before = spec_counters(mtp)
    with httpx.Client(base_url=mtp.base_url, timeout=300) as c:
        for i in range(3):
            rid = f"mtp-{thinking}-{i}"
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count the boats in harbour {i}."}],
                    "max_tokens": 48 + 16 * i, "temperature": 0, "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    "chat_template_kwargs": {"enable_thinking": thinking}}
            ids, usages = stream(c, body, rid)
            assert len(ids) == body["max_tokens"]
            for n, usage in usages:  # every chunk: the exact count so far, however many tokens it carries
                assert usage["completion_tokens"] == n, (n, usage)
                before_end = ids[:n].index(END_THINK) if END_THINK in ids[:n] else n
                want = before_end if thinking else 0
                assert usage["completion_tokens_details"]["reasoning_tokens"] == want, (n, usage)
            final = usages[-1][1]
            row = ledger_row(mtp.data_dir, rid)
            assert (row["prompt_tokens"], row["completion_tokens"]) == (final["prompt_tokens"], len(ids))
            assert row["reasoning_tokens"] == final["completion_tokens_details"]["reasoning_tokens"]
    deadline = time.monotonic() + 10
    while True:  # the engine's counters reach /metrics within its logging interval
        after = spec_counters(mtp)
        grew = {k: after[k] - before[k] for k in after}
        if grew["vllm:spec_decode_num_drafts_total"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    drafted = grew["vllm:spec_decode_num_draft_tokens_total"]
    accepted = grew["vllm:spec_decode_num_accepted_tokens_total"]
    print(f"mtp thinking={thinking}: {accepted:.0f} of {drafted:.0f} draft tokens accepted")
    assert drafted > 0 and 0 < accepted < drafted, grew  # the half variant: some accepted, some rejected


def test_prefix_caching_serves_later_turns_from_cache_with_mtp(mtp):
    """Speculative decoding and prefix caching together on the hybrid engine (the fused state copies run on the CPU
    implementations): a conversation's second request gets its shared prefix from cache (vLLM's own checkpoint at
    the previous prompt's tail, floored to the match unit), and the engine serves on."""
    from qwen_vllm_ext.kv.reuse import common_prefix

    messages = [{"role": "system", "content": "You keep a harbour log. " * 30},
                {"role": "user", "content": "Log the morning arrivals."}]
    kwargs = {"enable_thinking": False}
    with httpx.Client(base_url=mtp.base_url, timeout=300) as c:
        def tokens(msgs):
            r = c.post("/tokenize", json={"model": MODEL, "messages": msgs, "add_generation_prompt": True,
                                          "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "chat_template_kwargs": kwargs}
        first = tokens(messages)
        ids, usages = stream(c, {**body, "messages": messages}, "mtp-cache-1")
        follow = messages + [{"role": "assistant", "content": "Three boats."}, {"role": "user", "content": "And now?"}]
        second = tokens(follow)
        ids2, usages2 = stream(c, {**body, "messages": follow}, "mtp-cache-2")
    final = usages2[-1][1]
    cached = (final.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    shared = common_prefix(first, second)
    assert final["prompt_tokens"] == len(second) and len(ids2) == 40
    assert 0 < cached <= shared // 16 * 16, (cached, shared)


def test_the_dashboards_spec_decode_panel_reads_series_this_server_exports(mtp):
    """The Grafana panel "Speculative decoding (MTP): draft acceptance" names vLLM's spec-decode counters with the
    model_name label its selector uses: the MTP server exports each (the monitoring e2e serves a model without a
    speculative config, where they are absent), with values the panel's ratios can be computed from."""
    import re

    from .test_monitoring import DASHBOARD, SELECTOR  # the committed JSON and the series pattern the monitoring e2e reads

    panel, = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"].startswith("Speculative decoding")]
    names = {m.group(1) for t in panel["targets"] for m in SELECTOR.finditer(t["expr"])}
    assert names == {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_total"}
    text = httpx.get(mtp.base_url + "/metrics", timeout=30).text
    for name in names:
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="{MODEL}"[^}}]*\}} [0-9.e+]+$', text, re.M), name
    c = spec_counters(mtp)
    assert c["vllm:spec_decode_num_drafts_total"] > 0  # the tests above ran requests
    assert 0 < c["vllm:spec_decode_num_accepted_tokens_total"] < c["vllm:spec_decode_num_draft_tokens_total"]
