"""E2E: vLLM's own one-host scale-out with the extension -- ``--data-parallel-size 2`` on the CPU build.

Two engine cores behind vLLM's DP coordinator (and, through vLLM's serve path, two API-server processes): the
token-weighted scheduler runs in each engine core, every streamed chunk carries usage, the one SQLite ledger holds
exactly one record per request, and the launcher gave each engine its own core (vLLM's auto binding would put both
on the same one).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
import uuid

import httpx
import pytest

from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

from .servers import Server, early_then_stopped

MODEL = "qwen3-demo"
EARLY_GB = 6.5  # two engine cores and two API-server processes


def start_early(tmp_path_factory) -> dict:
    data = tmp_path_factory.mktemp("dp")
    return {"dp": Server(["--data-parallel-size", "2", "--qwen-token-weighted-scheduler", "true"],
                         data / "server.log", data_dir=data, shipped_layout=True)}


@pytest.fixture(scope="module")
def dp_started(request):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs 2 cores (one per data-parallel engine)")
    yield from early_then_stopped(request, start_early)


@pytest.fixture(scope="module")
def dp_server(dp_started):
    server = dp_started["dp"]
    server.wait_healthy()
    return server


def test_data_parallel_engines_each_run_the_extension(dp_server):
    client = httpx.Client(base_url=dp_server.base_url, timeout=120)
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(c.get("usage") for c in chunks), "a streamed chunk without usage"
    rids = [f"dp-{uuid.uuid4().hex}" for _ in range(16)]

    def one(rid):
        return httpx.post(dp_server.base_url + "/v1/chat/completions", timeout=120, headers={"x-request-id": rid},
                          json={"model": MODEL, "messages": [{"role": "user", "content": rid}], "max_tokens": 4})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert [r.status_code for r in pool.map(one, rids)] == [200] * 16
    health = client.get("/qwen_ext/health").json()
    engines = [p for p in health["processes"] if p["role"] == "engine_core"]
    assert sorted(p["process"] for p in engines) == ["EngineCore_DP0", "EngineCore_DP1"]
    assert all("token_weighted_scheduler" in p["patches"] for p in engines)
    schedulers = {s["pid"]: s for s in health["scheduler"]}
    assert {p["pid"] for p in engines} <= set(schedulers), "an engine core without the token-weighted scheduler"
    assert all(s["scheduler"] == "TokenWeightedScheduler" and s["stats"]["admitted"] > 0 for s in schedulers.values())
    store = SqliteLedgerStore(str(dp_server.data_dir / "ledger.sqlite3"))
    deadline = time.monotonic() + 30
    while len([r for r in store.records() if r.request_id in rids]) < 16:
        assert time.monotonic() < deadline, "ledger records missing"
        time.sleep(0.2)
    records = [r for r in store.records() if r.request_id in rids]
    assert sorted(r.request_id for r in records) == sorted(rids)  # exactly one each
    store.close()
    log = open(dp_server.log_path, errors="replace").read()
    bindings = set(re.findall(r"local_rank=0, core ids=(\[[^\]]*\])", log))
    assert len(bindings) == 2, f"the data-parallel engines are not bound to different cores: {bindings}"
