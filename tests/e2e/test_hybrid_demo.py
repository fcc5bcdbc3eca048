"""E2E on the Qwen3.6-family demo (``--model qwen36-demo``: hybrid Gated DeltaNet + gated attention, the Qwen3.5/3.6
vocabulary, the official Qwen3.5 template served as the prefix-stable ``qwen3.5-reuse``), one shared server for the
module: the launcher's choices, per-chunk usage with exact reasoning tokens (ledger and stream), the gateway's
admission count on the field-coverage mix, the count endpoint, TokenStorm, the doctor, the token-weighted scheduler
and KV reuse across turns. The gateway's keys and limits live in a real Redis, the ledger in SQLite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.bench_kv_reuse import generated_conversation, hybrid_conversation, hybrid_words
from qwen_vllm_ext.demo import HYBRID_SERVED_NAME as MODEL

from ..helpers.conversations import CONVERSATIONS
from ..helpers.doctor import doctor, not_passing
from ..helpers.gateway import ADMIN, auth, run_field_mix
from ..helpers.ledger import ledger_row
from ..helpers.streams import END_THINK, stream_then_drop
from ..redis_server import RedisServer
from .servers import Server, early_then_stopped

EARLY_GB = 3  # one server


def start_early(tmp_path_factory) -> dict:
    redis = RedisServer().start()
    return {"redis": redis,
            "hybrid": Server(["--model", MODEL, "--qwen-gateway", "true", "--qwen-admin-key", ADMIN,
                              "--qwen-limiter-redis-url", redis.url, "--qwen-token-weighted-scheduler", "true",
                              "--qwen-spike-factor", "0"],
                             tmp_path_factory.mktemp("logs") / "hybrid.log",
                             data_dir=tmp_path_factory.mktemp("hybrid"), shipped_layout=True)}


@pytest.fixture(scope="module")
def hybrid_servers(request):
    yield from early_then_stopped(request, start_early)


@pytest.fixture(scope="module")
def hybrid(hybrid_servers):
    server = hybrid_servers["hybrid"]
    server.wait_healthy()
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        key = c.post("/qwen_ext/admin/keys", headers=auth(ADMIN),
                     json={"name": "hybrid", "rpm": 100000, "tpm": 10**8}).json()["key"]
    return server, server.data_dir, key


def client(server, key):
    return httpx.Client(base_url=server.base_url, timeout=300, headers=auth(key))


def test_the_launcher_serves_the_family(hybrid):
    server, _, _ = hybrid
    log = server.log_path.read_text(errors="replace")
    assert "Qwen3NextForCausalLM" in log and "Mamba cache mode is set to 'align'" in log
    assert "turn checkpoints on" in log  # the engine core applied the runtime patch and qualified
    assert "answer checkpoints on" in log and "qwen3.5-reuse template" in log
    cmd = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.serve", "--model", MODEL, "--print-command"],
                         capture_output=True, text=True, timeout=300).stdout.splitlines()
    for flag in ("--dtype bfloat16", "--reasoning-parser qwen3", "--tool-call-parser qwen3_coder",
                 "--enable-auto-tool-choice", "--prefix-match-unit 16", f"--served-model-name {MODEL}",
                 '--default-chat-template-kwargs {"preserve_thinking": "answers"}'):
        assert flag in cmd, (flag, cmd)
    assert any(line.startswith("--chat-template ") and line.endswith("/qwen3.5-reuse.jinja") for line in cmd), cmd
    health = httpx.get(server.base_url + "/qwen_ext/health", timeout=30).json()
    assert health["settings"]["gateway"] is True


@pytest.mark.parametrize("stream", [True, False])
def test_reasoning_tokens_are_exact_on_every_chunk_and_in_the_ledger(hybrid, stream):
    server, data, key = hybrid
    with client(server, key) as c:
        for i in range(4):
            rid = f"hybrid-think-{stream}-{i}"
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Think about {i} + {i}."}],
                    "max_tokens": 40 + 7 * i, "return_token_ids": True, "stream": stream}
            headers = {"x-request-id": rid}
            if stream:
                ids, usages = [], []
                with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as s:
                    assert s.status_code == 200
                    for line in s.iter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            for ch in chunk["choices"]:
                                ids += ch.get("token_ids") or []
                            usages.append((len(ids), chunk["usage"]))
                for n, usage in usages:  # every chunk: the exact count so far
                    assert usage["completion_tokens"] == n
                    before = ids[:n].index(END_THINK) if END_THINK in ids[:n] else n
                    assert usage["completion_tokens_details"]["reasoning_tokens"] == before, (n, usage)
                final = usages[-1][1]
            else:
                r = c.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                ids, final = r.json()["choices"][0]["token_ids"], r.json()["usage"]
            before = ids.index(END_THINK) if END_THINK in ids else len(ids)
            assert final["completion_tokens"] == len(ids) == body["max_tokens"]
            assert final["completion_tokens_details"]["reasoning_tokens"] == before
            row = ledger_row(data, rid)
            assert (row["completion_tokens"], row["reasoning_tokens"]) == (len(ids), before)
            assert row["prompt_tokens"] == final["prompt_tokens"]
            # streamed or not, the response's cached tokens and billing are the record's (issue 46)
            assert final["prompt_tokens_details"]["cached_tokens"] == row["cached_tokens"]
            assert round(float(final["billing"]["total_units"]) * 1_000_000) == \
                row["billed_prompt_micro"] + row["billed_completion_micro"]


def test_thinking_reads_the_same_under_both_names_with_the_openai_sdk_and_litellm(hybrid):
    """reasoning_field=both (the default): message.reasoning and message.reasoning_content hold the same text, and
    every streamed delta carries both (docs/launcher-and-profiles.md). Read by the openai SDK and by LiteLLM."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list from the package, not the network
    import litellm
    import openai

    server, _, key = hybrid
    sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key)
    messages = [{"role": "user", "content": "Think about 3 + 4."}]
    done = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    message = done.choices[0].message
    assert message.reasoning and message.reasoning == message.reasoning_content, message  # extra fields, as attributes
    thought = {"reasoning": "", "reasoning_content": ""}
    for chunk in sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content"), delta
            for name in thought:
                thought[name] += delta.get(name) or ""
    assert thought["reasoning"] and thought["reasoning"] == thought["reasoning_content"]
    via_litellm = litellm.completion(model=f"hosted_vllm/{MODEL}", api_base=server.base_url + "/v1", api_key=key,
                                     messages=messages, max_tokens=12)
    assert via_litellm.choices[0].message.reasoning_content, via_litellm.choices[0].message
    assert via_litellm.usage.completion_tokens == 12


