"""Token-weighted admission policy (pure Python: no vLLM)."""
import dataclasses
import json
import math
import random
import subprocess
import sys

import pytest

from qwen_vllm_ext.scheduling import policy
from qwen_vllm_ext.scheduling.policy import AdmissionStats, Job, PolicyConfig, order

CFG = PolicyConfig()


def ids(jobs):
    return [j.payload for j in jobs]


def job(name, arrival, prompt, max_tokens=16, cached=0, extra=None, priority=0, seq=None):
    return Job(arrival_time=arrival, prompt_tokens=prompt, cached_tokens=cached, max_tokens=max_tokens,
               extra_args=extra, priority=priority, seq=seq if seq is not None else int(arrival * 1000),
               payload=name)


def test_policy_imports_no_vllm():
    code = ("import sys, qwen_vllm_ext.scheduling.policy; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_weight_is_uncached_prompt_plus_weighted_expected_output():
    assert policy.weight(1000, 100, CFG) == pytest.approx(1070)
    assert job("a", 0, 1000, max_tokens=100, cached=600).weight(CFG) == pytest.approx(470)
    assert job("a", 0, 100, max_tokens=100, cached=500).weight(CFG) == pytest.approx(70)  # never negative


def test_expected_output_cap_and_client_hint():
    assert policy.expected_output_tokens(10**6, None, CFG) == 1024
    assert policy.expected_output_tokens(None, None, CFG) == 1024
    assert policy.expected_output_tokens(50, None, CFG) == 50
    assert policy.expected_output_tokens(4000, {"expected_output_tokens": 30}, CFG) == 30
    assert policy.expected_output_tokens(4000, {"expected_output_tokens": "12"}, CFG) == 12
    assert policy.expected_output_tokens(4000, {"expected_output_tokens": 10**6}, CFG) == 1024
    for bad in (-1, "many", True, float("nan"), None):
        assert policy.expected_output_tokens(40, {"expected_output_tokens": bad}, CFG) == 40
    off = PolicyConfig(output_hint_key="")
    assert policy.expected_output_tokens(40, {"expected_output_tokens": 5}, off) == 40


def test_shorter_jobs_go_first_regardless_of_arrival():
    jobs = [job("long", 0.0, 3000), job("mid", 0.5, 400), job("short", 1.0, 20)]
    assert ids(order(jobs, now=1.0, config=CFG)) == ["short", "mid", "long"]


def test_cache_hits_lower_the_weight():
    jobs = [job("fresh", 0.0, 800), job("cached", 0.1, 2000, cached=1920)]
    assert ids(order(jobs, now=1.0, config=CFG)) == ["cached", "fresh"]


def test_ties_by_arrival_then_sequence():
    jobs = [job("c", 2.0, 100), job("a", 0.0, 100), job("b", 1.0, 100)]
    assert ids(order(jobs, now=3.0, config=CFG)) == ["a", "b", "c"]
    no_aging = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=0)
    same = [job("y", 5.0, 100, seq=2), job("x", 5.0, 100, seq=1)]
    assert ids(order(same, now=6.0, config=no_aging)) == ["x", "y"]


def test_aging_is_multiplicative_and_scale_free():
    cfg = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=2.0, max_wait_s=0)
    assert policy.effective_weight(3000, 2.0, cfg) == pytest.approx(1500)
    assert policy.effective_weight(3000, 4.0, cfg) == pytest.approx(750)
    # A 30x heavier job overtakes fresh light ones after log2(30) half-lives, at any weight scale.
    for scale in (1, 10, 100):
        light, heavy = 10 * scale, 300 * scale
        cross = 2.0 * math.log2(30)
        before = [job("heavy", 0.0, heavy, max_tokens=0), job("light", cross - 0.5, light, max_tokens=0)]
        after = [job("heavy", 0.0, heavy, max_tokens=0), job("light", cross + 0.5, light, max_tokens=0)]
        assert ids(order(before, now=cross + 1, config=cfg))[0] == "light"
        assert ids(order(after, now=cross + 1, config=cfg))[0] == "heavy"


