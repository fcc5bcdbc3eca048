"""E2E: turn and answer checkpoints hold across a fleet of hybrid replicas -- ``python -m qwen_vllm_ext.fleet --model
qwen36-demo`` with 2 replicas behind vllm-router (``consistent_hash`` on ``x-session-id``) and one real Redis, the
launcher's defaults (the prefix-stable ``qwen3.5-reuse`` template). Every turn of a conversation reaches the replica
that kept its previous turn's state, so every turn is cached to the prefix it shares with the previous request and
its generated answer; a round_robin router over the same replicas shows what affinity buys."""
from __future__ import annotations

import uuid

import httpx
import pytest

from benchmarks.bench_kv_reuse import run_generated_conversations
from qwen_vllm_ext.bench.server import FleetProcess, ServerStartError
from qwen_vllm_ext.demo import HYBRID_SERVED_NAME
from tests.redis_server import RedisServer

from .servers import STARTUP_TIMEOUT_S, early, round_robin_router

TURNS = 3  # turn 3 resumes from the checkpoint turn 2 left: a chain, as in longer conversations
# answers of 20-200 tokens (the benchmark's run to 600; test_hybrid_demo's too): every answer still spans several
# 16-token units, and the test alone takes 22 s instead of 40
ANSWERS = (20, 80, 200)


EARLY_GB = 7  # two replicas, a router, Redis


def start_early(tmp_path_factory) -> dict:
    data = tmp_path_factory.mktemp("hybrid-fleet")
    redis = RedisServer().start()
    return {"redis": redis, "fleet": FleetProcess(2, data / "fleet.log", data / "data",
                                                  fleet_args=["--redis-url", redis.url, "--model", HYBRID_SERVED_NAME])}


@pytest.fixture(scope="module")
def hybrid_fleet(request):
    started = early(request, start_early)
    proc = started["fleet"]
    try:
        proc.wait_ready(STARTUP_TIMEOUT_S)
    except ServerStartError as exc:
        proc.stop()
        started["redis"].cleanup()
        pytest.fail(str(exc))
    yield proc
    proc.stop()
    started["redis"].cleanup()


def _below_bound(runs) -> list[tuple[int, int]]:
    """(cached, bound) of every turn after the first that got less than its shared prefix floored to the unit."""
    return [(t["cached_tokens"], t["bound"]) for run in runs for t in run[1:] if t["cached_tokens"] < t["bound"]]


def _why(fleet, runs, prefix: str) -> str:
    """What a failure needs to be understood: every turn's counts, and where the router sent each request of these
    conversations (its log names the worker per session key)."""
    fields = ("prompt_tokens", "cached_tokens", "shared", "prev_seen", "bound")
    turns = [[{k: t.get(k) for k in fields} for t in run] for run in runs]
    try:
        log = (fleet.data_dir / "logs" / "router.log").read_text(errors="replace").splitlines()
    except OSError as exc:
        log = [f"(router log unreadable: {exc})"]
    routed = [line[line.find("key="):] for line in log if "Consistent hash routing" in line and prefix in line]
    counters = {}
    for url in fleet.replica_urls:  # the engines' own view: prefix-cache queries and hits, the checkpoints' counters
        try:
            text = httpx.get(url + "/metrics", timeout=30).text
        except httpx.HTTPError as exc:
            counters[url] = str(exc)
            continue
        counters[url] = [line for line in text.splitlines() if line.startswith(("qwen_ext_kv_", "vllm:prefix_cache"))]
    return f"turns: {turns}; routed: {routed[-2 * len(turns[0]) * len(turns):]}; replicas: {counters}"


def test_affinity_keeps_every_turn_cached_to_the_shared_prefix(hybrid_fleet, tmp_path):
    seed = int(uuid.uuid4().int % 10**6) + 5000  # fresh conversations: no earlier run's cache helps
    for thinking in (True, False):
        runs = run_generated_conversations(hybrid_fleet.base_url, f"hf-{thinking}-{seed}", 2, TURNS, thinking,
                                           seed0=seed, answers=ANSWERS)
        assert all(run[0]["cached_tokens"] < run[0]["prompt_tokens"] for run in runs)
        # a string message: pytest prints it whole (a tuple's repr is cut to a line)
        assert _below_bound(runs) == [], f"thinking={thinking}: {_why(hybrid_fleet, runs, f'hf-{thinking}-{seed}')}"
        if thinking:  # the default drops earlier reasoning (preserve_thinking "answers"): resumed at the turn
            assert all(t["shared"] < t["prev_seen"] and t["cached_tokens"] > 0 for run in runs for t in run[1:])
        else:  # the previous answer came back whole and was reused
            assert all(t["shared"] == t["prev_seen"] and t["cached_tokens"] > 0 for run in runs for t in run[1:])
    # the same kind of conversations through a round_robin router: consecutive turns change replica
    with round_robin_router(hybrid_fleet.replica_urls, tmp_path / "rr-router.log") as rr_url:
        rr_runs = run_generated_conversations(rr_url, f"rr-{seed}", 2, TURNS, True, seed0=seed + 17, answers=ANSWERS)
    assert _below_bound(rr_runs), "round_robin kept every turn on a warm replica: the comparison shows nothing"
