"""The token-weighted scheduler inside a real vLLM V1 ``Scheduler`` / ``AsyncScheduler`` built on CPU (as
upstream's ``tests/v1/core/utils.py`` does: local model config, ``skip_tokenizer_init=True``), driven with
``schedule()`` / ``update_from_output()`` and fake model-runner outputs. No model runs."""
from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from qwen_vllm_ext.demo import ensure_demo_model
from qwen_vllm_ext.scheduling.policy import PolicyConfig
from qwen_vllm_ext.scheduling.request_queue import TokenWeightedRequestQueue
from qwen_vllm_ext.scheduling.sim import build_config, build_scheduler
from qwen_vllm_ext.scheduling.vllm_scheduler import (
    TokenWeightedAsyncScheduler,
    TokenWeightedScheduler,
    pick_scheduler_cls,
)

BLOCK = 16
T0 = 1_000_000.0
TOKEN_ORDER = {"measured_costs": False, "max_slip": 0.0}
"""Most tests here check the token-weighted order itself: no measured costs (a fresh scheduler would admit in
arrival order until its cost fit is ready) and no FCFS slip bound (an empty queue makes a request due at once)."""


def P(**overrides) -> PolicyConfig:
    return PolicyConfig(**{**TOKEN_ORDER, **overrides})


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def model_dir() -> str:
    init_none_hash(sha256)
    return str(ensure_demo_model())


def make_config(model_dir, *, num_blocks=1000, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048,
                async_scheduling=False):
    return build_config(model_dir, num_blocks=num_blocks, max_num_seqs=max_num_seqs, block_size=BLOCK,
                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                        async_scheduling=async_scheduling)


def make_scheduler(model_dir, cls=TokenWeightedScheduler, *, policy=None, clock=None, **kwargs):
    return build_scheduler(model_dir, cls, policy=policy or P(), clock=clock or Clock(), log_stats=True, block_size=BLOCK,
                           **{"num_blocks": 1000, "max_num_seqs": 16, "max_model_len": 2048, **kwargs})


_ids = itertools.count()


def make_request(name, prompt_len, *, max_tokens=8, arrival=T0, prompt=None, extra_args=None,
                 priority=0) -> Request:
    if prompt is None:  # unique tokens: no accidental prefix-cache hits between requests
        base = 1000 + next(_ids) * 4096
        prompt = [base + i for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
    return Request(request_id=name, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
                   arrival_time=arrival, block_hasher=get_request_block_hasher(BLOCK, sha256), priority=priority)


def sampling_ids(scheduler, output) -> list[str]:
    """Requests of ``output`` that sample a token this step (not mid-prefill), read right after schedule()."""
    return [rid for rid in output.num_scheduled_tokens
            if rid in scheduler.requests and not scheduler.requests[rid].is_prefill_chunk]


def runner_output(output, samplers) -> ModelRunnerOutput:
    req_ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[7] if r in samplers else [] for r in req_ids])


def finished_ids(engine_outputs) -> list[str]:
    return [o.request_id for outs in engine_outputs.values() for o in outs.outputs if o.finish_reason is not None]


def step(scheduler) -> tuple[object, list[str]]:
    """One synchronous engine step: schedule, fake-run, update; returns (scheduler output, finished ids)."""
    output = scheduler.schedule()
    samplers = set(sampling_ids(scheduler, output))
    return output, finished_ids(scheduler.update_from_output(output, runner_output(output, samplers)))


def admission_order(scheduler) -> list[str]:
    """Log the ids the admission loop pops from the waiting queue (admitted or skipped)."""
    popped: list[str] = []
    queue = scheduler.waiting
    original = queue.pop_request

    def pop():
        request = original()
        popped.append(request.request_id)
        return request

    queue.pop_request = pop
    return popped


# ---- construction -------------------------------------------------------------------------------------
def test_the_scheduler_starts_with_the_policy_passed_in(model_dir):
    """The general plugin binds the engine core's sched_* settings (``bind_policy``); a scheduler built without one
    bound starts with the defaults."""
    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.scheduling import patching
    from qwen_vllm_ext.scheduling.engine_costs import TokenWeightedMixin
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config, kv_cache_config = build_config(model_dir, block_size=BLOCK, num_blocks=1000, max_num_seqs=16,
                                                max_model_len=2048)

    def build():
        return TokenWeightedScheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=BLOCK,
                                      structured_output_manager=StructuredOutputManager(vllm_config), log_stats=False)

    before = TokenWeightedMixin.qwen_bound
    try:
        TokenWeightedMixin.qwen_bound = (None, False)
        assert build().qwen_policy == PolicyConfig()
        patching.bind_policy(Settings.from_flat({"sched_output_weight": 0.25}).scheduler)
        assert build().qwen_policy.output_weight == 0.25
    finally:
        TokenWeightedMixin.qwen_bound = before