def test_thinking_off_counts_no_reasoning(hybrid):
    server, data, key = hybrid
    with client(server, key) as c:
        r = c.post("/v1/chat/completions", headers={"x-request-id": "hybrid-nothink"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                         "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["token_ids"]
        opened = 248068 in ids  # the model may still open a block itself; then only its inside counts
        usage = r.json()["usage"]
        if not opened:
            assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
        assert ledger_row(data, "hybrid-nothink")["reasoning_tokens"] == \
            usage["completion_tokens_details"]["reasoning_tokens"]


def test_count_endpoint_and_gateway_count_equal_the_engine(hybrid):
    from qwen_v3_calculator import count_chat

    server, _, key = hybrid
    checked = 0
    with client(server, key) as c:
        for name in ("single_user", "with_system", "multi_turn", "reasoning_kept_after_last_query",
                     "consecutive_tool_results", "content_parts_and_newline", "seed1", "seed2", "seed5", "seed8"):
            messages, tools, kwargs = CONVERSATIONS[name]
            body = {"model": MODEL, "messages": messages, "max_tokens": 1}
            if tools:
                body["tools"] = tools
            if kwargs.get("enable_thinking") is not None:
                body["chat_template_kwargs"] = {"enable_thinking": kwargs["enable_thinking"]}
            r = c.post("/v1/chat/completions", json=body)
            if r.status_code != 200:  # the template refuses the chat (no user query): a 400, never a miscount
                assert r.status_code == 400, r.text
                continue
            engine = r.json()["usage"]["prompt_tokens"]
            assert int(r.headers["x-qwen-prompt-tokens"]) == engine, name
            counted = c.post("/v1/tokens/count", json={k: v for k, v in body.items() if k != "max_tokens"}).json()
            assert counted["prompt_tokens"] == engine and counted["model"] == MODEL, name
            # the launcher serves the prefix-stable template for the family
            assert count_chat(messages, tools=tools, model="qwen3.6", template="qwen3.5-reuse", **kwargs) == engine, name
            checked += 1
    assert checked >= 8
    # scripts with combining marks (split differently by the Qwen2 and Qwen3.5 rules): vLLM's tokenizer must agree
    marks = [{"role": "user", "content": "ผู้ประกอบการ เว็บไซต์ नमस्ते दुनिया Tiếng Việt"},
             {"role": "assistant", "content": "ยินดีต้อนรับ हिन्दी"}, {"role": "user", "content": "ต่อ"}]
    with client(server, key) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": marks, "max_tokens": 1})
        assert r.status_code == 200, r.text
        engine = r.json()["usage"]["prompt_tokens"]
        assert int(r.headers["x-qwen-prompt-tokens"]) == engine == count_chat(marks, model="qwen3.6",
                                                                              template="qwen3.5-reuse")
    # the official merges (issue 46): words a rank-capped merge list missed, in Russian, Chinese, Arabic, Indonesian;
    # the engine's own tokenizer (the demo's tokenizer.json), the count endpoint, the gateway and the calculator agree
    from qwen_v3_calculator import count_tokens

    for text, official in (("Это является важным вопросом, и они являются экспертами.", 11),
                           ("人力资源和社会保障部发布通知，人力资源市场稳定。", 9),
                           ("قال المصري إن نسبة البطالة أخرى، والمصدر مقتل وهناك", 12),
                           ("Kami akan melanjutkan diskusi; anjutkan", 8)):
        with client(server, key) as c:
            ids = c.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
            assert ids["count"] == official == count_tokens(text, model="qwen3.6"), (text, ids)
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == official, r.text
            assert int(r.headers["x-qwen-prompt-tokens"]) == official


def test_field_coverage_admission_count_equals_engine_count(hybrid):
    """The gateway's field mix (every field that changes the prompt or the reservation) on the Qwen3.5 template."""
    server, _, _ = hybrid
    outcomes, _ = run_field_mix(server, seed=36, count=150, name="mix-qwen36", model=MODEL)
    admitted = [o for o in outcomes if o[2] == 200]
    assert len(admitted) >= 0.6 * len(outcomes)
    other = [o for o in outcomes if o[2] != 200 and o[3] != "unsupported_parameter"]
    assert all(o[2] == 400 for o in other), other


def test_token_storm_accounting_is_clean(hybrid, tmp_path):
    server, data, key = hybrid
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.bench.token_storm", "--base-url", server.base_url,
                           "--model", MODEL, "--api-key", key, "--ledger", str(data / "ledger.sqlite3"),
                           "--distribution", "normal", "--input-len", "300", "--output-len", "16", "--concurrency",
                           "4", "--turns", "2", "--num-requests", "16", "--duration", "120", "--field-mix", "0.5",
                           "--output-dir", str(tmp_path), "--strict", "--no-progress", "--no-plot"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((tmp_path / "token_storm.json").read_text())
    assert "qwen3.6 vocabulary" in rep["run"]["template"]
    acc = rep["accounting"]
    assert acc["ledger_checked"] and acc["mismatches"] == [] and acc["checked_requests"] == 16
    assert rep["throughput"]["completed"] == 16 and rep["errors"] == {}


def test_doctor_passes_every_check(hybrid):
    server, _, key = hybrid
    code, checks = doctor(server, "--api-key", key, "--admin-key", ADMIN)
    assert code == 0 and not_passing(checks) == [], not_passing(checks)
    assert "TokenWeighted" in checks["scheduler"]["seen"]


def test_token_weighted_scheduler_on_the_hybrid_engine(hybrid):
    """The scheduler ran every request above (none lost or duplicated: the ledger checks, TokenStorm) and reports its
    state; the online step-cost fit has learned from this engine, whose Gated DeltaNet layers prefill in linear time
    (its fitted model is recorded in the docs from a run of this server)."""
    server, _, _ = hybrid
    statuses = httpx.get(server.base_url + "/qwen_ext/health", timeout=30).json()["scheduler"]
    assert statuses and statuses[0]["scheduler"].startswith("TokenWeighted")
    stats = statuses[0]["stats"]
    assert stats["cost_steps_fitted"] > 0 and stats["queue_wait_p99_s"] is not None
    print("hybrid scheduler costs:", json.dumps(statuses[0]["costs"]))
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert "qwen_ext_sched_cost_steps_fitted" in metrics


# ---- KV reuse across turns: turn checkpoints (official template), answer checkpoints (prefix-stable template) -----
UNIT = 16  # the launcher's --prefix-match-unit for the family
# generated answers of 20-200 tokens (the benchmark's run to 600): every answer still spans units, the conversations'
# prompts still pass the demo's attention block (asserted below), and the three take 23 s alone instead of 57
ANSWERS = (20, 80, 200)
BLOCK = 640  # the demo engine's attention block ("Setting attention block size to 640 tokens" in its log)


def _turn(c, messages, thinking: bool, conversation: str, kwargs: dict | None = None) -> tuple[list[int], dict]:
    """(prompt ids from /tokenize, final streamed usage) of one request, rendered as the official Qwen3.5 template
    renders it (``preserve_thinking: false`` on the served ``qwen3.5-reuse`` template) unless ``kwargs`` say
    otherwise."""
    kwargs = kwargs or {"enable_thinking": thinking, "preserve_thinking": False}
    tok = c.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True,
                                    "chat_template_kwargs": kwargs})
    assert tok.status_code == 200, tok.text
    usage = None
    with c.stream("POST", "/v1/chat/completions", headers={"x-session-id": conversation},
                  json={"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True,
                        "chat_template_kwargs": kwargs}) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return tok.json()["tokens"], usage


