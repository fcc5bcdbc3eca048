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

from ..helpers.gateway import ADMIN, auth, run_field_mix
from ..helpers.ledger import ledger_row
from ..helpers.monitoring import DASHBOARD, SELECTOR
from ..helpers.streams import END_THINK, stream_then_drop
from ..redis_server import RedisServer
from .servers import Server, early_then_stopped

MODEL = "qwen36-mtp-half"
EARLY_GB = 3  # one server


def start_early(tmp_path_factory) -> dict:
    redis = RedisServer().start()  # the gateway: exact admission and the TPM window under MTP
    return {"redis": redis,
            "mtp": Server(["--model", MODEL, "--qwen-mtp-speculative-tokens", "2", "--qwen-gateway", "true",
                           "--qwen-admin-key", ADMIN, "--qwen-limiter-redis-url", redis.url, "--qwen-spike-factor",
                           "0"], tmp_path_factory.mktemp("logs") / "mtp.log", data_dir=tmp_path_factory.mktemp("mtp"),
                          shipped_layout=True)}


@pytest.fixture(scope="module")
def mtp(request):
    for started in early_then_stopped(request, start_early):
        server = started["mtp"]
        server.wait_healthy()
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            server.key = c.post("/qwen_ext/admin/keys", headers=auth(ADMIN),
                                json={"name": "mtp", "rpm": 100000, "tpm": 10**8}).json()["key"]
        yield server


def client(server) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=300, headers=auth(server.key))


def spec_counters(server) -> dict:
    from qwen_vllm_ext.usage.reconcile import parse_counters

    names = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total"]
    return parse_counters(httpx.get(server.base_url + "/metrics", timeout=30).text, names)