def test_factory_picks_the_base_from_the_config(model_dir):
    sync = make_scheduler(model_dir)
    assert type(sync) is TokenWeightedScheduler and not isinstance(sync, AsyncScheduler)
    assert isinstance(sync.waiting, TokenWeightedRequestQueue)
    assert sync.kv_holding_waiting is not sync.waiting
    asyn = make_scheduler(model_dir, async_scheduling=True)
    assert type(asyn) is TokenWeightedAsyncScheduler and isinstance(asyn, AsyncScheduler)
    assert isinstance(asyn, TokenWeightedScheduler) and isinstance(asyn.waiting, TokenWeightedRequestQueue)
    config, _ = make_config(model_dir)
    assert pick_scheduler_cls(config.scheduler_config) is TokenWeightedScheduler
    config.scheduler_config.async_scheduling = True
    assert pick_scheduler_cls(config.scheduler_config) is TokenWeightedAsyncScheduler
    config.scheduler_config.scheduler_cls = "qwen_vllm_ext.scheduling.vllm_scheduler.TokenWeightedScheduler"
    assert config.scheduler_config.get_scheduler_cls() is TokenWeightedScheduler
    status = sync.qwen_status()
    assert status["scheduler"] == "TokenWeightedScheduler" and status["policy"]["output_weight"] == 0.7


# ---- ordering ---------------------------------------------------------------------------------------
def test_short_requests_admitted_before_an_earlier_long_one(model_dir):
    def first_step(cls):
        scheduler = make_scheduler(model_dir, cls, max_num_batched_tokens=256)
        scheduler.add_request(make_request("long", 1500, arrival=T0))
        for i in range(3):
            scheduler.add_request(make_request(f"short{i}", 40, arrival=T0 + 0.01 * (i + 1)))
        output = scheduler.schedule()
        return [r.req_id for r in output.scheduled_new_reqs], output

    fcfs, _ = first_step(Scheduler)
    assert fcfs == ["long"]  # upstream: the long prefill takes the whole step
    weighted, output = first_step(TokenWeightedScheduler)
    assert weighted == ["short0", "short1", "short2", "long"]
    assert output.num_scheduled_tokens["long"] == 256 - 3 * 40  # the long one gets the rest as a chunk


def test_priority_policy_order_is_kept_while_the_costs_are_measured(model_dir):
    """Under ``--scheduling-policy priority`` the queue's arrival-order fallback (measured costs, before the engine
    has measured them) admits as vLLM's priority scheduler does: a later, more urgent request first."""
    def admitted(cls, policy):
        scheduler = make_scheduler(model_dir, cls, policy=policy, max_num_seqs=1, scheduling_policy="priority")
        scheduler.add_request(make_request("early-low", 40, arrival=T0, priority=5))
        scheduler.add_request(make_request("late-urgent", 40, arrival=T0 + 0.01, priority=0))
        return [r.req_id for r in scheduler.schedule().scheduled_new_reqs]

    assert admitted(Scheduler, None) == ["late-urgent"]
    assert admitted(TokenWeightedScheduler, PolicyConfig()) == ["late-urgent"]  # measured costs: none yet


def test_cached_prefix_lowers_the_weight(model_dir):
    scheduler = make_scheduler(model_dir)
    shared = [50_000 + i for i in range(640)]
    scheduler.add_request(make_request("warm", 640, prompt=shared, max_tokens=1))
    while scheduler.has_requests():
        step(scheduler)
    # "fresh" (300 uncached) arrives first; "reuse" (672 tokens, 640 cached) is lighter.
    scheduler.add_request(make_request("fresh", 300, arrival=T0))
    scheduler.add_request(make_request("reuse", 672, prompt=shared + [9] * 32, arrival=T0 + 0.1))
    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == ["reuse", "fresh"]
    assert output.scheduled_new_reqs[0].num_computed_tokens == 640
    assert scheduler.qwen_stats.cache_hit_tokens >= 640


def test_client_hint_and_max_tokens_shape_the_weight(model_dir):
    scheduler = make_scheduler(model_dir)
    scheduler.add_request(make_request("chatty", 100, max_tokens=900, arrival=T0))
    scheduler.add_request(make_request("hinted", 100, max_tokens=900, arrival=T0 + 0.2,
                                       extra_args={"expected_output_tokens": 10}))
    scheduler.add_request(make_request("terse", 200, max_tokens=10, arrival=T0 + 0.1))
    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == ["hinted", "terse", "chatty"]


def test_prefix_lookups_are_bounded(model_dir):
    scheduler = make_scheduler(model_dir, max_num_seqs=2, policy=P(lookup_candidates=3))
    for i in range(2):
        scheduler.add_request(make_request(f"busy{i}", 20, max_tokens=50))
    step(scheduler)
    before = scheduler.qwen_stats.lookups
    for i in range(10):
        scheduler.add_request(make_request(f"w{i}", 20 + i, max_tokens=4))
    assert scheduler.qwen_stats.lookups == before + 10  # one per arrival
    for _ in range(10):
        step(scheduler)  # batch full: nothing can be admitted, so no lookups
    assert scheduler.qwen_stats.lookups == before + 10
    for _ in range(200):
        step(scheduler)
        if not scheduler.has_requests():
            break
    stats = scheduler.qwen_stats.snapshot()
    assert stats["admitted"] == 12 and stats["lookups"] <= 12 + 3 * stats["steps"]
    assert scheduler.qwen_stats.lookups < before + 10 + 3 * 40  # far fewer than K per step