def test_aging_does_not_swamp_weights_at_multi_second_waits():
    # Under overload waits reach seconds; a few seconds of arrival difference must not turn the order
    # into FCFS (the additive 2000 tokens/s prototype did).
    jobs = [job(f"long{i}", i * 0.5, 3000, max_tokens=32) for i in range(4)]
    jobs += [job(f"short{i}", 2.0 + i * 0.5, 60, max_tokens=32) for i in range(4)]
    ranked = ids(order(jobs, now=8.0, config=CFG))
    assert ranked[:4] == ["short0", "short1", "short2", "short3"]
    assert ranked[4:] == ["long0", "long1", "long2", "long3"]  # FIFO among equal weights


@pytest.mark.parametrize("clock", ["seconds", "work"])
def test_rank_key_order_is_time_invariant(clock):
    """The rank-key order equals the effective-weight order at any later instant, on either aging clock."""
    rnd = random.Random(7)
    work = clock == "work"
    cfg = PolicyConfig(max_wait_s=0, aging_half_life_tokens=2500 if work else 0)
    jobs = [job(i, rnd.uniform(0, 20), rnd.randint(1, 5000), max_tokens=rnd.randint(1, 2000), seq=i)
            for i in range(200)]
    for j in jobs:  # the work clock runs at its own pace (here 900 tokens per second)
        j.arrival_work = j.arrival_time * 900.0
    for now in (20.0, 25.0, 60.0):
        def waited(j):
            return (now - j.arrival_time) * 900.0 if work else now - j.arrival_time

        by_effective = sorted(jobs, key=lambda j: (policy.effective_weight(j.weight(cfg), waited(j), cfg),
                                                   j.arrival_time, j.seq))
        ranked = order(jobs, now=now, config=cfg)
        eff = [policy.effective_weight(j.weight(cfg), waited(j), cfg) for j in ranked]
        assert all(a <= b * (1 + 1e-9) for a, b in zip(eff, eff[1:]))
        assert [policy.effective_weight(j.weight(cfg), waited(j), cfg) for j in by_effective] == pytest.approx(eff)


def test_work_clock_ages_by_admitted_weight_not_seconds():
    """On the work clock a light request overtakes a heavy one only if less than log2(weight ratio) half-lives of
    weight were admitted between their arrivals, however many seconds passed: the order is the engine's speed's."""
    cfg = PolicyConfig(max_wait_s=0, aging_half_life_tokens=1000, aging_load_exponent=0)
    long_, short = job("long", 0.0, 1600, max_tokens=0), job("short", 60.0, 100, max_tokens=0)
    # log2(1600 / 100) = 4 half-lives = 4,000 tokens of admitted weight.
    long_.arrival_work, short.arrival_work = 0.0, 3900.0
    assert ids(order([long_, short], now=60.0, config=cfg)) == ["short", "long"]      # 60 s, but only 3,900 tokens
    short.arrival_work = 4100.0
    assert ids(order([long_, short], now=0.1, config=cfg)) == ["long", "short"]       # 0.1 s, but 4,100 tokens
    assert ids(order([long_, short], now=0.1, config=cfg, load=2.0)) == ["long", "short"]  # exponent 0: fixed
    scaled = PolicyConfig(max_wait_s=0, aging_half_life_tokens=1000, aging_load_exponent=2)
    assert policy.half_life(scaled, 1.5) == pytest.approx(2250.0)
    assert ids(order([long_, short], now=0.1, config=scaled, load=1.5)) == ["short", "long"]  # 4,100 < 4 x 2,250
    seconds = PolicyConfig(max_wait_s=0, aging_half_life_tokens=0, aging_half_life_s=1.0, aging_load_exponent=0)
    assert ids(order([long_, short], now=60.0, config=seconds)) == ["long", "short"]  # 60 s >> 4 half-lives of 1 s
    with pytest.raises(ValueError):
        PolicyConfig(aging_half_life_tokens=-1)


def test_max_wait_is_a_hard_guarantee_in_arrival_order():
    cfg = PolicyConfig(max_wait_s=10.0, aging_half_life_tokens=0, aging_half_life_s=1000.0)
    jobs = [job("old-long", 0.0, 30000), job("older-long", -1.0, 20000), job("fresh-short", 9.9, 5),
            job("not-yet", 0.5, 25000)]
    ranked = ids(order(jobs, now=10.0, config=cfg))
    assert ranked[:2] == ["older-long", "old-long"]
    assert ranked[2:] == ["fresh-short", "not-yet"]
    assert policy.is_overdue(0.0, 10.0, cfg) and not policy.is_overdue(0.5, 10.0, cfg)
    assert not policy.is_overdue(-1e9, 10.0, PolicyConfig(max_wait_s=0))