def stream(c, body: dict, rid: str, path: str = "/v1/chat/completions") -> tuple[list[int], list[tuple[int, dict]]]:
    """Generated ids and (ids so far, usage) of every chunk of one streamed chat (or ``path``) request."""
    ids, usages = [], []
    with c.stream("POST", path, json={**body, "stream": True, "return_token_ids": True},
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
    with client(mtp) as c:
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


UNIT = 16  # the launcher's --prefix-match-unit for the family


def _cached(usage) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _kv_copies(server) -> float:
    from qwen_vllm_ext.usage.reconcile import parse_counters

    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return parse_counters(text, ["qwen_ext_kv_answer_state_copies_total"])["qwen_ext_kv_answer_state_copies_total"]


def test_a_prefix_hit_under_mtp_generates_what_an_uncached_request_generates(mtp):
    """vLLM's block copy (the copy-on-write of a partial-block hit) copied one layer view per tensor address; under
    MTP the demo packs its attention layer and a GDN layer at one address, so every hit inside a block read part of
    the attention values as zeros, and greedy outputs left the uncached ones within 2-17 tokens for these prompt
    lengths. With the extension's copy (setting kv_block_copies) a request served from cache generates exactly what
    the same request with a fresh ``cache_salt`` (no hit) generates."""
    with client(mtp) as c:
        base = c.post("/tokenize", json={"model": MODEL, "prompt": "The harbour master logs every boat. " * 20,
                                         "add_special_tokens": False}).json()["tokens"]
        for length in (100, 113, 130):
            prompt = base[:length]
            body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            c.post("/v1/completions", json={**body, "prompt": prompt[:-4]}).raise_for_status()  # the cached prefix
            hit = c.post("/v1/completions", json={**body, "prompt": prompt, "return_token_ids": True}).json()
            fresh = c.post("/v1/completions", json={**body, "prompt": prompt, "return_token_ids": True,
                                                    "cache_salt": f"fresh-{length}"}).json()
            assert _cached(hit["usage"]) > 0 and _cached(fresh["usage"]) == 0, (hit["usage"], fresh["usage"])
            assert _cached(hit["usage"]) % 640, "a hit inside a block (the copy-on-write path)"
            assert hit["choices"][0]["token_ids"] == fresh["choices"][0]["token_ids"], length


@pytest.mark.parametrize("thinking", [False, True])
def test_every_turn_reuses_the_previous_answer_under_mtp(mtp, thinking):
    """Issue 49 step 3: answer checkpoints under speculative decoding. Each turn's prompt (token ids through
    /v1/completions, so the history comes back exactly as generated) is the previous prompt, everything generated,
    and a new user turn. Every turn gets the previous answer from cache: the shared prefix the engine computed,
    floored to the unit, less the one unit vLLM recomputes on every hit under MTP (the drafter needs the target's
    hidden states there: the EAGLE drop, which vLLM applies to its own prompt checkpoints too). That state lies
    inside a verify step whose drafts were partly accepted (the half variant), kept by an offset copy of the step's
    state columns. Counts exact on every turn."""
    from qwen_vllm_ext.kv.reuse import common_prefix

    log = mtp.log_path.read_text(errors="replace")
    assert "answer checkpoints on" in log and "copied from each verify step's state columns" in log
    opener = "<think>\n" if thinking else "<think>\n\n</think>\n\n"
    copies = _kv_copies(mtp)
    with client(mtp) as c:
        def ids_of(text: str) -> list[int]:
            r = c.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        ids = ids_of("<|im_start|>system\n" + "You keep a harbour log. " * 20 + "<|im_end|>\n<|im_start|>user\n"
                     "Log the arrivals.<|im_end|>\n<|im_start|>assistant\n" + opener)
        prev: list[int] = []
        for t in range(4):
            n = 40 + 23 * t
            body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            rid = f"mtp-ans-{thinking}-{t}"
            gen, usages = stream(c, body, rid, "/v1/completions")
            for so_far, chunk_usage in usages:
                assert chunk_usage["completion_tokens"] == so_far, chunk_usage
            usage = usages[-1][1]
            assert len(gen) == n and usage["prompt_tokens"] == len(ids), usage
            shared = common_prefix(prev, ids)
            # the engine computed all of the previous request but its last token, or all of it when the step that
            # produced that token had verified it as a draft
            want = {min(shared, computed) // UNIT * UNIT - UNIT for computed in (len(prev) - 1, len(prev))}
            if t > 0 and not (thinking and t == 1):
                assert _cached(usage) in want, (t, shared, len(prev), usage)
            elif t == 1:
                # thinking on: the first answer's reasoning is not known to come back (no kept think block in the
                # prompt), so no answer state was kept: the turn resumes from the prompt
                assert 0 < _cached(usage) < min(want), (t, shared, usage)
            row = ledger_row(mtp.data_dir, rid)
            assert (row["prompt_tokens"], row["completion_tokens"]) == (len(ids), n)
            prev = ids + gen
            # thinking on: the client keeps the reasoning (closed, with an answer after it), as a client sending
            # preserve_thinking does; the engine then knows from the prompt that each generation comes back
            close = "\n</think>\n\nLogged." if thinking else ""
            ids = prev + ids_of(f"{close}<|im_end|>\n<|im_start|>user\nAnd turn {t}?<|im_end|>\n<|im_start|>"
                                f"assistant\n{opener}")
    assert _kv_copies(mtp) > copies  # the answer states were copies of the steps' state columns


@pytest.mark.parametrize("thinking", [False, True])
def test_every_turn_resumes_where_the_previous_prompt_diverges_under_mtp(mtp, thinking):
    """Turn checkpoints under MTP, the official rendering (``preserve_thinking: false``, canned answers that differ
    from what was generated): each turn shares the previous prompt up to its last ``<|im_start|>assistant\n``, and
    gets it from cache less vLLM's one-unit EAGLE drop (the state a unit before the divergence, the attention layers
    to it); vLLM alone keeps only the prompt's tail, past the divergence whenever the generation prompt crosses a
    unit. Counts exact."""
    from benchmarks.bench_kv_reuse import hybrid_conversation
    from qwen_vllm_ext.kv.reuse import common_prefix

    kwargs = {"enable_thinking": thinking, "preserve_thinking": False}
    prev: list[int] = []
    with client(mtp) as c:
        for k, messages in enumerate(hybrid_conversation(300 + thinking, 5)):
            r = c.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True,
                                          "chat_template_kwargs": kwargs})
            ids = r.json()["tokens"]
            ids2, usages = stream(c, {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0,
                                      "stream_options": {"include_usage": True}, "chat_template_kwargs": kwargs},
                                  f"mtp-turn-{thinking}-{k}")
            usage = usages[-1][1]
            assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == len(ids2)
            shared = common_prefix(prev, ids)
            assert _cached(usage) == max(shared // UNIT * UNIT - UNIT, 0), (k, shared, usage)
            prev = ids


def test_an_aborted_draft_heavy_stream_leaves_no_state_past_its_tokens_and_no_held_block(mtp):
    """Bad input under MTP: a client drops a long stream mid-answer (every step verifies drafts) and sends the next
    turn with the partial answer it received. Nothing the engine computed past the accepted tokens is reachable (a
    rejected draft never reaches the computed length, and every key is a hash of the request's own tokens): the next
    turn is cached to at most the part it shares with the request, less vLLM's one-unit MTP drop, and at least the
    aborted request's prompt. The aborted request's record has the tokens the engine generated; once the engine has
    run further steps, no block is held (the state copies' sources and destinations went back), so the KV cache in
    use returns to zero."""
    prompt_text = ("<|im_start|>system\n" + "You answer at length. " * 20 + "<|im_end|>\n<|im_start|>user\n"
                   "Tell me everything about the harbour.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with client(mtp) as c:
        prompt = c.post("/tokenize", json={"model": MODEL, "prompt": prompt_text,
                                           "add_special_tokens": False}).json()["tokens"]
        drafts = spec_counters(mtp)["vllm:spec_decode_num_draft_tokens_total"]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 600, "ignore_eos": True, "temperature": 0,
                "stream": True, "return_token_ids": True}
        received = stream_then_drop(c, "/v1/completions", body, 3 * UNIT + 5, {"x-request-id": "mtp-dropped"})
        row = ledger_row(mtp.data_dir, "mtp-dropped")
        assert row["prompt_tokens"] == len(prompt) and len(received) <= row["completion_tokens"] < 600
        tail = c.post("/tokenize", json={"model": MODEL, "prompt": "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n"
                                         "<|im_start|>assistant\n", "add_special_tokens": False}).json()["tokens"]
        ids = prompt + received + tail
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 8
        cached = _cached(usage)
        # at most what it shares with the aborted request (its prompt, the tokens the client got, and the tail's
        # first token should the engine have generated that one next), floored, less the drop; at least the prompt's
        # own state
        most = (len(prompt) + len(received) + 1) // UNIT
        assert len(prompt) // UNIT * UNIT - UNIT <= cached <= most * UNIT - UNIT, (cached, len(prompt), len(received))
    assert spec_counters(mtp)["vllm:spec_decode_num_draft_tokens_total"] > drafts  # it was drafting
    deadline = time.monotonic() + 30
    while True:  # idle: every block free (cached ones count as free)
        text = httpx.get(mtp.base_url + "/metrics", timeout=30).text
        usage_perc = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("vllm:kv_cache_usage_perc{")]
        if usage_perc and max(usage_perc) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert usage_perc and max(usage_perc) == 0, usage_perc


