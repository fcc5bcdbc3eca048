"""E2E: KV-cache reuse across turns on the demo server (real vLLM, real Qwen3 tokenizer, prefix caching on).

The demo server runs the launcher's default, KV-reuse mode (the ``qwen3-reuse`` template). Scripted 10-turn
conversations, thinking on and off, feed the generated assistant turns back (with the scripted reasoning — see
benchmarks/bench_kv_reuse.py for how a random-weight model is made to "think"). Stock mode is the same server with
``preserve_thinking=false`` per request, which renders exactly as the official Qwen3 template
(tests/unit/test_kv_reuse_template.py).

* reuse mode, canonical answers (re-tokenization gives back the generated ids): every turn after the first reports
  ``cached_tokens`` covering the previous turn's full prompt + completion down to the block boundary;
* reuse mode, free generation: the template never breaks the match (the previous prompt is always a prefix); only
  non-canonical generated ids can — the pitfall kept apart from template breakage;
* stock mode: the match ends inside the previous prompt (why the mode exists), and the cache covers no more.
The ledger records the conversation id and the reuse ratio; /metrics has the histogram; a malformed
``x-conversation-id`` gets an OpenAI-shaped 400; idle sleep is refused at startup on the CPU build.
"""
from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import httpx
import pytest

from benchmarks.bench_kv_reuse import run_conversation, word_token_ids
from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

TURNS = 10