def test_priority_is_respected_only_when_asked():
    jobs = [job("short", 0.0, 10, priority=5), job("long", 1.0, 3000, priority=0)]
    assert ids(order(jobs, now=2.0, config=CFG)) == ["short", "long"]
    assert ids(order(jobs, now=2.0, config=CFG, use_priority=True)) == ["long", "short"]


def test_the_fcfs_fallback_keeps_vllms_priority_order():
    """Where the queue falls back to arrival order (``fcfs_above``; with measured costs, until the engine has
    measured them) it orders as vLLM's own queue for the scheduling policy: arrival for FCFS, (priority, arrival)
    under ``--scheduling-policy priority`` -- not arrival alone, which served a later, more urgent request after an
    earlier, less urgent one."""
    fcfs = PolicyConfig(fcfs_above=1)
    jobs = [job("early-low", 0.0, 10, priority=5, seq=1), job("late-urgent", 1.0, 3000, priority=0, seq=2),
            job("late-low", 1.5, 20, priority=5, seq=3)]
    assert ids(order(jobs, now=2.0, config=fcfs)) == ["early-low", "late-urgent", "late-low"]
    assert ids(order(jobs, now=2.0, config=fcfs, use_priority=True)) == ["late-urgent", "early-low", "late-low"]
    # a request past its maximum wait goes first within its priority class, not ahead of a more urgent class
    overdue = PolicyConfig(max_wait_s=1.0)
    assert ids(order(jobs, now=2.0, config=overdue))[0] == "early-low"
    assert ids(order(jobs, now=2.0, config=overdue, use_priority=True))[:2] == ["late-urgent", "early-low"]


def test_grouping_puts_similar_weights_together():
    aging = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=1.0, max_wait_s=0)
    grouping = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=1.0, max_wait_s=0, group_ratio=2.0)
    # "aged" (weight 1000) waited long enough to rank between the fresh 100 and 150 ones (effective ~110).
    jobs = [job("a", 10.0, 100, max_tokens=0, seq=1), job("aged", 10.0 - math.log2(1000 / 110), 1000,
            max_tokens=0, seq=2), job("b", 10.0, 150, max_tokens=0, seq=3), job("c", 10.0, 190, max_tokens=0,
            seq=4)]
    assert ids(order(jobs, now=10.0, config=aging)) == ["a", "aged", "b", "c"]
    assert ids(order(jobs, now=10.0, config=grouping)) == ["a", "b", "c", "aged"]
    first_three = [j.weight(grouping) for j in order(jobs, now=10.0, config=grouping)[:3]]
    assert policy.stddev(first_three) < policy.stddev([100, 1000, 150])


def test_grouping_is_off_by_default_and_keeps_the_overdue_lane_first():
    assert PolicyConfig().group_ratio == 0.0
    cfg = PolicyConfig(group_ratio=2.0, max_wait_s=5.0)
    jobs = [job("overdue-long", 0.0, 40000), job("s1", 9.0, 10), job("s2", 9.0, 12, seq=2)]
    assert ids(order(jobs, now=10.0, config=cfg))[0] == "overdue-long"


def test_fcfs_fallback_above_threshold():
    cfg = PolicyConfig(fcfs_above=3)
    jobs = [job("long", 0.0, 3000), job("s1", 1.0, 10), job("s2", 2.0, 10)]
    assert ids(order(jobs, now=3.0, config=cfg)) == ["s1", "s2", "long"]  # 3 waiting: not above
    jobs.append(job("s3", 2.5, 10))
    assert ids(order(jobs, now=3.0, config=cfg)) == ["long", "s1", "s2", "s3"]


def test_config_validation_and_settings():
    for bad in ({"output_weight": -1}, {"aging_half_life_s": -1}, {"max_wait_s": float("nan")},
                {"lookup_candidates": -1}, {"fcfs_above": -2}, {"output_cap": -1}):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)
    from qwen_vllm_ext.config import Settings

    cfg = Settings.from_flat({"sched_output_weight": 0.5, "sched_max_wait_s": "12", "sched_lookup_candidates": 8}).scheduler
    assert (cfg.output_weight, cfg.max_wait_s, cfg.lookup_candidates, cfg.output_cap) == (0.5, 12.0, 8, 1024)