def test_request_past_max_wait_goes_first(model_dir):
    clock = Clock(T0 + 10.0)
    scheduler = make_scheduler(model_dir, policy=P(max_wait_s=5.0), clock=clock,
                               max_num_batched_tokens=512)
    scheduler.add_request(make_request("young-long", 1200, arrival=T0 + 6.0))
    scheduler.add_request(make_request("old-long", 1500, arrival=T0))
    for i in range(4):
        scheduler.add_request(make_request(f"short{i}", 30, arrival=T0 + 9.0))
    order = admission_order(scheduler)
    output = scheduler.schedule()
    assert order[0] == "old-long"
    assert output.num_scheduled_tokens["old-long"] == 512  # takes the step's whole budget as a chunk
    assert scheduler.qwen_stats.max_wait_admissions == 1
    assert scheduler.qwen_stats.queue_wait_s[-1] == pytest.approx(10.0)
    # Below the limit the same "old-long" would have waited behind the shorts.
    clock.t = T0 + 4.0
    relaxed = make_scheduler(model_dir, policy=P(max_wait_s=5.0), clock=clock)
    relaxed.add_request(make_request("old-long", 1500, arrival=T0))
    relaxed.add_request(make_request("short", 30, arrival=T0 + 3.0))
    assert [r.req_id for r in relaxed.schedule().scheduled_new_reqs] == ["short", "old-long"]


def test_measured_overload_lengthens_the_half_life(model_dir):
    """Inside the real scheduler the queue measures the weight arriving and the weight admitted per second; their
    ratio (the overload factor) scales the half-life, so under overload a light request overtakes a heavy one that
    arrived longer ago than it could at capacity."""
    def run(exponent: float) -> tuple[list[str], object]:
        clock = Clock(T0)
        scheduler = make_scheduler(model_dir, clock=clock, policy=P(
            max_wait_s=0, aging_half_life_tokens=0, aging_half_life_s=1.0, aging_load_exponent=exponent))
        scheduler.add_request(make_request("warm", 1000, arrival=T0))
        step(scheduler)  # admits "warm" (weight 1000 + 0.7 x 8) at T0: the only admission so far
        scheduler.add_request(make_request("long", 1600, max_tokens=1, arrival=T0 + 1.0))
        scheduler.add_request(make_request("short", 100, max_tokens=1, arrival=T0 + 6.0))
        clock.t = T0 + 6.0
        order = admission_order(scheduler)
        scheduler.schedule()
        return order, scheduler.waiting

    # log2(1600.7 / 100.7) = 3.99 half-lives of head start; the long request has waited 5 s longer.
    order, queue = run(1.0)
    arriving, admitted = (1005.6 + 1600.7 + 100.7) / 6.0, 1005.6 / 6.0
    assert queue.load == pytest.approx(arriving / admitted, rel=1e-6)   # ~2.69: half-life ~2.69 s
    assert queue.half_life == pytest.approx(queue.load, rel=0.03)
    assert order[:2] == ["short", "long"]
    order, queue = run(0.0)  # fixed 1 s half-life: 5 s > 3.99 half-lives, the long request goes first
    assert queue.half_life == 1.0 and order[:2] == ["long", "short"]


def test_work_clock_counts_admitted_weight_and_ignores_wall_time(model_dir):
    """Default aging runs on the work clock: the scheduler advances it by the weight each step admits, and a light
    request overtakes a heavy one only if less than log2(weight ratio) half-lives of weight were admitted between
    their arrivals — the same order whether those admissions took 0.1 s or 60 s (an engine's speed does not change
    the order)."""
    policy = P(max_wait_s=0, aging_half_life_tokens=1000, aging_load_exponent=0)

    def first(seconds_between: float, admitted_between: float) -> str:
        queue = TokenWeightedRequestQueue(policy)
        queue.add_request(make_request("long", 1600, max_tokens=1, arrival=T0))
        queue.record_admitted(T0 + seconds_between / 2, admitted_between)
        queue.add_request(make_request("short", 100, max_tokens=1, arrival=T0 + seconds_between))
        queue.refresh(T0 + seconds_between)
        return queue.peek_request().request_id

    # log2(1600.7 / 100.7) = 3.99 half-lives = 3,990 tokens of head start for the long request.
    for seconds in (0.1, 60.0):
        assert first(seconds, 3900.0) == "short", seconds
        assert first(seconds, 4100.0) == "long", seconds

    # Inside the scheduler: each step adds the weight it admitted.
    scheduler = make_scheduler(model_dir, policy=policy)
    scheduler.add_request(make_request("a", 300, max_tokens=10, arrival=T0))
    scheduler.add_request(make_request("b", 50, max_tokens=20, arrival=T0))
    step(scheduler)
    assert scheduler.waiting.work == pytest.approx(300 + 0.7 * 10 + 50 + 0.7 * 20)
    status = scheduler.qwen_status()["stats"]
    assert status["admitted_weight"] == scheduler.waiting.work
    assert status["half_life_tokens"] == 1000.0 and status["half_life_s"] is None