def test_gateway_admission_and_tpm_window_are_exact_under_mtp(mtp):
    """The gateway's field mix under MTP (a streamed chunk can carry several tokens): per request the admission
    count equals the engine's prompt tokens and usage stays within the reservation; per key the TPM window holds
    exactly what usage says was used."""
    outcomes, _ = run_field_mix(mtp, seed=49, count=20, name="mix-mtp", model=MODEL)
    assert sum(o[2] == 200 for o in outcomes) >= 0.6 * len(outcomes)
    assert all(o[2] in (200, 400) for o in outcomes), [o for o in outcomes if o[2] not in (200, 400)]


def test_token_storm_accounting_is_clean_under_mtp(mtp, tmp_path):
    """TokenStorm's strict accounting check (every request's usage = the ledger = its own count) with drafts
    accepted and rejected."""
    import subprocess
    import sys

    drafts = spec_counters(mtp)["vllm:spec_decode_num_draft_tokens_total"]
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.bench.token_storm", "--base-url", mtp.base_url,
                           "--model", MODEL, "--api-key", mtp.key, "--ledger", str(mtp.data_dir / "ledger.sqlite3"),
                           "--distribution", "normal", "--input-len", "300", "--output-len", "24", "--concurrency",
                           "4", "--turns", "2", "--num-requests", "8", "--duration", "120", "--field-mix", "0.5",
                           "--output-dir", str(tmp_path), "--strict", "--no-progress", "--no-plot"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    acc = json.loads((tmp_path / "token_storm.json").read_text())["accounting"]
    assert acc["ledger_checked"] and acc["mismatches"] == [] and acc["checked_requests"] == 8
    assert spec_counters(mtp)["vllm:spec_decode_num_draft_tokens_total"] > drafts


def test_the_dashboards_spec_decode_panel_reads_series_this_server_exports(mtp):
    """The Grafana panel "Speculative decoding (MTP): draft acceptance" names vLLM's spec-decode counters with the
    model_name label its selector uses: the MTP server exports each (the monitoring e2e serves a model without a
    speculative config, where they are absent), with values the panel's ratios can be computed from."""
    import re

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