def test_the_policy_is_the_one_definition_of_the_scheduler_settings():
    """Settings nests PolicyConfig: every policy field f is the setting sched_f, with the policy's default."""
    from qwen_vllm_ext.config import Settings

    assert PolicyConfig() == Settings().scheduler
    names = Settings.field_names()
    for f in dataclasses.fields(PolicyConfig):
        assert f"{policy.SETTING_PREFIX}{f.name}" in names
        assert Settings().flat()[f"sched_{f.name}"] == f.default
    resolved = Settings.resolve(env={"QWEN_VLLM_EXT_SCHED_MAX_WAIT_S": "12"})
    assert resolved.scheduler.max_wait_s == 12.0 == resolved.flat()["sched_max_wait_s"]
    assert Settings.from_flat(json.loads(resolved.to_json())) == resolved  # what child processes read back


def test_admission_stats_snapshot_and_drain():
    stats = AdmissionStats(window=4)
    stats.record_step([100, 300], [0.5, 1.5], overdue=1, cache_hits=64, prompt_tokens=400)
    stats.record_step([50], [2.0], overdue=0, cache_hits=0, prompt_tokens=50)
    snap = stats.snapshot()
    assert snap["steps"] == 2 and snap["admitted"] == 3 and snap["max_wait_admissions"] == 1
    assert snap["admitted_weight_std_last"] == pytest.approx(100)  # single-admission steps don't count
    assert snap["queue_wait_p50_s"] == 1.5 and snap["queue_wait_p99_s"] == 2.0
    assert snap["cache_hit_tokens"] == 64 and snap["prompt_tokens"] == 450
    assert stats.drain() == {"admitted_weight_std": [100.0], "queue_wait_s": [0.5, 1.5, 2.0]}
    assert stats.drain() == {"admitted_weight_std": [], "queue_wait_s": []}
    for i in range(10):
        stats.record_step([], [float(i)], 0, 0, 0)
    assert stats.drain()["queue_wait_s"] == [6.0, 7.0, 8.0, 9.0]  # bounded window
    assert policy.quantile([], 0.5) == 0.0 and policy.stddev([3.0]) == 0.0


def test_load_factor_and_half_life():
    assert policy.load_factor(None, 100.0) == 1.0 and policy.load_factor(100.0, None) == 1.0  # unknown
    assert policy.load_factor(50.0, 100.0) == 1.0                     # below capacity: no change
    assert policy.load_factor(170.0, 100.0) == pytest.approx(1.7)
    assert policy.load_factor(1e6, 1.0) == policy.MAX_LOAD_FACTOR      # a burst's first seconds: clamped
    cfg = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=1.0, aging_load_exponent=1.0)
    assert policy.half_life(cfg) == 1.0 and policy.half_life(cfg, 1.7) == pytest.approx(1.7)
    seconds = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=0.5, aging_load_exponent=2.0)
    assert policy.half_life(seconds, 2.0) == pytest.approx(2.0)
    assert policy.half_life(PolicyConfig(aging_load_exponent=0.0), 3.0) == 2500.0   # exponent 0: fixed (tokens)
    assert policy.half_life(PolicyConfig(), 1.5) == pytest.approx(2500.0 * 1.5 ** 2)  # the defaults
    no_aging = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=0.0)
    assert policy.half_life(no_aging, 3.0) == 0.0     # no aging stays no aging
    assert policy.effective_weight(1000.0, 1.7, cfg, load=1.7) == pytest.approx(500.0)


def test_overload_widens_the_overtaking_window():
    """A 16x lighter request overtakes a heavier one that arrived up to log2(16) = 4 half-lives earlier: 4 s at
    capacity, 8 s at twice the capacity (load-scaled half-life)."""
    cfg = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=1.0, aging_load_exponent=1.0, max_wait_s=0)
    jobs = [job("long", 0.0, 1600, max_tokens=0), job("short", 6.0, 100, max_tokens=0)]
    assert ids(order(jobs, now=6.0, config=cfg)) == ["long", "short"]              # 6 s > 4 half-lives of 1 s
    assert ids(order(jobs, now=6.0, config=cfg, load=2.0)) == ["short", "long"]    # 6 s < 4 half-lives of 2 s
    fixed = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=1.0, aging_load_exponent=0.0, max_wait_s=0)
    assert ids(order(jobs, now=6.0, config=fixed, load=2.0)) == ["long", "short"]
    # The hard maximum wait still wins over any half-life.
    capped = PolicyConfig(aging_half_life_tokens=0, aging_half_life_s=1.0, aging_load_exponent=1.0, max_wait_s=5.0)
    assert ids(order(jobs, now=6.0, config=capped, load=4.0)) == ["long", "short"]