def test_slip_bound_keeps_each_request_within_its_fcfs_work(model_dir):
    """With ``max_slip`` a request becomes overdue (arrival-order lane) once the weight admitted since it arrived
    exceeds (1 + max_slip) x the weight that was waiting ahead of it: lighter requests overtake it only until then."""
    policy = P(max_wait_s=0, aging_half_life_tokens=0, aging_half_life_s=0, max_slip=0.5)
    queue = TokenWeightedRequestQueue(policy)
    queue.add_request(make_request("ahead", 1000, max_tokens=1, arrival=T0))
    queue.add_request(make_request("long", 1600, max_tokens=1, arrival=T0 + 1))
    assert queue.queued_weight == pytest.approx(1000.7 + 1600.7)
    (long_entry,) = [e for e in queue._lane if e.payload.request_id == "long"]
    assert long_entry.deadline_work == pytest.approx(1.5 * 1000.7)  # FCFS would admit it after "ahead"
    assert queue.pop_request().request_id == "ahead"                 # lighter of the two
    queue.record_admitted(T0 + 2, 1000.7)
    assert queue.queued_weight == pytest.approx(1600.7)
    queue.add_request(make_request("short1", 100, max_tokens=1, arrival=T0 + 3))
    queue.refresh(T0 + 3)
    assert queue.peek_request().request_id == "short1"              # 1000.7 < 1501: may still overtake
    queue.pop_request()
    queue.record_admitted(T0 + 3, 100.7)
    queue.add_request(make_request("short2", 100, max_tokens=1, arrival=T0 + 4))
    queue.record_admitted(T0 + 4, 450.0)                             # e.g. a resumed request's weight
    queue.refresh(T0 + 4)
    assert queue.work >= long_entry.deadline_work
    assert [r.request_id for r in queue] == ["long", "short2"]       # overdue: before the lighter request
    # Without the bound the light request keeps overtaking.
    free = TokenWeightedRequestQueue(P(max_wait_s=0, aging_half_life_tokens=0, aging_half_life_s=0))
    free.add_request(make_request("long", 1600, max_tokens=1, arrival=T0))
    free.record_admitted(T0, 1e9)
    free.add_request(make_request("short", 100, max_tokens=1, arrival=T0 + 1))
    free.refresh(T0 + 1)
    assert free.peek_request().request_id == "short"
    # The queued weight is what is still waiting, whichever way requests leave.
    for request in list(queue):
        queue.remove_request(request)
    assert queue.queued_weight == 0.0 and not queue


def test_measured_costs_replace_the_token_weight(model_dir):
    """The scheduler fits its own step costs online (from the time between schedule() calls and each step's
    composition) and, after COST_MIN_STEPS busy steps, weighs requests in prefill-token equivalents: on an engine
    whose batch slots are the bottleneck an output token weighs many prompt tokens, so a long prompt is no longer
    ~15x a short one; with ``measured_costs`` off the token weight stays."""
    from qwen_vllm_ext.scheduling import engine_costs as vs
    from qwen_vllm_ext.scheduling.costs import StepCostModel

    slot_bound = StepCostModel(base=0.0053, per_request=5.1e-4, per_token=7.3e-6, per_ctx=4.4e-9)

    def run(measured: bool):
        clock = Clock(T0)
        scheduler = make_scheduler(model_dir, clock=clock, policy=P(measured_costs=measured),
                                   max_num_seqs=16, max_num_batched_tokens=1024)
        rng = random.Random(0)
        for i in range(400):
            scheduler.add_request(make_request(f"r{i}", rng.choice([40, 90, 300, 900]), max_tokens=rng.randint(8, 24),
                                               arrival=T0))
        steps = 0
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            n, tokens, _, pre_ctx, dec_ctx = vs.step_composition(scheduler.requests, output)
            clock.t += slot_bound.cost(n, tokens, pre_ctx, dec_ctx)
            samplers = set(sampling_ids(scheduler, output))
            scheduler.update_from_output(output, runner_output(output, samplers))
            steps += 1
        return scheduler, steps

    scheduler, steps = run(True)
    assert steps > vs.COST_MIN_STEPS
    costs = scheduler.waiting.costs
    assert costs is not None and costs.per_token == pytest.approx(7.3e-6, rel=0.05)
    assert costs.per_request == pytest.approx(5.1e-4, rel=0.05)
    status = scheduler.qwen_status()
    assert status["stats"]["cost_steps_fitted"] == scheduler.qwen_costs.samples > vs.COST_MIN_STEPS
    assert status["stats"]["output_token_weight"] > 50
    assert status["costs"]["ordering"] == "token-weighted" and status["costs"]["model"]["per_token"] > 0
    queue = scheduler.waiting
    assert queue.weigh(2000, 0, 16) / queue.weigh(100, 0, 16) < 3          # token weight: (2011 / 111) = 18
    fresh = make_scheduler(model_dir, policy=PolicyConfig())
    assert fresh.qwen_status()["costs"]["ordering"] == "arrival (waiting for the cost fit)"
    assert fresh.qwen_status()["stats"]["output_token_weight"] is None
    off, _ = run(False)
    assert off.waiting.costs is None and off.qwen_costs.samples > vs.COST_MIN_STEPS
    assert off.waiting.weigh(2000, 0, 16) == pytest.approx(2000 + 0.7 * 16)


