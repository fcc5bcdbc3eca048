"""E2E: turn checkpoints hold across a fleet of hybrid replicas -- ``python -m qwen_vllm_ext.fleet --model
qwen36-demo`` with 2 replicas behind vllm-router (``consistent_hash`` on ``x-session-id``) and one real Redis. Every
turn of a conversation reaches the replica that kept its previous turn's state, so every turn is cached to the
prefix it shares with the previous request; a round_robin router over the same replicas shows what affinity buys."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from benchmarks.bench_kv_reuse import hybrid_conversation, run_hybrid_conversations
from qwen_vllm_ext.bench.server import FleetProcess, ServerStartError, free_port_block
from qwen_vllm_ext.demo import HYBRID_SERVED_NAME
from qwen_vllm_ext.fleet.plan import ROUTER_FLAGS
from tests.redis_server import RedisServer

from .test_fleet import STARTUP_TIMEOUT_S, _ready

TURNS = 5


@pytest.fixture(scope="module")
def hybrid_fleet(tmp_path_factory):
    data = tmp_path_factory.mktemp("hybrid-fleet")
    redis = RedisServer().start()
    proc = FleetProcess(2, data / "fleet.log", data / "data", fleet_args=["--redis-url", redis.url,
                                                                          "--model", HYBRID_SERVED_NAME])
    try:
        proc.wait_ready(STARTUP_TIMEOUT_S)
    except ServerStartError as exc:
        redis.cleanup()
        pytest.fail(str(exc))
    yield proc
    proc.stop()
    redis.cleanup()


def _below_bound(runs) -> list[tuple[int, int]]:
    """(cached, bound) of every turn after the first that got less than its shared prefix floored to the unit."""
    return [(t["cached_tokens"], t["bound"]) for run in runs for t in run[1:] if t["cached_tokens"] < t["bound"]]


def test_affinity_keeps_every_turn_cached_to_the_shared_prefix(hybrid_fleet, tmp_path):
    seeds = [int(uuid.uuid4().int % 10**6) + 5000 for _ in range(4)]
    convos = [hybrid_conversation(s, TURNS) for s in seeds]
    for thinking in (True, False):
        runs = run_hybrid_conversations(hybrid_fleet.base_url, f"hf-{thinking}-{seeds[0]}", convos, thinking,
                                        interleave=True)
        assert all(run[0]["cached_tokens"] < run[0]["prompt_tokens"] for run in runs)
        assert _below_bound(runs) == [], thinking
        assert all(t["cached_tokens"] > 0 for run in runs for t in run[1:])
    # the same kind of conversations through a round_robin router: consecutive turns change replica
    port = free_port_block(2)
    log = open(tmp_path / "rr-router.log", "wb")
    rr = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "vllm-router"), "--port", str(port),
                           "--prometheus-port", str(port + 1), "--worker-urls", *hybrid_fleet.replica_urls,
                           "--policy", "round_robin", *ROUTER_FLAGS], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _ready(port):
            assert time.monotonic() < deadline and rr.poll() is None, "the round_robin router did not start"
            time.sleep(0.5)
        rr_runs = run_hybrid_conversations(f"http://127.0.0.1:{port}", f"rr-{seeds[0]}",
                                           [hybrid_conversation(s + 17, TURNS) for s in seeds[:2]], True)
    finally:
        rr.terminate()
        rr.wait(30)
        log.close()
    assert _below_bound(rr_runs), "round_robin kept every turn on a warm replica: the comparison shows nothing"