def test_rate_meter_window():
    meter = policy.RateMeter(window_s=10.0)
    assert meter.rate(0.0) is None
    meter.record(0.0, 0.0)
    meter.record(0.5, 500.0)
    assert meter.rate(0.9) is None                   # under a second observed: no estimate yet
    meter.record(2.0, 1500.0)
    assert meter.rate(4.0) == pytest.approx(2000.0 / 4.0)
    assert meter.rate(11.5) == pytest.approx(1500.0 / 10.0)   # the 0.5 s record left the window
    assert meter.rate(13.0) is None                  # nothing recorded in the window: unknown, not infinite
    meter.record(13.0, 0.0)
    assert meter.rate(13.5) is None


def test_load_settings_validation():
    for bad in ({"aging_load_exponent": -1}, {"aging_load_exponent": float("inf")}, {"rate_window_s": 0}):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)


def test_bad_scheduler_settings_fail_at_resolution_with_the_setting_named():
    """A bad sched_* value is a SettingsError when the settings are resolved (the launcher prints it and exits),
    not a traceback from the engine core when it builds its scheduler."""
    from qwen_vllm_ext.config import Settings, SettingsError

    for name, value in (("sched_aging_load_exponent", -1), ("sched_max_wait_s", "nan"), ("sched_rate_window_s", 0),
                        ("sched_output_weight", "inf"), ("sched_aging_half_life_tokens", -5)):
        with pytest.raises(SettingsError, match=f"setting '{name}': .*must be"):
            Settings.resolve(env={}, cli={name: value})
    assert Settings.resolve(env={}, cli={"sched_aging_load_exponent": 2}).scheduler.aging_load_exponent == 2.0


def test_slip_deadline_and_its_floor():
    off = PolicyConfig(max_slip=0)
    assert policy.slip_deadline(100.0, 5000.0, off) == float("inf")          # 0: no bound
    assert PolicyConfig().max_slip == 0.10                                    # the shipped bound (issue #50)
    cfg = PolicyConfig(max_slip=0.25)
    assert policy.slip_deadline(100.0, 4000.0, cfg) == 100.0 + 5000.0        # 1.25 x the weight queued ahead
    assert policy.slip_deadline(100.0, 0.0, cfg) == 100.0                     # empty queue: due at once (FCFS)
    assert policy.slip_deadline(100.0, 4000.0, cfg, floor=9000.0) == 9100.0  # the floor lets it wait longer
    floor = policy.SlipFloor(0.9, history=10)
    assert floor.observe(50.0) == 0.0                                         # no history yet
    for ahead in range(1, 10):
        floor.observe(float(ahead * 100))
    assert floor.observe(0.0) == 800.0                                        # 0.9-quantile (9th of 50, 100 .. 900)
    for _ in range(10):
        floor.observe(0.0)
    assert floor.observe(0.0) == 0.0                                          # history of the latest 10 only
    assert policy.SlipFloor(0.0).observe(1e6) == 0.0                          # off
    with pytest.raises(policy.PolicyError, match="slip_floor_quantile"):
        PolicyConfig(slip_floor_quantile=1.5)
    with pytest.raises(policy.PolicyError, match="max_slip"):
        PolicyConfig(max_slip=-1)


def test_reference_order_puts_requests_past_their_slip_deadline_first():
    cfg = PolicyConfig(max_wait_s=0, aging_half_life_tokens=0, aging_half_life_s=0, max_slip=0.25)
    long = Job(arrival_time=0.0, prompt_tokens=3000, max_tokens=1, seq=1, deadline_work=1000.0)
    short = Job(arrival_time=1.0, prompt_tokens=50, max_tokens=1, seq=2, deadline_work=5000.0)
    assert order([long, short], 2.0, cfg, work=999.0) == [short, long]
    assert order([long, short], 2.0, cfg, work=1000.0) == [long, short]