def test_cost_fit_pairs_each_interval_with_the_step_it_timed(model_dir):
    """The interval between two schedule() calls is the previous step's duration (sync) or, with async scheduling's
    batch queue of two, the duration of the step before that: the fit pairs it with that step's composition. An idle
    engine or an empty step starts no interval."""
    from qwen_vllm_ext.scheduling.costs import features

    a, b = features(4, 400, 1e4, 0), features(30, 30, 0, 9e3)
    for cls, expected in ((TokenWeightedScheduler, b), (TokenWeightedAsyncScheduler, a)):
        scheduler = make_scheduler(model_dir, cls, async_scheduling=cls is TokenWeightedAsyncScheduler)
        scheduler._qwen_steps.extend([(T0, a), (T0 + 1.0, b)])
        scheduler._qwen_observe_step(T0 + 1.5)
        fit = scheduler.qwen_costs
        assert fit.samples == 1 and fit.xty[0] == pytest.approx(0.5)
        assert fit.xtx[1][1] == pytest.approx(expected[1] ** 2), cls.__name__
        scheduler._qwen_steps.clear()
        scheduler._qwen_observe_step(T0 + 9.0)
        assert fit.samples == 1


def test_status_is_published_throttled_while_busy_and_at_once_when_idle(model_dir, tmp_path, monkeypatch):
    """The health route's status file: written at most once a second while the engine steps, and by the step that
    leaves the engine idle (no later schedule() call would publish those admissions)."""
    import json
    import os

    monkeypatch.setenv("QWEN_VLLM_EXT_INSTANCE_DIR", str(tmp_path))
    clock = Clock(T0)
    scheduler = make_scheduler(model_dir, clock=clock)
    path = tmp_path / f"scheduler-{os.getpid()}.json"

    def published() -> int:
        return json.loads(path.read_text())["stats"]["admitted"]

    scheduler.add_request(make_request("a", 40, max_tokens=3, arrival=T0))
    step(scheduler)
    assert published() == 1                       # first write: nothing published before
    scheduler.add_request(make_request("b", 40, max_tokens=3, arrival=T0))
    clock.t = T0 + 0.1
    step(scheduler)
    assert published() == 1                       # busy, 0.1 s later: throttled
    clock.t = T0 + 0.2
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert published() == 2                       # the step that emptied the engine wrote it


def test_simulator_replays_a_trace_through_the_real_schedulers(model_dir):
    """``scheduling.sim`` on a virtual clock: every request finishes once with exactly its output tokens, TTFTs
    are positive, and the token-weighted scheduler lets short requests that arrive behind long ones overtake them
    where vLLM's FCFS scheduler does not."""
    from qwen_vllm_ext.scheduling.sim import StepCostModel, simulate

    cost = StepCostModel(base=0.007, per_request=0.0002, per_token=0.0002, per_ctx=5e-8)
    reqs = [{"i": i, "prompt_len": 1500 if i % 4 == 0 else 60, "max_tokens": 4 + i % 5, "long": i % 4 == 0}
            for i in range(24)]
    arrivals = [0.05 * i for i in range(24)]  # faster than the engine: a queue builds
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}
    runs = {tw: simulate(model_dir, reqs, arrivals, cost, token_weighted=tw, policy=P(), **engine)
            for tw in (False, True)}
    for run in runs.values():
        assert sorted(r["i"] for r in run["requests"]) == list(range(24))
        assert all(r["out_tokens"] == r["max_tokens"] and 0 < r["ttft"] <= r["e2e"] for r in run["requests"])

    def short_mean(run):
        return sum(r["ttft"] for r in run["requests"] if not r["long"]) / 18

    assert short_mean(runs[True]) < 0.7 * short_mean(runs[False])
    assert runs[True]["qwen_stats"]["admitted"] == 24 and runs[False]["qwen_stats"] is None
    # The shipped policy: a fresh scheduler has no cost model yet and admits in arrival order (FCFS's TTFTs); one
    # started from the FCFS run's step-cost fit (an engine that has been serving) reorders, within its slip bound.
    cold = simulate(model_dir, reqs, arrivals, cost, token_weighted=True, **engine)
    assert [r["ttft"] for r in cold["requests"]] == pytest.approx([r["ttft"] for r in runs[False]["requests"]])
    warm = simulate(model_dir, reqs, arrivals, cost, token_weighted=True, warm=runs[False]["warm"], **engine)
    assert short_mean(warm) < 0.9 * short_mean(runs[False])
    print("short mean TTFT: FCFS", short_mean(runs[False]), "default warm", short_mean(warm), "slip admissions",
          warm["qwen_stats"]["slip_admissions"])