@pytest.fixture(scope="module")
def block_size(demo_server):
    with urllib.request.urlopen(demo_server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    line = re.search(r"^vllm:cache_config_info\{.*$", text, re.M)
    assert line, "vllm:cache_config_info not on /metrics"
    assert 'enable_prefix_caching="True"' in line.group(0)
    return int(re.search(r'[{,]block_size="(\d+)"', line.group(0)).group(1))


@pytest.fixture(scope="module")
def words():
    return word_token_ids()


def floor_block(n: int, block: int) -> int:
    return (n // block) * block


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking-on", "thinking-off"])
def test_reuse_mode_serves_the_previous_turn_from_cache(demo_server, block_size, words, thinking):
    conv = f"e2e-reuse-{'on' if thinking else 'off'}"
    turns = run_conversation(demo_server.base_url, conv, thinking=thinking, feedback="canonical", turns=TURNS,
                             word_ids=words)
    assert turns[0]["prompt_tokens"] == len(turns[0]["prompt_ids"])
    for n, turn in enumerate(turns[1:], start=2):
        prev = turns[n - 2]
        seen = prev["prompt_ids"] + prev["gen_ids"]
        assert len(seen) == turn["prev_tokens"], "usage counts = the ids the engine saw and generated"
        assert turn["lcp"] == len(seen), f"turn {n}: the previous prompt + completion is a token prefix"
        assert turn["cached_tokens"] >= floor_block(turn["prev_tokens"] - 1, block_size), (n, turn["cached_tokens"])
        assert turn["cached_tokens"] <= turn["prompt_tokens"] - 1
    _check_ledger(demo_server, conv, turns)


def _check_ledger(server, conv, turns):
    store = SqliteLedgerStore(str(server.data_dir / "ledger.sqlite3"))
    try:
        records = [r for r in store.records() if r.conversation_id == conv]
    finally:
        store.close()
    records.sort(key=lambda r: r.received_at)
    assert len(records) == len(turns)
    assert records[0].reuse_ratio is None  # first turn: nothing to reuse
    for record, turn in zip(records[1:], turns[1:]):
        assert record.cached_tokens == turn["cached_tokens"]
        assert record.reuse_ratio == pytest.approx(turn["cached_tokens"] / turn["prev_tokens"])


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking-on", "thinking-off"])
def test_reuse_mode_with_free_generation_breaks_only_inside_the_completion(demo_server, block_size, thinking):
    """The pitfall: free sampling of a random model emits ids that re-tokenize differently. The template part is
    still reused in full (the previous prompt is always a prefix); the cache covers exactly up to the first
    differing id, down to the block boundary."""
    turns = run_conversation(demo_server.base_url, f"e2e-free-{'on' if thinking else 'off'}", thinking=thinking,
                             feedback="generated", turns=TURNS)
    for n, turn in enumerate(turns[1:], start=2):
        assert turn["lcp"] >= turn["prev_prompt_tokens"], f"turn {n}: the template broke the prefix"
        reusable = min(turn["lcp"], turn["prev_tokens"] - 1)
        assert floor_block(reusable, block_size) <= turn["cached_tokens"] <= turn["lcp"], n


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking-on", "thinking-off"])
def test_stock_mode_breaks_reuse_at_the_previous_turn(demo_server, block_size, words, thinking):
    stock = run_conversation(demo_server.base_url, f"e2e-stock-{'on' if thinking else 'off'}", thinking=thinking,
                             feedback="canonical", preserve=False, turns=TURNS, word_ids=words)
    for n, turn in enumerate(stock[1:], start=2):
        # thinking on: the reasoning of the previous turn is dropped; off: its empty think block is missing
        assert turn["lcp"] < turn["prev_prompt_tokens"], n
        assert turn["cached_tokens"] <= floor_block(turn["lcp"], block_size), n
        assert turn["cached_tokens"] < turn["prev_prompt_tokens"]  # none of the previous completion is reused


def test_reuse_metric_and_conversation_id_errors(demo_server):
    run_conversation(demo_server.base_url, "e2e-metric", thinking=False, feedback="canned", turns=2)
    with urllib.request.urlopen(demo_server.base_url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    count = re.search(r"^qwen_ext_kv_reuse_ratio_count(?:\{[^}]*\})? ([0-9.e+]+)$", metrics, re.M)
    assert count and float(count.group(1)) >= 1
    body = {"model": "qwen3-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(demo_server.base_url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"x-conversation-id": "has spaces; and quotes\""})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_conversation_id" and err["param"] == "x-conversation-id"
    assert err["type"] == "invalid_request_error" and "x-conversation-id must be" in err["message"]
    # the `user` field is a conversation id too
    for _ in range(2):
        r = httpx.post(demo_server.base_url + "/v1/chat/completions", json={**body, "user": "e2e-user-field"},
                       timeout=60)
        assert r.status_code == 200
    store = SqliteLedgerStore(str(demo_server.data_dir / "ledger.sqlite3"))
    try:
        recs = sorted((x for x in store.records() if x.conversation_id == "e2e-user-field"), key=lambda x: x.received_at)
    finally:
        store.close()
    assert len(recs) == 2 and recs[0].reuse_ratio is None and recs[1].reuse_ratio is not None
    health = httpx.get(demo_server.base_url + "/qwen_ext/health", timeout=30).json()["kv_reuse"]
    assert health["reuse_template"] is True and health["template"] == "qwen3-reuse"
    assert health["conversations_tracked"] >= 2 and health["idle_sleep"] is None


def test_idle_sleep_is_refused_on_the_cpu_build(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.serve", "--qwen-idle-sleep-s", "300",
                           "--qwen-data-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "idle_sleep_s=300 needs vLLM's sleep mode, which this platform does not support" in proc.stderr


def test_count_endpoint_uses_the_served_reuse_template(demo_server):
    """The server's calculator (also the gateway's exact admission count) counts with the template vLLM serves:
    history reasoning kept, so the count equals vLLM's prompt_tokens in reuse mode and in stock mode."""
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add the numbers."},
                {"role": "user", "content": "and 3+3?"}]
    for kwargs in ({}, {"preserve_thinking": False}, {"enable_thinking": False}):
        body = {"model": "qwen3-demo", "messages": messages, "max_tokens": 1}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        served = httpx.post(demo_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()
        counted = httpx.post(demo_server.base_url + "/v1/tokens/count", timeout=60,
                             json={"messages": messages, "chat_template_kwargs": kwargs}).json()
        assert counted["prompt_tokens"] == served["usage"]["prompt_tokens"], kwargs