# ---- the overload gate (token_weighted_scheduler=auto) ---------------------------------------------------------
def test_overload_gate_turns_on_above_its_bound_and_off_only_at_the_exit_bound():
    gate = policy.OverloadGate(PolicyConfig(overload_steps=4.0, overload_exit_steps=1.0))
    seen = [gate.update(b) for b in (0.0, 3.9, 4.0, 4.01, 3.0, 1.5, 1.01, 1.0, 2.0, 4.0, 9.0)]
    # on strictly above 4 full steps; stays on down to the exit bound (no flapping between 1 and 4); off at 1
    assert seen == [False, False, False, True, True, True, True, False, False, False, True]
    assert gate.switches == 3 and gate.backlog_steps == 9.0
    flat = policy.OverloadGate(PolicyConfig(overload_steps=2.0, overload_exit_steps=2.0))  # no hysteresis: allowed
    assert [flat.update(b) for b in (2.5, 2.0, 2.5)] == [True, False, True]


def test_overload_gate_stays_shut_for_a_decode_bound_queue():
    """A deep queue whose work is mostly its requests' outputs (a decode-bound engine: prefill under
    sched_overload_prefill_share of it) is one no order helps: the gate stays shut, and an open gate shuts once the
    share falls below half the bound."""
    gate = policy.OverloadGate(PolicyConfig(overload_steps=4.0, overload_exit_steps=1.0, overload_prefill_share=0.5))
    assert PolicyConfig().overload_prefill_share == 0.5
    assert [gate.update(9.0, s) for s in (0.1, 0.49, 0.5, 0.3, 0.26, 0.24)] == [False, False, True, True, True, False]
    assert gate.switches == 2 and gate.prefill_share == 0.24
    assert gate.update(9.0, None) is True          # share unknown (empty lane): the backlog decides
    off = policy.OverloadGate(PolicyConfig(overload_prefill_share=0.0))
    assert off.update(9.0, 0.0) is True            # 0: the backlog alone decides


def test_prefill_tokens_price_the_context_of_a_prompt():
    assert policy.prefill_tokens(1000, 0) == 1000.0                       # no context term: tokens
    assert policy.prefill_tokens(1000, 500, 0.001) == pytest.approx(1000 + 0.001 * 1000 * (500 + 500))
    assert policy.prefill_tokens(-5, 100, 1.0) == 0.0                      # nothing uncached: nothing to prefill
    # chunked or not, the same prompt costs the same: 2 x 500 after 0 and after 500 == 1000 after 0
    assert policy.prefill_tokens(500, 0, 0.01) + policy.prefill_tokens(500, 500, 0.01) == pytest.approx(
        policy.prefill_tokens(1000, 0, 0.01))


def test_scheduler_mode_setting_is_false_true_or_auto_and_anything_else_is_refused_by_name():
    from qwen_vllm_ext.config import Settings, SettingsError

    assert Settings().token_weighted_scheduler == "false"
    for value, mode in ((True, "true"), (False, "false"), ("auto", "auto"), (" AUTO ", "auto"), ("on", "true"),
                        ("0", "false"), ("yes", "true")):
        assert Settings.resolve(env={}, cli={"token_weighted_scheduler": value}).token_weighted_scheduler == mode
    env = Settings.resolve(env={"QWEN_VLLM_EXT_TOKEN_WEIGHTED_SCHEDULER": "auto"})
    assert env.token_weighted_scheduler == "auto" and Settings.from_flat(json.loads(env.to_json())) == env
    for bad in ("sometimes", "2", "", "automatic"):
        with pytest.raises(SettingsError, match="setting 'token_weighted_scheduler' expects false/true/auto"):
            Settings.resolve(env={}, cli={"token_weighted_scheduler": bad})
    for name, value, what in (("sched_overload_steps", -1, "must be a finite number >= 0"),
                              ("sched_overload_prefill_share", 1.5, "must be in \\[0, 1\\]"),
                              ("sched_overload_steps", "inf", "must be a finite number >= 0"),
                              ("sched_overload_exit_steps", 5, "must be <= overload_steps")):
        with pytest.raises(SettingsError, match=f"setting '{name}': .*{what}"):
            Settings.resolve(env={}, cli={name: value})