# ---- preemption and removal ----------------------------------------------------------------------------
def preempt_one(scheduler, first: str = "a", second: str = "b") -> Request:
    """Run two requests until the KV cache runs out and one of them is preempted; returns it."""
    scheduler.add_request(make_request(first, 64, max_tokens=100, arrival=T0))
    scheduler.add_request(make_request(second, 64, max_tokens=100, arrival=T0 + 0.1))
    for _ in range(300):
        step(scheduler)
        preempted = [r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED]
        if preempted:
            return preempted[0]
    raise AssertionError("no preemption happened")


def test_preempted_requests_resume_first(model_dir):
    scheduler = make_scheduler(model_dir, num_blocks=14)
    victim = preempt_one(scheduler)
    assert scheduler.waiting.front_lane == [victim]
    scheduler.add_request(make_request("tiny", 4, max_tokens=2, arrival=T0 + 50))  # the lightest of all
    order = admission_order(scheduler)
    finished: list[str] = []
    for _ in range(400):
        finished += step(scheduler)[1]
        if not scheduler.has_requests():
            break
    assert sorted(finished) == sorted(["a", "b", "tiny"])
    assert order.index(victim.request_id) < order.index("tiny")
    assert order[0] == victim.request_id


def test_abort_and_remove_work_in_both_lanes(model_dir):
    scheduler = make_scheduler(model_dir, num_blocks=14)
    victim = preempt_one(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"w{i}", 40, max_tokens=4, arrival=T0 + 10 + i))
    queue = scheduler.waiting
    assert len(queue) == 4 and victim in queue
    assert [r.request_id for r in queue] == [victim.request_id, "w0", "w1", "w2"]

    aborted = scheduler.finish_requests([victim.request_id, "w1"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in aborted} == {victim.request_id, "w1"}
    assert [r.request_id for r in queue] == ["w0", "w2"] and len(queue) == 2 and queue.front_lane == []
    assert victim.request_id not in scheduler.requests and "w1" not in scheduler.requests
    assert scheduler.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED) == []  # once only

    remaining = {"a", "b", "w0", "w2"} - {victim.request_id}
    finished: list[str] = []
    for _ in range(400):
        finished += step(scheduler)[1]
        if not scheduler.has_requests():
            break
    assert sorted(finished) == sorted(remaining)


def test_queue_lanes_peek_pop_prepend_remove():
    queue = TokenWeightedRequestQueue(P())
    queue.refresh(T0 + 1)
    long, short, mid = (make_request("long", 900, arrival=T0), make_request("short", 10, arrival=T0 + 0.1),
                        make_request("mid", 100, arrival=T0 + 0.2))
    for request in (long, short, mid):
        queue.add_request(request)
    assert [r.request_id for r in queue] == ["short", "mid", "long"] and len(queue) == 3
    assert queue.peek_request() is queue.pop_request() is short
    queue.prepend_requests([short, long][::-1])  # the scheduler's skipped deque arrives reversed
    # "long" was still in the scored lane: prepending moves it (a request is never in both lanes).
    assert queue.front_lane == [short, long] and [r.request_id for r in queue] == ["short", "long", "mid"]
    assert len(queue) == 3 and long in queue
    queue.remove_request(short)  # front lane
    queue.remove_requests([mid])  # scored lane
    assert [r.request_id for r in queue] == ["long"] and queue.peek_request() is long
    assert queue.pop_request() is long and not queue and len(queue) == 0
    with pytest.raises(IndexError):
        queue.peek_request()
    with pytest.raises(IndexError):
        queue.pop_request()
    with pytest.raises(ValueError):
        queue.remove_request(long)


