"""E2E: the launcher serves the demo model through real vLLM; the extension is active in every process."""
import json
import time
import urllib.request

from qwen_vllm_ext import __version__
from qwen_vllm_ext.demo import SERVED_NAME


def test_models_lists_the_demo_model(openai_client):
    assert [m.id for m in openai_client.models.list().data] == [SERVED_NAME]


def test_chat_completion(openai_client):
    resp = openai_client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    # Qwen3 ChatML: <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n  = 9 tokens
    assert resp.usage.prompt_tokens == 9
    assert resp.usage.completion_tokens == 8 and resp.choices[0].message.content


def test_streamed_chat_completion(openai_client):
    stream = openai_client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if not c.choices]
    assert len(chunks) >= 3 and text
    assert len(finals) == 1 and finals[0].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert finals[0].usage.total_tokens == finals[0].usage.prompt_tokens + 6


def test_completion(openai_client):
    resp = openai_client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 2  # 'hello' ' world'; Qwen adds no BOS
    assert resp.choices[0].text and resp.usage.completion_tokens == 5


def test_extension_health_reports_plugin_in_api_server_and_engine_core(demo_server):
    with urllib.request.urlopen(demo_server.base_url + "/qwen_ext/health", timeout=10) as r:
        health = json.load(r)
    assert health["version"] == __version__ and health["vllm_version"].startswith("0.32")
    assert health["patching"] is True
    assert {"api_server", "engine_core"} <= set(health["plugin_loaded_in"])
    assert all(p["extension_version"] == __version__ for p in health["processes"])


def test_token_weighted_scheduler_active_in_the_engine_core(demo_server, openai_client):
    """The scheduler in auto mode (monkeypatch mode) runs in the engine core behind its gate; completions stay correct,
    a structured-output request (the grammar compiles while it waits in the queue) gets schema-valid JSON."""
    for i in range(3):
        resp = openai_client.completions.create(model=SERVED_NAME, prompt=f"count {i}", max_tokens=4,
                                                extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 4
    import time

    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(demo_server.base_url + "/qwen_ext/health", timeout=10) as r:
            health = json.load(r)
        if health["scheduler"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    engine = [p for p in health["processes"] if p["role"] == "engine_core"]
    assert engine and "token_weighted_scheduler" in engine[0]["patches"]
    (scheduler,) = health["scheduler"]
    assert scheduler["scheduler"] == "TokenWeightedScheduler" and scheduler["stats"]["admitted"] >= 3
    with urllib.request.urlopen(demo_server.base_url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "qwen_ext_sched_admitted_total" in metrics and "qwen_ext_sched_queue_wait_p99_seconds" in metrics
    assert "qwen_ext_sched_load_factor{" in metrics and "qwen_ext_sched_aging_half_life_tokens{" in metrics
    assert "qwen_ext_sched_admitted_weight_total{" in metrics
    assert "qwen_ext_sched_aging_half_life_seconds{" not in metrics  # aging runs on the work clock by default
    stats = scheduler["stats"]
    assert stats["load_factor"] >= 1.0 and stats["half_life_tokens"] >= 2500 and stats["admitted_weight"] > 0
    # auto: the gate is there, closed at this load (vLLM's own order), and on /metrics
    assert scheduler["mode"] == "auto" and scheduler["gate"]["overloaded"] is False
    assert scheduler["costs"]["ordering"] == "arrival: vLLM's own order (not overloaded)"
    assert "qwen_ext_sched_overloaded{" in metrics and "qwen_ext_sched_backlog_steps{" in metrics
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    resp = openai_client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "a number"}], max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text = resp.choices[0].message.content
    if resp.choices[0].finish_reason == "stop":  # a random-weight model may run out of tokens mid-object
        assert isinstance(json.loads(text)["n"], int)
    else:
        assert text and text.lstrip().startswith("{")


def test_connection_guard_serves_the_api_server(demo_server):
    """The runtime patch connection_guard wraps vLLM's uvicorn server in the API-server process (plugin path): the health
    route reports its limits, and a connection that has sent nothing yet waits under its header timer. The timer and
    the cap on real sockets: tests/integration/test_connection_guard.py (vLLM's NoSignalServer, no engine)."""
    import socket
    import time

    with socket.create_connection(("127.0.0.1", demo_server.port), timeout=10):
        time.sleep(0.3)
        with urllib.request.urlopen(demo_server.base_url + "/qwen_ext/health", timeout=10) as r:
            health = json.load(r)
    guard = health["connections"]
    assert guard["header_timeout_s"] == 60.0 and guard["waiting_for_headers"] >= 1 and guard["open"] >= 2
    assert 0 < guard["cap"] <= guard["fd_limit"] - min(1024, guard["fd_limit"] // 2)
    api = [p for p in health["processes"] if p["role"] == "api_server"]
    assert api and all("connection_guard" in p["patches"] for p in api)


def test_a_seeded_prompt_prefilled_in_chunks_keeps_the_engine_alive_and_its_stream(demo_server):
    """Issue 46: vLLM 0.32 rewinds a discarded row's generator with an offset a CPU generator does not have, so a
    seeded prompt prefilled in chunks next to decoding requests killed the engine (EngineDeadError,
    benchmarks/investigations/seed_chunked_prefill.py). With the cpu_seeded_sampling patch it is answered, the engine
    stays up, and it samples what it samples unchunked (the discarded draws leave its stream where it was)."""
    import concurrent.futures

    import httpx

    from qwen_vllm_ext.demo import SERVED_NAME

    client = httpx.Client(base_url=demo_server.base_url, timeout=300)
    prompt = "7 " + "hello " * 4088  # ~4,090 tokens: with 14 requests decoding it cannot fit in one 4,096-token step

    def seeded(salt):
        return client.post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 3, "seed": 7,
                                                    "temperature": 1.0, "cache_salt": salt, "ignore_eos": True})

    def decoding(_):
        return client.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 600,
                                                    "ignore_eos": True}).status_code

    with concurrent.futures.ThreadPoolExecutor(15) as pool:
        busy = [pool.submit(decoding, i) for i in range(14)]
        time.sleep(2.0)  # they are decoding
        chunked = pool.submit(seeded, "chunked").result()
        assert [f.result() for f in busy] == [200] * 14
    assert chunked.status_code == 200, chunked.text
    assert client.get("/health").status_code == 200
    alone = seeded("alone")  # another cache salt: prefilled in one step, no request beside it
    assert alone.status_code == 200
    assert chunked.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