def _cached(usage) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.mark.parametrize("thinking", [True, False])
def test_every_turn_resumes_where_the_previous_prompt_diverges(hybrid, thinking):
    """Official Qwen3.5 template: each request shares the previous prompt up to its last <|im_start|>assistant\\n;
    with turn checkpoints every turn gets exactly that much (floored to the match unit) from cache — no fallback to
    an older checkpoint (vLLM alone keeps only the prompt's tail, which lies past the divergence whenever the
    generation prompt crosses a unit boundary). Counts stay exact."""
    from qwen_vllm_ext.kv.reuse import common_prefix

    server, _, key = hybrid
    prev: list[int] = []
    with client(server, key) as c:
        for k, messages in enumerate(hybrid_conversation(100 + thinking, 10)):
            ids, usage = _turn(c, messages, thinking, f"turns-{thinking}")
            assert usage["prompt_tokens"] == len(ids)
            shared = common_prefix(prev, ids)
            assert _cached(usage) == shared // UNIT * UNIT, (k, shared, usage)
            prev = ids


@pytest.mark.parametrize("thinking,preserve", [(False, None), (True, True)])
def test_answers_are_reused_with_the_prefix_stable_template(hybrid, thinking, preserve):
    """The launcher serves the family with ``qwen3.5-reuse``: fed back as vLLM's reasoning parser returned it, the
    previous prompt and everything the model generated come back token for token, and the answer checkpoints give
    every turn all of it from cache, to the match unit (the last generated token was never computed) -- the
    previous answer (20-200 tokens) is not prefilled again. Thinking off, with the server's default
    (``preserve_thinking: "answers"``); thinking on, for a client that keeps the reasoning
    (``preserve_thinking: true``). Counts stay exact."""
    server, _, key = hybrid
    extra = {} if preserve is None else {"preserve_thinking": preserve}
    with client(server, key) as c:
        turns = generated_conversation(c, f"answers-{thinking}", 7 + thinking, 6, thinking, hybrid_words(), extra,
                                       ANSWERS)
    assert turns[-1]["prompt_tokens"] > BLOCK, turns[-1]  # the kept states span more than one block
    for k, turn in enumerate(turns[1:], 1):
        assert turn["shared"] == turn["prev_seen"], (k, turn)  # prefix-stable: all of it comes back
        if thinking and k == 1:
            # the engine reads from the prompt whether reasoning comes back (a kept think block in the history):
            # the first request has none, so its generation kept no answer state and the turn checkpoint serves
            assert 0 < turn["cached_tokens"] < turn["bound"], (k, turn)
            continue
        assert turn["cached_tokens"] == turn["bound"] >= turn["prev_seen"] - 2 * UNIT, (k, turn)