# ---- randomized stream ---------------------------------------------------------------------------------
def run_random_stream(model_dir, cls, seed: int, *, pipelined: bool) -> dict:
    rnd = random.Random(seed)
    clock = Clock()
    scheduler = make_scheduler(model_dir, cls, clock=clock, num_blocks=64, max_num_seqs=8,
                               max_num_batched_tokens=256, policy=P(max_wait_s=3.0,
                                                                               lookup_candidates=4),
                               async_scheduling=cls is TokenWeightedAsyncScheduler)
    created: dict[str, int] = {}
    outcomes: Counter = Counter()
    tokens: Counter = Counter()
    preemptions = 0
    shared = [77_000 + i for i in range(96)]
    in_flight: list = []  # (scheduler output, samplers) awaiting update_from_output

    def deliver(item):
        output, samplers = item
        engine_outputs = scheduler.update_from_output(output, runner_output(output, samplers))
        for outs in engine_outputs.values():
            for o in outs.outputs:
                tokens[o.request_id] += len(o.new_token_ids)
                if o.finish_reason is not None:
                    outcomes[o.request_id] += 1

    for n in range(4000):
        clock.t += 0.05
        if n < 200:
            for _ in range(rnd.choice((0, 0, 0, 1, 1, 2))):
                rid = f"r{len(created)}"
                length = rnd.choice((8, 20, 40, 60, 200, 380))
                prompt = shared + [rid.__hash__() % 1000 + i for i in range(length)] if rnd.random() < 0.3 else None
                max_tokens = rnd.randint(1, 40)
                request = make_request(rid, length if prompt is None else len(prompt), prompt=prompt,
                                       max_tokens=max_tokens, arrival=clock.t)
                created[rid] = max_tokens
                scheduler.add_request(request)
            if rnd.random() < 0.08 and scheduler.requests:
                victim = rnd.choice(sorted(scheduler.requests))
                for r in scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED):
                    outcomes[r.request_id] += 1
        output = scheduler.schedule()
        preemptions += len(output.preempted_req_ids or ())
        in_flight.append((output, set(sampling_ids(scheduler, output))))
        if len(in_flight) > (1 if pipelined else 0):
            deliver(in_flight.pop(0))
        # Invariant: every unfinished request is in exactly one place.
        places = Counter(r.request_id for r in itertools.chain(scheduler.waiting, scheduler.running,
                                                                 scheduler.kv_holding_waiting))
        assert all(c == 1 for c in places.values())
        assert set(places) == set(scheduler.requests)
        assert len(scheduler.waiting) == len(list(scheduler.waiting))
        if n >= 200 and not scheduler.has_requests():
            break
    while in_flight:
        deliver(in_flight.pop(0))
    assert not scheduler.has_requests(), "requests left behind"
    assert set(outcomes) == set(created) and all(c == 1 for c in outcomes.values()), "lost or duplicated"
    aborted_ids = {rid for rid in created if tokens[rid] < created[rid]}
    assert all(tokens[rid] == created[rid] for rid in created if rid not in aborted_ids)
    assert all(tokens[rid] <= created[rid] for rid in created)
    stats = scheduler.qwen_stats.snapshot()
    return {"steps_run": n, "created": len(created), "preemptions": preemptions, "aborted": len(aborted_ids), **stats}


@pytest.mark.parametrize("seed", [1, 2])
def test_random_stream_finishes_every_request_exactly_once(model_dir, seed):
    result = run_random_stream(model_dir, TokenWeightedScheduler, seed, pipelined=False)
    assert result["created"] > 100 and result["preemptions"] > 0 and result["aborted"] > 0
    assert result["max_wait_admissions"] > 0 and result["cache_hit_tokens"] > 0
    assert result["lookups"] <= result["created"] + 4 * result["steps"]


def test_random_stream_async_scheduler_pipelined(model_dir):
    result = run_random_stream(model_dir, TokenWeightedAsyncScheduler, 3, pipelined=True)
    assert result["created"] > 100 and result["preemptions"] > 0


# ---- token_weighted_scheduler=auto: vLLM's own decisions until the engine is overloaded --------------------------
class _Grammar:
    """A structured-output request whose grammar is still compiling (``grammar`` None: the scheduler skips it), then
    fails (an exception: vLLM finishes it with an error) — the scheduler's side of structured output, which the
    StructuredOutputManager drives in a server."""

    def __init__(self) -> None:
        self.grammar = None


