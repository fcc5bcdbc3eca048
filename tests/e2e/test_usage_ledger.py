"""E2E: usage on every streamed chunk and a ledger that agrees with vLLM's own counters (real SQLite, real Redis).

Requests mix streamed runs finished by a stop string or by max_tokens, clients that disconnect after k
chunks, and non-streamed requests, concurrently. Checks: every chunk has cumulative usage (monotonic, with
cached tokens and billing), the last chunk equals the ledger record, the ledger sums equal the delta of
``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` exactly, and ``reconcile`` reports no drift.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from qwen_vllm_ext.bench.token_storm import KEEPALIVE_EXPIRY_S
from qwen_vllm_ext.demo import SERVED_NAME
from qwen_vllm_ext.usage.ledger import SqliteLedgerStore, open_store
from qwen_vllm_ext.usage.reconcile import COUNTERS, fetch, parse_counters

from ..redis_server import free_port
from . import disconnects
from .servers import Server, early_then_stopped

LONG_PROMPT = " ".join(f"Paragraph {i}: the ledger must never lose or double-count a single token." for i in range(30))


def counters(server) -> dict:
    return parse_counters(fetch(server.base_url, "/metrics"), COUNTERS.values())


def sse_events(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def check_chunk_usage(chunks: list[dict]) -> dict:
    """Every chunk has cumulative usage, monotonic, with cached tokens and billing; returns the last usage."""
    assert chunks, "no chunks"
    previous = -1
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= previous
        previous = usage["completion_tokens"]
        assert "cached_tokens" in usage["prompt_tokens_details"]
        assert usage["billing"]["policy"] == "default" and usage["billing"]["total_units"]
    return chunks[-1]["usage"]


def stream(client: httpx.Client, body: dict, request_id: str, stop_after: int | None = None) -> list[dict]:
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                       headers={"X-Request-ID": request_id}) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"] == request_id
        for event in sse_events(response):
            chunks.append(event)
            if stop_after is not None and len(chunks) >= stop_after:
                break  # leaving the block closes the connection mid-stream
    return chunks


def check_disconnect(record, chunks: list[dict], closed_at: float) -> bool:
    """A client that read ``chunks`` and left at ``closed_at``: the usage it saw, and ``disconnects.recorded``."""
    check_chunk_usage(chunks)
    assert record.completion_tokens >= chunks[-1]["usage"]["completion_tokens"]
    return disconnects.recorded(record, closed_at)


def test_check_disconnect_tells_a_lost_disconnect_from_a_late_client():
    from types import SimpleNamespace

    chunks = [{"usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n,
                         "prompt_tokens_details": {"cached_tokens": 0},
                         "billing": {"policy": "default", "total_units": "1"}}} for n in (1, 2, 3)]

    def record(status, tokens, latency):
        return SimpleNamespace(status=status, completion_tokens=tokens, received_at=1000.0, latency_s=latency)

    assert check_disconnect(record("client_disconnected", 5, 0.2), chunks, 1000.1) is True
    # the client read its chunks only after the engine had finished: "length" is right, the sample proves nothing
    assert check_disconnect(record("length", disconnects.MAX_TOKENS, 17.0), chunks, 1017.5) is False
    with pytest.raises(AssertionError, match="disconnect lost"):  # left at once, the request ran to the end
        check_disconnect(record("length", disconnects.MAX_TOKENS, 17.0), chunks, 1000.1)
    with pytest.raises(AssertionError):  # a record that stopped short without saying why
        check_disconnect(record("length", 40, 17.0), chunks, 1017.5)
    with pytest.raises(AssertionError):  # fewer tokens recorded than the client was shown
        check_disconnect(record("client_disconnected", 2, 0.2), chunks, 1000.1)


def wait_for_records(store, ids, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = {i: store.get(i) for i in ids}
        if all(found.values()) or time.monotonic() > deadline:
            missing = [i for i, r in found.items() if r is None]
            assert not missing, f"ledger records missing: {missing}"
            return found
        time.sleep(0.2)


def run_mix(server, store) -> None:
    base = {"model": SERVED_NAME, "temperature": 0}
    # idle connections expire before the server closes them, as TokenStorm's do (vLLM's keep-alive, 5 s, is httpx's
    # default expiry too: a thread the busy host started late sent its request on a connection the server was closing)
    limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
    client = httpx.Client(base_url=server.base_url, timeout=120, limits=limits)
    sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                        http_client=httpx.Client(timeout=120, limits=limits))
    tag = uuid.uuid4().hex[:8]
    before = counters(server)

    def by_length(i):
        rid = f"len-{tag}-{i}"
        body = {**base, "messages": [{"role": "user", "content": f"Tell story {i}"}], "max_tokens": 12,
                "ignore_eos": True}
        return rid, "length", stream(client, body, rid)

    def by_stop(i):
        rid = f"stop-{tag}-{i}"
        # the demo model's greedy answer to "hi" is "buffer forestry...": the stop string " " ends it early
        body = {**base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stop": [" "]}
        return rid, "stop", stream(client, body, rid)

    def disconnect(i):
        rid = f"disc-{tag}-{i}"
        body = {**base, "messages": [{"role": "user", "content": f"Go on forever {i}"}],
                "max_tokens": disconnects.MAX_TOKENS, "ignore_eos": True}
        chunks = stream(client, body, rid, stop_after=3 + i)
        return rid, "client_disconnected", (chunks, time.time())

    def non_streamed(i):
        rid = f"full-{tag}-{i}"
        resp = client.post("/v1/chat/completions", headers={"X-Request-ID": rid},
                           json={**base, "messages": [{"role": "user", "content": f"Q{i}"}], "max_tokens": 5,
                                 "ignore_eos": True})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == rid
        return rid, "length", resp.json()["usage"]

    def sdk_stream(i):
        rid = f"sdk-{tag}-{i}"
        chunks = list(sdk.chat.completions.create(
            **base, messages=[{"role": "user", "content": f"SDK {i}"}], max_tokens=7, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Request-ID": rid}))
        assert all(c.usage is not None for c in chunks)  # the SDK sees usage on every chunk, unasked
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
        return rid, "length", [c.model_dump() for c in chunks]

    jobs = [(f, i) for i in range(2) for f in (by_length, by_stop, disconnect, non_streamed, sdk_stream)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: job[0](job[1]), jobs))

    records = wait_for_records(store, [rid for rid, _, _ in results])
    recorded = []  # one verdict per disconnect: the disconnect was recorded, or the client got to leave too late
    for rid, expected_status, observed in results:
        record = records[rid]
        if expected_status == "client_disconnected":
            recorded.append(check_disconnect(record, *observed))
            continue
        assert record.status == expected_status, (rid, record)
        usage = observed if isinstance(observed, dict) else check_chunk_usage(observed)
        if not isinstance(observed, dict):
            assert observed[-1]["choices"] == []  # the final usage chunk is always sent
        assert (record.prompt_tokens, record.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        # streamed or not: cached tokens and billing on the response, equal to the record (issue 46)
        assert record.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]
        billing = usage["billing"]
        assert record.billed_total_micro == round(float(billing["total_units"]) * 1_000_000)
    # Each run shows a recorded disconnect: when CPU starvation made both clients of the mix late, a lone one again.
    for attempt in range(disconnects.ATTEMPTS):
        if any(recorded):
            break
        results.append(disconnect(10 + attempt))
        rid, _, observed = results[-1]
        records.update(wait_for_records(store, [rid]))
        recorded.append(check_disconnect(records[rid], *observed))
    assert any(recorded), "no disconnect recorded: every client was too late (the machine starved the test client)"

    after = counters(server)
    ours = [records[rid] for rid, _, _ in results]
    assert sum(r.engine_prompt_tokens for r in ours) == after[COUNTERS["prompt_tokens"]] - before[COUNTERS["prompt_tokens"]]
    assert sum(r.completion_tokens for r in ours) == \
        after[COUNTERS["completion_tokens"]] - before[COUNTERS["completion_tokens"]]

    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "reconcile", "--url", server.base_url],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no drift" in proc.stderr


def sqlite_store(server):
    return SqliteLedgerStore(str(Path(server.data_dir) / "ledger.sqlite3"))


def test_mixed_load_sqlite(demo_server):
    run_mix(demo_server, sqlite_store(demo_server))


def test_metrics_and_access_log(demo_server):
    client = httpx.Client(base_url=demo_server.base_url, timeout=60)
    bad = client.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": "not a list"},
                      headers={"X-Request-ID": "bad-body-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-body-1"
    record = wait_for_records(sqlite_store(demo_server), ["bad-body-1"])["bad-body-1"]
    assert (record.status, record.http_status, record.prompt_tokens) == ("error", 400, 0)
    metrics = fetch(demo_server.base_url, "/metrics")
    assert 'qwen_ext_ledger_records_total{status="error"}' in metrics
    assert "qwen_ext_billed_units_total" in metrics and "qwen_ext_ledger_commit_wait_seconds_count" in metrics
    assert "qwen_ext_ledger_writer_up 1.0" in metrics and "qwen_ext_ledger_dead_lettered_records_total" in metrics
    # the writer runs: vLLM's /health passes, and /qwen_ext/health reports the ledger (no spill: ready)
    assert client.get("/health").status_code == 200
    ledger = client.get("/qwen_ext/health").json()["ledger"]
    assert ledger["writer_alive"] and ledger["ready"] and ledger["stopped_reason"] is None, ledger
    assert ledger["spill_pending_records"] == 0 and os.path.samefile(ledger["spill_dir"], demo_server.data_dir), ledger
    log = Path(demo_server.data_dir) / "access.jsonl"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "bad-body-1" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    line = next(x for x in lines if x["request_id"] == "bad-body-1")  # status >= 400: always logged
    assert line["stratum"] == "error" and line["sample_weight"] == 1.0 and line["http_status"] == 400
    assert all(x["stratum"] in ("error", "slow", "normal") for x in lines)
    assert "not a list" not in log.read_text()  # no request text in the log


EARLY_GB = 10.5  # three servers, one with two API-server processes (the later ones replace them)


def start_early(tmp_path_factory) -> dict:
    """Three servers started together (their start-ups overlap): two API-server processes sharing the SQLite
    ledger, one with per_chunk_usage=false, and the one the kill -9 test kills."""
    logs = tmp_path_factory.mktemp("logs")
    return {"multi": Server(["--api-server-count", "2"], logs / "multi.log", data_dir=tmp_path_factory.mktemp("multi")),
            "stock": Server(["--qwen-per-chunk-usage", "false"], logs / "stock.log",
                            data_dir=tmp_path_factory.mktemp("stock")),
            "killed": Server([], logs / "kill.log", data_dir=tmp_path_factory.mktemp("killed"))}


@pytest.fixture(scope="module")
def ledger_servers(request):
    yield from early_then_stopped(request, start_early)


def test_several_api_server_processes_share_the_sqlite_ledger(ledger_servers):
    server = ledger_servers["multi"]
    server.wait_healthy()
    run_mix(server, sqlite_store(server))
    server.stop()  # done with it: the memory goes back before the next servers start


def test_repeated_prompt_shows_cached_tokens_on_every_chunk(demo_server):
    client = httpx.Client(base_url=demo_server.base_url, timeout=120)
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 6,
            "ignore_eos": True}
    stream(client, body, f"warm-{uuid.uuid4().hex[:8]}")
    rid = f"cached-{uuid.uuid4().hex[:8]}"
    chunks = stream(client, body, rid)
    usage = check_chunk_usage(chunks)
    assert all(c["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for c in chunks)
    assert usage["prompt_tokens"] > 256
    record = wait_for_records(sqlite_store(demo_server), [rid])[rid]
    assert record.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_non_streamed_responses_carry_the_ledgers_usage(demo_server):
    """Issue 46: a non-streamed chat or completion response carries cached tokens (no client flag, no opt-in) and
    billing, each equal to the ledger's record."""
    client = httpx.Client(base_url=demo_server.base_url, timeout=120)
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": LONG_PROMPT + " (non-streamed)"}],
            "max_tokens": 6, "ignore_eos": True}
    completion = {"model": SERVED_NAME, "prompt": LONG_PROMPT + " (completion)", "max_tokens": 4, "ignore_eos": True}
    seen = {}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        for turn in ("warm", "cached"):  # the second request finds the first one's prompt in the prefix cache
            rid = f"full-{turn}-{uuid.uuid4().hex[:8]}"
            resp = client.post(path, json=body, headers={"X-Request-ID": rid})
            assert resp.status_code == 200, resp.text
            seen[rid] = (path, resp.json()["usage"])
    records = wait_for_records(sqlite_store(demo_server), list(seen))
    for rid, (path, usage) in seen.items():
        record = records[rid]
        assert (record.prompt_tokens, record.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert record.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"], (rid, usage)
        if rid.startswith("full-cached"):
            assert record.cached_tokens > 0, (rid, usage)
        assert record.billed_total_micro == round(float(usage["billing"]["total_units"]) * 1_000_000)
        assert "cost" not in usage  # no prices on the demo server
        # reasoning tokens where a reasoning parser is on (the Qwen3 demo has none; the hybrid demo's are checked in
        # test_hybrid_demo.py and test_openrouter_provider.py), else none reported and none recorded
        details = usage.get("completion_tokens_details")
        assert (details or {}).get("reasoning_tokens", 0) == record.reasoning_tokens, (rid, usage)


def test_stock_behaviour_setting(ledger_servers):
    """per_chunk_usage=false restores vLLM's behaviour: no usage unless the client asks for it."""
    server = ledger_servers["stock"]
    server.wait_healthy()
    client = httpx.Client(base_url=server.base_url, timeout=120)
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    chunks = stream(client, body, "stock-1")
    assert chunks and all("usage" not in c or c["usage"] is None for c in chunks)
    record = wait_for_records(sqlite_store(server), ["stock-1"])["stock-1"]
    assert record.completion_tokens == 3  # the ledger still records
    server.stop()


def test_kill_9_loses_no_completed_request_and_restart_keeps_the_ledger(ledger_servers, tmp_path_factory):
    server = ledger_servers["killed"]
    data_dir = server.data_dir
    server.wait_healthy()
    completed: list[str] = []
    stop = threading.Event()

    def load(worker: int):
        client = httpx.Client(base_url=server.base_url, timeout=30)
        n = 0
        while not stop.is_set():
            rid = f"k{worker}-{n}"
            n += 1
            body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": rid}], "max_tokens": 8,
                    "ignore_eos": True}
            try:
                if worker % 2:
                    stream(client, body, rid)
                else:
                    r = client.post("/v1/chat/completions", json=body, headers={"X-Request-ID": rid})
                    r.raise_for_status()
            except (httpx.HTTPError, AssertionError):
                return  # the server is gone
            completed.append(rid)  # the whole response arrived

    threads = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(completed) < 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGKILL)  # API server, engine core and workers, mid-load
    server.proc.wait()
    stop.set()
    for t in threads:
        t.join(60)
    assert len(completed) >= 24
    store = SqliteLedgerStore(str(data_dir / "ledger.sqlite3"))
    missing = [rid for rid in completed if store.get(rid) is None]
    assert not missing, f"{len(missing)} completed requests have no ledger record: {missing[:5]}"
    kept = len(store.records())

    restarted = Server([], tmp_path_factory.mktemp("logs") / "restart.log", data_dir=data_dir)
    try:
        restarted.wait_healthy()
        store = SqliteLedgerStore(str(data_dir / "ledger.sqlite3"))
        assert all(store.get(rid) is not None for rid in completed)
        client = httpx.Client(base_url=restarted.base_url, timeout=60)
        stream(client, {"model": SERVED_NAME, "messages": [{"role": "user", "content": "after"}], "max_tokens": 2},
               "after-restart")
        wait_for_records(store, ["after-restart"])
        assert len(store.records()) >= kept + 1
    finally:
        restarted.stop()