def test_thinking_on_by_default_drops_earlier_reasoning_and_resumes_at_the_turn(hybrid):
    """Issue 48: by default (``preserve_thinking: "answers"``) a turn generated with thinking on comes back as the
    official template renders it, its reasoning dropped (not re-sent, re-billed and re-prefilled every turn): each
    request shares the previous prompt up to its last ``<|im_start|>assistant\n`` and gets exactly that from cache
    (the turn checkpoint), floored to the match unit."""
    server, _, key = hybrid
    with client(server, key) as c:
        turns = generated_conversation(c, "answers-default-on", 17, 4, True, hybrid_words(), answers=ANSWERS)
    for k, turn in enumerate(turns[1:], 1):
        assert turn["shared"] < turn["prev_seen"], (k, turn)  # the reasoning is not in the next prompt
        assert turn["cached_tokens"] == turn["shared"] // UNIT * UNIT, (k, turn)


def test_edited_history_falls_back_and_counts_stay_exact(hybrid):
    """A client that edits an earlier message or drops a turn: the request is served from the longest prefix still
    cached (never more than it shares with what was computed), the counts stay exact, and the next turn of the
    edited branch is fully reused again."""
    from qwen_vllm_ext.kv.reuse import common_prefix

    server, _, key = hybrid
    convo = hybrid_conversation(300, 5)
    with client(server, key) as c:
        seen: list[list[int]] = []
        for messages in convo:
            ids, usage = _turn(c, messages, True, "edited")
            seen.append(ids)
        edited = [dict(m) for m in convo[-1]]
        edited[3]["content"] = edited[3]["content"] + " (edited)"  # the second user message
        ids, usage = _turn(c, edited, True, "edited")
        assert usage["prompt_tokens"] == len(ids)
        best = max(common_prefix(s, ids) for s in seen)
        # at least request 0's turn checkpoint (the edit is after it), at most what any computed prompt shares
        kept = common_prefix(seen[0], seen[1]) // UNIT * UNIT
        assert _cached(usage) % UNIT == 0 and 0 < kept <= _cached(usage) <= best // UNIT * UNIT
        # the edited branch continues: its next turn resumes at the divergence again
        follow = edited + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "and then?"}]
        ids2, usage2 = _turn(c, follow, True, "edited")
        assert usage2["prompt_tokens"] == len(ids2)
        assert _cached(usage2) == common_prefix(ids, ids2) // UNIT * UNIT
        # a dropped turn: the history without the last exchange is a prefix of what was computed before
        dropped = convo[-1][:-2] + [{"role": "user", "content": "start over from here"}]
        ids3, usage3 = _turn(c, dropped, True, "edited")
        assert usage3["prompt_tokens"] == len(ids3)
        # it diverges inside request 3's prompt, where no state was kept: request 2's turn checkpoint at least
        kept = common_prefix(seen[2], seen[3]) // UNIT * UNIT
        best = max(common_prefix(s, ids3) for s in seen + [ids, ids2])
        assert _cached(usage3) % UNIT == 0 and kept <= _cached(usage3) <= best // UNIT * UNIT