def replay(model_dir, cls, stream, *, auto=False, policy="fcfs", **engine):
    """Drive a fresh scheduler with a recorded stream, then until it has no requests: per step, the requests that
    arrive, the ids aborted, the grammars that finish compiling; every scheduled request that completes its prompt samples one token. Returns
    per step (scheduled ids in order with their token counts, preempted ids, finished and aborted ids) and the
    scheduler."""
    clock = Clock()
    scheduler = build_scheduler(model_dir, cls, policy=PolicyConfig() if cls is not None else None, clock=clock,
                                auto=auto, block_size=BLOCK, scheduling_policy=policy, **engine)
    grammars: dict[str, _Grammar] = {}
    trace = []
    drain = itertools.repeat(([], [], []), 5000)  # then steps with no events until every request has ended
    for n, (arrivals, aborts, compiled) in enumerate(itertools.chain(stream, drain)):
        if n >= len(stream) and not scheduler.has_requests():
            break
        clock.t = T0 + 0.05 * n
        for a in arrivals:
            request = make_request(a["id"], a["len"], max_tokens=a["max_tokens"], arrival=clock.t + a["lag"],
                                   prompt=a["prompt"], priority=a["priority"])
            if a["grammar"]:
                request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                request.structured_output_request = grammars.setdefault(a["id"], _Grammar())
            scheduler.add_request(request)
        for rid in compiled:
            grammars[rid].grammar = ValueError("grammar failed to compile")
        aborted = scheduler.finish_requests([r for r in aborts if r in scheduler.requests],
                                            RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        samplers = set(sampling_ids(scheduler, output))
        finished = finished_ids(scheduler.update_from_output(output, runner_output(output, samplers)))
        trace.append((list(output.num_scheduled_tokens.items()), sorted(output.preempted_req_ids or ()),
                      sorted(finished + [r.request_id for r in aborted])))
    return trace, scheduler


def recorded_stream(seed: int, steps: int, *, rate: tuple, lengths: tuple, priorities: bool = False) -> list:
    """A reproducible request stream: arrivals per step (drawn from ``rate``), prompt lengths, output lengths,
    shared prefixes, arrival-time jitter (arrival order is not insertion order), priorities, aborts and grammars."""
    rnd = random.Random(seed)
    shared = [55_000 + i for i in range(64)]
    stream, alive, n = [], [], 0
    for step_no in range(steps):
        arrivals = []
        for _ in range(rnd.choice(rate) if step_no < steps - 60 else 0):
            rid, length = f"s{seed}-{n}", rnd.choice(lengths)
            n += 1
            prompt = shared + [90_000 + n * 512 + i for i in range(length)] if rnd.random() < 0.3 else None
            arrivals.append({"id": rid, "len": length if prompt is None else len(prompt), "prompt": prompt,
                             "max_tokens": rnd.randint(1, 24), "lag": -rnd.random() * 0.2,
                             "priority": rnd.choice((0, 0, 1, -1)) if priorities else 0,
                             "grammar": rnd.random() < 0.04})
            alive.append(rid)
        aborts = [alive.pop(rnd.randrange(len(alive)))] if alive and rnd.random() < 0.05 else []
        compiled = [a["id"] for s in stream[-8:-7] for a in s[0] if a["grammar"]]  # compiled 8 steps later
        stream.append((arrivals, aborts, compiled))
    return stream


IDENTITY_ENGINE = {"num_blocks": 48, "max_num_seqs": 8, "max_num_batched_tokens": 1024, "max_model_len": 2048}
"""A small KV cache (48 blocks of 16 tokens for up to 8 requests) so a stream below the gate still preempts."""


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [11, 12])
def test_auto_makes_vllms_decisions_step_by_step_below_the_overload_bound(model_dir, seed, policy):
    """Issue #50's proof without timing: vLLM's own Scheduler and the token-weighted one with the gate (auto) get the
    same recorded stream — arrivals out of arrival-time order, priorities, prefix hits, preemptions, aborts, a
    grammar that compiles late and fails — and schedule the same requests with the same token counts, in the same
    order, preempt and finish the same ones, at every step of a stream that never crosses the bound."""
    stream = recorded_stream(seed, 700, rate=(0, 0, 0, 0, 1, 1, 2), lengths=(8, 20, 40, 90, 200),
                             priorities=policy == "priority")
    assert any(a["grammar"] for s in stream for a in s[0]) and any(s[1] for s in stream)  # grammars and aborts
    ref, _ = replay(model_dir, None, stream, policy=policy, **IDENTITY_ENGINE)
    got, auto = replay(model_dir, TokenWeightedScheduler, stream, auto=True, policy=policy, **IDENTITY_ENGINE)
    gate = auto.waiting.gate
    assert gate is not None and gate.switches == 0 and not gate.overloaded   # the stream stayed below the bound
    assert auto.qwen_stats.steps == len(ref) and auto.qwen_costs.samples > 200  # the cost fit ran and weighed
    for n, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"step {n}: vLLM {a} / auto {b}"
    preempted = sum(len(s[1]) for s in ref)
    finished = {rid for s in ref for rid in s[2]}
    created = {a["id"] for s in stream for a in s[0]}
    assert preempted > 0 and finished == created  # preemptions happened; every request ended (aborted ones too)


def test_auto_orders_by_the_policy_once_overloaded_and_falls_back_to_vllms_order(model_dir):
    """The same comparison over a stream that overloads the engine: the gate opens (the policy reorders: the decisions
    differ from vLLM's), closes again once the backlog drains, and every request still finishes exactly once."""
    stream = recorded_stream(5, 500, rate=(0, 1, 2, 3, 4), lengths=(8, 20, 40, 200, 380))
    ref, _ = replay(model_dir, None, stream, **IDENTITY_ENGINE)
    got, auto = replay(model_dir, TokenWeightedScheduler, stream, auto=True, **IDENTITY_ENGINE)
    gate = auto.waiting.gate
    assert gate.switches >= 2 and not gate.overloaded and auto.waiting.exact   # on, then off once drained
    assert any(a != b for a, b in zip(ref, got))
    assert sorted(r for s in got for r in s[2]) == sorted(r for s in ref for r in s[2])  # each finished once
    # "true" (always on) is not gated: no gate object, and the status says so
    _, plain = replay(model_dir, TokenWeightedScheduler, stream[:50], **IDENTITY_ENGINE)
    assert plain.waiting.gate is None and plain.qwen_status()["mode"] == "true" and plain.qwen_status()["gate"] is None
    status = auto.qwen_status()
    assert status["mode"] == "auto" and status["gate"]["switches"] == gate.switches
    assert status["costs"]["ordering"] == "arrival: vLLM's own order (not overloaded)"
    assert status["stats"]["overloaded"] == 0 and status["stats"]["gate_switches"] == gate.switches