@pytest.fixture(scope="module")
def unreachable_redis_server(tmp_path_factory):
    """A server pointed at a Redis nobody listens on: started with the Redis-ledger server, so that its start-up,
    which ends in the refusal, overlaps that one's."""
    server = Server(["--qwen-ledger-backend", "redis", "--qwen-ledger-redis-url", f"redis://127.0.0.1:{free_port()}/0"],
                    tmp_path_factory.mktemp("logs") / "noredis.log", data_dir=tmp_path_factory.mktemp("noredis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_ledger_server(redis_server, tmp_path_factory, unreachable_redis_server):
    server = Server(["--qwen-ledger-backend", "redis", "--qwen-ledger-redis-url", redis_server.url],
                    tmp_path_factory.mktemp("logs") / "redis.log", data_dir=tmp_path_factory.mktemp("redisdata"))
    server.wait_healthy()
    yield server
    server.stop()


def test_mixed_load_redis(redis_ledger_server, redis_server):
    run_mix(redis_ledger_server, open_store("redis", redis_server.url))


def test_unreachable_redis_refuses_to_start(unreachable_redis_server):
    server = unreachable_redis_server
    assert server.proc.wait(timeout=300) == 2
    log = server.log_tail(400)
    assert "setting 'ledger_redis_url': cannot reach the Redis ledger at redis://127.0.0.1" in log
    assert "Initializing a V1 LLM engine" not in log  # refused by the launcher, before the engine loaded anything


def test_anthropic_messages_stream_usage_events_carry_cached_tokens(demo_server):
    """/v1/messages is served through the patched chat stream: its usage events carry the cache hits."""
    client = httpx.Client(base_url=demo_server.base_url, timeout=120)
    body = {"model": SERVED_NAME, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": LONG_PROMPT + " (anthropic)"}]}
    for attempt in range(2):  # the second request hits the prefix cache of the first
        usages = []
        rid = f"anthropic-{uuid.uuid4().hex[:8]}"
        with client.stream("POST", "/v1/messages", json=body, headers={"X-Request-ID": rid}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    usage = event.get("usage") or (event.get("message") or {}).get("usage")
                    if usage:
                        usages.append(usage)
    assert len(usages) >= 2  # message_start and message_delta
    assert usages[-1]["output_tokens"] == 4 and usages[-1].get("cache_read_input_tokens", 0) > 0
    record = wait_for_records(sqlite_store(demo_server), [rid])[rid]
    assert record.endpoint == "/v1/messages" and record.completion_tokens == 4 and record.cached_tokens > 0