def test_a_disconnect_mid_answer_falls_back_to_a_kept_state_and_counts_stay_exact(hybrid):
    """Issue 48, bad input: a client drops the stream mid-answer and sends the next turn with the partial answer it
    received. The aborted request keeps at most its newest answer state, which may lie past what the client got, so
    the next turn is served from the longest state still on its path: at least the aborted request's prompt (its
    turn checkpoint), never more than it shares with what the engine computed. The aborted request's record has the
    tokens the engine generated, and the engine serves on."""
    from qwen_vllm_ext.kv.reuse import common_prefix

    server, data, key = hybrid
    words = hybrid_words()
    messages = [{"role": "system", "content": "You answer at length. " * 20},
                {"role": "user", "content": "Tell me everything about the harbour, in order."}]
    kwargs = {"enable_thinking": False}
    body = {"model": MODEL, "messages": messages, "max_tokens": 600, "ignore_eos": True, "temperature": 0,
            "allowed_token_ids": list(words), "stream": True, "return_token_ids": True,
            "chat_template_kwargs": kwargs}
    with client(server, key) as c:
        prompt = c.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True,
                                           "chat_template_kwargs": kwargs}).json()["tokens"]
        received = stream_then_drop(c, "/v1/chat/completions", body, 3 * UNIT + 5,
                                    {"x-session-id": "dropped", "x-request-id": "dropped-mid-answer"})
        row = ledger_row(data, "dropped-mid-answer")
        assert row["prompt_tokens"] == len(prompt) and row["completion_tokens"] >= len(received)
        follow = messages + [{"role": "assistant", "content": "".join(words[i] for i in received)},
                             {"role": "user", "content": "Go on."}]
        ids, usage = _turn(c, follow, False, "dropped", kwargs)
    assert usage["prompt_tokens"] == len(ids)
    assert ids[:len(prompt) + len(received)] == prompt + received  # prefix-stable: the partial answer comes back
    kept = (len(prompt) - 1) // UNIT * UNIT  # the aborted request's prompt-tail state at least
    computed = len(prompt) + row["completion_tokens"] - 1
    most = min(common_prefix(prompt + received, ids), computed) // UNIT * UNIT
    assert _cached(usage) % UNIT == 0 and kept <= _cached(usage) <= most, (_cached(usage), kept, most)


def test_kv_counters_are_on_metrics(hybrid):
    """Issue 48: the engine core's answer-state copies (the reuse tests above made some) reach the API server's
    /metrics, with the skipped and superseded counters beside them."""
    from prometheus_client.parser import text_string_to_metric_families

    server, _, _ = hybrid
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(server.base_url + "/metrics", timeout=30).text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name.startswith("qwen_ext_kv_")}
        if samples.get("qwen_ext_kv_answer_state_copies_total", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert samples["qwen_ext_kv_answer_state_copies_total"] > 0, samples
    assert "qwen_ext_kv_answer_state_copies_skipped_total" in samples and \
        "qwen_ext_kv_states_superseded_total" in samples, samples


def test_every_request_field_alone_and_in_mixed_batches_keeps_the_engine_up(hybrid):
    """Issue 46 on the hybrid engine: every field vLLM accepts, alone and in mixed concurrent batches
    (tests/e2e/field_sweep.py): a 200 or a 400 naming the field; the engine stays up. Last in the module: its ~200
    requests churn the prefix cache, which the KV-reuse tests above read."""
    from .field_sweep import sweep

    server, _, key = hybrid
    print(sweep(server.base_url, lambda: key, MODEL))
