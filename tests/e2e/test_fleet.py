"""E2E: the fleet -- ``python -m qwen_vllm_ext.fleet`` with 2 demo replicas, vllm-router and one real Redis, on
loopback (real processes throughout: vLLM, vllm-router 0.1.17, redis-server).

One fleet serves the module (gateway on, Redis run by the test so that it can be stopped and started). The tests,
in file order: conversation affinity keeps KV reuse (and a round_robin router over the same replicas shows what
breaks); limits hold across replicas (200 simultaneous requests on one key, 0 overshoot, every 429 once with its
headers, one ledger record per client request); a revoked key is refused by every replica within 1 s; TokenStorm
through the router checks accounting against the Redis ledger, ``usage report --by instance`` covers both
replicas and ``usage reconcile`` passes per replica; a Redis outage is fail-closed and heals by itself with the
in-flight record replayed from the spill file; kill -9 of a replica under load fails only what was on it, the
fleet restarts it and it serves again; SIGTERM stops every process. Separately: SIGKILL of the fleet command
leaves nothing running, and bad configurations fail with one clear line and nothing left behind.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import httpx
import psutil
import pytest

from benchmarks.bench_kv_reuse import run_conversation, word_token_ids
from qwen_vllm_ext.bench.server import FleetProcess, ServerStartError, alive, free_port_block
from qwen_vllm_ext.client import Client, RetryPolicy
from qwen_vllm_ext.client.errors import APIConnectionError, APIError
from qwen_vllm_ext.usage.ledger import open_store
from tests.redis_server import RedisServer

from .servers import STARTUP_TIMEOUT_S, early_then_stopped, round_robin_router

ADMIN = "fleet-admin-secret"
MODEL = "qwen3-demo"
TURNS = 10
SERVE_ARGS = ["--qwen-gateway", "true", "--qwen-admin-key", ADMIN, "--qwen-spike-factor", "0",
              "--qwen-limiter-failure", "closed"]


EARLY_GB = 11  # three replicas, two routers, two Redis


def start_early(tmp_path_factory) -> dict:
    """The module's fleet (two replicas, on a Redis the tests stop and start) and the one-replica fleet that the
    SIGKILL test kills, started together (their start-ups overlap)."""
    redis = RedisServer().start()
    data = tmp_path_factory.mktemp("fleet")
    fleet = FleetProcess(2, data / "fleet.log", data / "data", fleet_args=["--redis-url", redis.url],
                         serve_args=SERVE_ARGS)
    fleet.data = data
    single = tmp_path_factory.mktemp("single")
    return {"redis": redis, "fleet": fleet,
            "single": FleetProcess(1, single / "fleet.log", single / "data", serve_args=SERVE_ARGS)}


@pytest.fixture(scope="module")
def started(request):
    yield from early_then_stopped(request, start_early)


@pytest.fixture(scope="module")
def redis_srv(started):
    return started["redis"]


@pytest.fixture(scope="module")
def fleet(started):
    proc = started["fleet"]
    try:
        proc.wait_ready(STARTUP_TIMEOUT_S)
    except ServerStartError as exc:
        pytest.fail(str(exc))
    return proc


def admin(url: str):
    return httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})


def new_key(fleet, **limits) -> dict:
    r = admin(fleet.replica_urls[0]).post("/qwen_ext/admin/keys", json={"name": f"t-{uuid.uuid4().hex[:6]}", **limits})
    assert r.status_code == 200, r.text
    return r.json()


def ledger(redis_srv):
    return open_store("redis", redis_srv.url)


def _replica_pid(fleet, index: int) -> int:
    port = str(fleet.port + 1 + index)
    for pid in fleet.pids():
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        if "qwen_vllm_ext.serve" in cmd and cmd[cmd.index("--port") + 1] == port:
            return pid
    raise AssertionError(f"no replica process on port {port}")


# ------------------------------------------------------------------------------------------------ affinity
def _reuse_turns(base_url: str, key: str, conv: str, words) -> list[dict]:
    return run_conversation(base_url, conv, thinking=False, feedback="canonical", turns=TURNS, word_ids=words,
                            headers={"Authorization": f"Bearer {key}"})


def _block_size(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        line = re.search(r"^vllm:cache_config_info\{.*$", r.read().decode(), re.M).group(0)
    return int(re.search(r'[{,]block_size="(\d+)"', line).group(1))


def _served_from_cache(turns: list[dict], block: int) -> list[bool]:
    """Per turn >= 3: cached tokens >= 90% of the previous turn's prompt + completion, block-rounded."""
    return [t["cached_tokens"] >= 0.9 * (((t["prev_tokens"] - 1) // block) * block) for t in turns[2:]]


def test_affinity_keeps_kv_reuse_and_round_robin_breaks_it(fleet, tmp_path):
    key = new_key(fleet)["key"]
    words, block = word_token_ids(), _block_size(fleet.replica_urls[0])
    affinity = [_reuse_turns(fleet.base_url, key, f"aff-{i}-{uuid.uuid4().hex[:6]}", words) for i in range(2)]
    for turns in affinity:
        assert all(_served_from_cache(turns, block)), [(t["prev_tokens"], t["cached_tokens"]) for t in turns]
    # the same conversations through a round_robin router over the same two replicas
    with round_robin_router(fleet.replica_urls, tmp_path / "rr-router.log") as rr_url:
        rr_turns = [_reuse_turns(rr_url, key, f"rr-{i}-{uuid.uuid4().hex[:6]}", words) for i in range(2)]
    served = [ok for turns in rr_turns for ok in _served_from_cache(turns, block)]
    cached = lambda runs: sum(t["cached_tokens"] for r in runs for t in r)  # noqa: E731
    prompt = lambda runs: sum(t["prompt_tokens"] for r in runs for t in r)  # noqa: E731
    print(f"\naffinity: cached share {cached(affinity) / prompt(affinity):.3f}; round_robin: "
          f"{cached(rr_turns) / prompt(rr_turns):.3f}, turns >= 3 served from cache {sum(served)}/{len(served)}")
    assert sum(served) < len(served), "round_robin kept every turn on a warm replica: the comparison shows nothing"
    assert cached(rr_turns) < cached(affinity)


# ------------------------------------------------------------------------------------------------ limits
def test_limits_are_global_across_replicas(fleet, redis_srv):
    tpm = 2000
    created = new_key(fleet, tpm=tpm)
    key, key_id = created["key"], created["key_id"]
    rids = [f"fleet-tpm-{uuid.uuid4().hex}" for _ in range(200)]

    async def one(client, i):
        # different sessions: the router spreads them over both replicas
        return await client.post("/v1/chat/completions", headers={
            "Authorization": f"Bearer {key}", "x-request-id": rids[i], "x-session-id": f"tpm-{i}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 16})

    async def burst():
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=None)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    started = time.time()
    responses = asyncio.run(burst())
    assert time.time() - started < 60, "the burst took more than the TPM window: the bound below would not hold"
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    ok = [r for r in responses if r.status_code == 200]
    admitted = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert 0 < admitted <= tpm, f"{admitted} engine tokens admitted under a TPM limit of {tpm} (overshoot)"
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"]["type"] and int(r.headers["retry-after"]) >= 1
            assert {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"} <= set(r.headers)
    # one ledger record per client request (the router retried nothing), on both replicas
    deadline = time.monotonic() + 30
    while True:
        records = [r for r in ledger(redis_srv).records(since=started - 1) if r.api_key_id == key_id]
        if len(records) >= 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(r.request_id for r in records) == sorted(rids)
    assert len({r.instance_id for r in records}) == 2, "the router sent every request to one replica"
    assert sum(r.prompt_tokens + r.completion_tokens for r in records) == admitted
    print(f"\n200 requests: {len(ok)} admitted, {admitted} tokens of TPM {tpm}; {statuses.count(429)} x 429")


# ------------------------------------------------------------------------------------------------ keys
def test_revocation_on_one_replica_is_refused_by_every_replica_within_1s(fleet):
    created = new_key(fleet)
    auth = {"Authorization": f"Bearer {created['key']}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    clients = [httpx.Client(base_url=u, timeout=60) for u in fleet.replica_urls]
    assert [c.post("/v1/chat/completions", headers=auth, json=body).status_code for c in clients] == [200, 200]
    r = admin(fleet.replica_urls[1]).delete(f"/qwen_ext/admin/keys/{created['key_id']}")
    revoked = time.monotonic()
    assert r.status_code == 200
    # "within 1 s": no request sent 1 s or more after the revocation is admitted. A probe's send time is what
    # counts, not when its answer came back (an admitted probe runs the model on a loaded machine)
    pending = set(range(len(clients)))
    while pending:
        for i in sorted(pending):
            sent = time.monotonic() - revoked
            status = clients[i].post("/v1/chat/completions", headers=auth, json=body).status_code
            if status == 401:
                pending.discard(i)
            else:
                assert sent < 1.0, f"replica {i} admitted a revoked key {sent:.2f} s after the revocation ({status})"
    via_router = httpx.post(fleet.base_url + "/v1/chat/completions", headers=auth, json=body, timeout=60)
    assert via_router.status_code == 401 and via_router.json()["error"]["code"] == "invalid_api_key"


# ------------------------------------------------------------------------------------------------ accounting
def test_token_storm_through_the_router_reports_no_accounting_errors(fleet, redis_srv, tmp_path):
    tpm = 6000
    key = new_key(fleet, tpm=tpm)["key"]
    out = tmp_path / "storm"
    run = subprocess.run(
        [sys.executable, "-m", "qwen_vllm_ext.bench.token_storm", "--base-url", fleet.base_url, "--model", MODEL,
         "--api-key", key, "--turns", "3", "--rate", "2", "--num-requests", "36", "--input-len", "300",
         "--output-len", "16", "--template", "qwen3-reuse", "--ledger", redis_srv.url, "--output-dir", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rep = json.loads((out / "token_storm.json").read_text())
    assert rep["throughput"]["completed"] > 0 and set(rep["errors"]) <= {"429 rate_limit_exceeded"}, rep["errors"]
    assert rep["accounting"]["mismatches"] == [] and rep["accounting"]["ledger_checked"], rep["accounting"]
    hh = rep["header_honesty"]
    assert hh["violations"] == [] and hh["overshoot"]["limit_tokens"] == tpm, hh
    assert hh["overshoot"]["overshoot_tokens"] == 0, hh
    report = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "report", "--redis-url", redis_srv.url,
                             "--by", "instance", "--json"], capture_output=True, text=True, timeout=120)
    rows = json.loads(report.stdout)["rows"]
    assert len([r for r in rows if r["requests"] > 0]) == 2, rows
    for url in fleet.replica_urls:
        rec = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.usage", "reconcile", "--url", url,
                              "--redis-url", redis_srv.url, "--admin-key", ADMIN], capture_output=True, text=True,
                             timeout=120)
        assert rec.returncode == 0, rec.stdout + rec.stderr


# ------------------------------------------------------------------------------------------------ Redis outage
def test_redis_outage_is_fail_closed_heals_by_itself_and_loses_no_record(fleet, redis_srv):
    key = new_key(fleet)["key"]
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 12}
    client = httpx.Client(base_url=fleet.base_url, timeout=120)
    assert client.post("/v1/chat/completions", headers=auth, json=body).status_code == 200
    # a long stream in flight while Redis goes down: its ledger record must be spilled and replayed
    rid = f"fleet-outage-{uuid.uuid4().hex}"
    done = {}

    def stream():
        with httpx.stream("POST", fleet.base_url + "/v1/chat/completions", timeout=300,
                          headers={**auth, "x-request-id": rid, "x-session-id": "outage"},
                          json={**body, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            done["status"] = r.status_code
            done["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    redis_srv.stop(kill=True)
    try:
        outage = [client.post("/v1/chat/completions", headers=auth, json=body) for _ in range(6)]
        assert [r.status_code for r in outage] == [503] * 6, [(r.status_code, r.text[:200]) for r in outage]
        assert all(r.json()["error"]["message"] for r in outage)
        t.join(300)
        assert done.get("status") == 200 and done["lines"][-1] == "data: [DONE]"
    finally:
        redis_srv.start()
    healed_at = time.monotonic()
    while client.post("/v1/chat/completions", headers=auth, json=body).status_code != 200:
        assert time.monotonic() - healed_at < 30, "service did not resume within 30 s of Redis coming back"
        time.sleep(0.5)
    deadline = time.monotonic() + 60
    while not [r for r in ledger(redis_srv).records() if r.request_id == rid]:
        assert time.monotonic() < deadline, "the record of the request in flight during the outage was lost"
        time.sleep(1.0)


# ------------------------------------------------------------------------------------------------ failover
def test_kill_9_of_a_replica_fails_only_its_requests_and_it_rejoins(fleet, redis_srv):
    key = new_key(fleet)["key"]
    sdk = Client(fleet.base_url, key, retry=RetryPolicy(max_retries=0), timeout=120)
    results, stop = [], threading.Event()

    def load(worker: int):
        n = 0
        while not stop.is_set():
            n += 1
            started = time.monotonic()
            try:
                r = sdk.chat([{"role": "user", "content": f"worker {worker} request {n}"}], model=MODEL,
                             max_tokens=8, session_id=f"fail-{worker}-{n % 5}")
                results.append((started, "ok", r.request_id))
            except (APIError, APIConnectionError) as exc:  # the SDK reports it: nothing unreadable escapes
                results.append((started, type(exc).__name__, str(exc)[:200]))
                time.sleep(0.1)  # as a client would (a failure is answered at once)

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    time.sleep(3)
    victim = _replica_pid(fleet, 1)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(8)
    stop.set()
    for w in workers:
        w.join(120)
    failed = [r for r in results if r[1] != "ok"]
    late = [r for r in failed if r[0] > killed + 3.0]  # the router's health check drops it in ~2 s
    assert not late, f"requests sent > 3 s after the kill failed: {late[:5]}"
    assert [r for r in results if r[1] == "ok" and r[0] > killed + 3.0], "nothing was served after the kill"
    ok_ids = {r[2] for r in results if r[1] == "ok"}
    deadline = time.monotonic() + 30
    while ok_ids - {r.request_id for r in ledger(redis_srv).records()}:
        assert time.monotonic() < deadline, "an acknowledged request has no ledger record"
        time.sleep(0.5)
    print(f"\nfailover: {len(results)} requests, {len(failed)} failed (all within 3 s of the kill)")
    # the fleet restarts the replica; the router puts it back in rotation
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            if _replica_pid(fleet, 1) != victim and httpx.get(fleet.replica_urls[1] + "/health").status_code == 200:
                break
        except (AssertionError, httpx.HTTPError):
            pass
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(1)
    before = len([r for r in ledger(redis_srv).records() if r.instance_id == _instance(fleet.replica_urls[1])])
    for n in range(40):
        sdk.chat([{"role": "user", "content": "back?"}], model=MODEL, max_tokens=1, session_id=f"rejoin-{n}")
    after = len([r for r in ledger(redis_srv).records() if r.instance_id == _instance(fleet.replica_urls[1])])
    assert after > before, "the restarted replica got no traffic from the router"


def _instance(url: str) -> str:
    return httpx.get(url + "/qwen_ext/health", timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}).json()[
        "instance_id"]


# ------------------------------------------------------------------------------------------------ stopping
def test_sigterm_stops_every_process_of_the_fleet(fleet):
    pids = fleet.pids()
    assert len(pids) >= 6  # fleet, 2 replicas (+ engine cores), router
    assert fleet.stop() == 0
    deadline = time.monotonic() + 30
    while alive(pids):
        assert time.monotonic() < deadline, f"left running after SIGTERM: {alive(pids)}"
        time.sleep(0.5)


def test_sigkill_of_the_fleet_command_leaves_nothing_running(started):
    """One replica and the fleet's own Redis (persistent, in the data dir): kill -9 the fleet command."""
    proc = started["single"]
    try:
        proc.wait_ready(STARTUP_TIMEOUT_S)
        assert (proc.data_dir / "redis" / "appendonlydir").is_dir()
        pids = proc.pids()
        names = {psutil.Process(p).name() for p in pids}
        assert "redis-server" in names and "vllm::router" in names, names
        os.kill(proc.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while alive(pids - {proc.proc.pid}):
            assert time.monotonic() < deadline, f"orphans after SIGKILL of the fleet command: {alive(pids)}"
            time.sleep(0.5)
    finally:
        for pid in alive(proc.pids()):
            os.kill(pid, signal.SIGKILL)
        proc.stop()


# ------------------------------------------------------------------------------------------------ bad input
def _fleet_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "qwen_vllm_ext.fleet", *args], capture_output=True, text=True,
                          timeout=timeout)


def _leftovers(data_dir) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if str(data_dir) in " ".join(p.info["cmdline"] or [])]


def test_unreachable_redis_and_port_in_use_fail_at_once(tmp_path):
    run = _fleet_cli("--replicas", "1", "--port", str(free_port_block(4)), "--redis-url", "redis://127.0.0.1:1/0",
                     "--data-dir", str(tmp_path))
    assert run.returncode == 1 and "error: cannot reach the Redis server (--redis-url) at redis://127.0.0.1:1/0" \
        in run.stderr, run.stderr
    base = free_port_block(4)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))
        s.listen()
        run = _fleet_cli("--replicas", "1", "--port", str(base), "--data-dir", str(tmp_path))
    assert run.returncode == 1 and f"error: port {base + 1} (replica-0) is in use" in run.stderr, run.stderr
    assert not _leftovers(tmp_path)


def test_a_replica_that_never_becomes_healthy_fails_the_start_with_its_log_and_stops_the_rest(tmp_path):
    run = _fleet_cli("--replicas", "1", "--port", str(free_port_block(4)), "--data-dir", str(tmp_path),
                     "--", "--max-model-len", "not-a-number")
    assert run.returncode == 1, run.stderr
    assert "error: replica-0 exited with status" in run.stderr and "before becoming healthy" in run.stderr
    assert "max-model-len" in run.stderr  # the replica's log tail says why
    assert not _leftovers(tmp_path), "processes left running after a failed start"
