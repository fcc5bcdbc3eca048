"""The scheduler benchmark's traces, engine settings and per-run metrics, shared by the real-engine benchmark
(``benchmarks/bench_scheduler.py``) and the simulator (``benchmarks/sim_scheduler.py``, whose runs
:func:`qwen_vllm_ext.scheduling.sim.simulate` returns in the same format): both replay the same traces and summarize
a run the same way.

Traces (seeded, the same for every rate and policy; open-loop Poisson arrivals):

* ``longtail`` — 90% short prompts (32–384 tokens, log-uniform), 10% long prompts (2,000–3,500 tokens),
  16–64 output tokens each;
* ``burst`` — the same kind of mix with 5% long prompts, arrivals alternating a low rate and a burst window
  (4x the low rate during the last quarter of every period, the period being a third of the trace's expected
  duration, ~3 bursts per trace); the mean rate is the requested one.

A run (a replay's result: ``requests`` with arrival, ttft, e2e, done, out_tokens…, ``t_first_arrival``, ``t_end``,
optionally the engine's per-step records) is summarized by :func:`summarize`; :func:`pooled` joins several traces'
runs into one. Pure Python, no vLLM.
"""
from __future__ import annotations

import math
import random

ENGINE_KW = dict(enforce_eager=True, dtype="float32", max_num_seqs=32, max_num_batched_tokens=2048,
                 max_model_len=4096, seed=0)
"""The CPU benchmark engine's settings (vLLM engine arguments); its batch limits are the simulator's default ones."""

TRACE_SPECS = {
    "longtail": {"long_frac": 0.10, "burst": None},
    # period_s: None = a third of the trace's expected duration (n / rate), so every run sees ~3 bursts.
    "burst": {"long_frac": 0.05, "burst": {"period_s": None, "window_frac": 0.25, "factor": 4.0}},
}
SHORT_RANGE = (32, 384)
LONG_RANGE = (2000, 3500)
OUT_RANGE = (16, 64)


def make_mix(kind: str, n: int, seed: int) -> list[dict]:
    """Request sizes of a trace (the same for every rate): prompt_len, max_tokens, token seed."""
    spec = TRACE_SPECS[kind]
    rng = random.Random(f"{kind}-{seed}-mix")
    n_long = max(1, round(n * spec["long_frac"]))
    is_long = [True] * n_long + [False] * (n - n_long)
    rng.shuffle(is_long)
    mix = []
    for i, long_ in enumerate(is_long):
        if long_:
            plen = rng.randint(*LONG_RANGE)
        else:
            lo, hi = SHORT_RANGE
            plen = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        mix.append({"i": i, "prompt_len": plen, "max_tokens": rng.randint(*OUT_RANGE), "long": long_,
                    "token_seed": rng.randrange(1 << 30)})
    return mix


def make_arrivals(kind: str, n: int, rate: float, seed: int) -> list[float]:
    """Open-loop Poisson arrival times (s from the trace start) at mean ``rate`` req/s (piecewise-constant rate
    for ``burst``; exact: the exponential is memoryless, so a draw crossing a rate change restarts there)."""
    spec = TRACE_SPECS[kind]
    rng = random.Random(f"{kind}-{seed}-arrivals")
    burst = spec["burst"]
    if burst is None:
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(t)
        return out
    period = burst["period_s"] or n / rate / 3.0
    window, factor = burst["window_frac"] * period, burst["factor"]
    base = rate * period / (period - window + factor * window)
    # Burst window at the END of each period: the trace starts with a quiet stretch. Segments are walked by
    # index (no float round-off can leave a draw stuck on a boundary).
    seg, t, out = 0, 0.0, []
    while len(out) < n:
        k, burst_seg = divmod(seg, 2)
        lam = base * factor if burst_seg else base
        boundary = k * period + (period if burst_seg else period - window)
        t = max(t, k * period + (period - window if burst_seg else 0.0))
        dt = rng.expovariate(lam)
        if t + dt >= boundary:
            seg += 1
            continue
        t += dt
        out.append(t)
    return out


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    rank = max(1, math.ceil(q * len(s)))
    return float(s[min(rank, len(s)) - 1])


def summarize(run: dict, slo: float) -> dict:
    """A run's metrics: TTFT mean / p50 / p99, p99 TTFT of the longest decile by prompt length, output tokens/s,
    goodput under the TTFT SLO ``slo`` (seconds), the admitted-weight spread and the engine's per-step figures (None
    or 0 where the run has no per-step records)."""
    reqs = run["requests"]
    ttft = [r["ttft"] for r in reqs]
    span = run["t_end"] - run["t_first_arrival"]
    out_tokens = sum(r["out_tokens"] for r in reqs)
    by_len = sorted(reqs, key=lambda r: (r["prompt_len"], r["i"]))
    decile = by_len[len(by_len) - max(1, len(by_len) // 10):]
    good = [r for r in reqs if r["ttft"] <= slo]
    steps = run.get("steps") or []
    multi = [s[2] for s in steps if s[1] >= 2]
    qs = run.get("qwen_stats") or {}
    comp = run.get("comp") or []
    return {
        "requests": len(reqs),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "long_decile_p99_ttft_s": quantile([r["ttft"] for r in decile], 0.99),
        "long_decile_min_prompt": decile[0]["prompt_len"],
        "output_tok_s": out_tokens / span,
        "span_s": span,
        "goodput_req_s": len(good) / span,
        "slo_attainment": len(good) / len(reqs),
        "admitted_weight_std_mean": (sum(multi) / len(multi)) if multi else 0.0,
        "admit_steps": len(steps),
        "mean_admitted_per_step": (sum(s[1] for s in steps) / len(steps)) if steps else 0.0,
        "qwen_stats_weight_std_mean": qs.get("admitted_weight_std_mean"),
        "max_wait_admissions": qs.get("max_wait_admissions"),
        "client_lag_p99_s": quantile([r["sent_lag"] for r in reqs], 0.99),
        "schedule_ms_per_step": (1000 * sum(c[1] for c in comp) / len(comp)) if comp else None,
        "engine_steps": len(comp),
        "tokens_per_step": (sum(c[3] for c in comp) / len(comp)) if comp else None,
        "preempted": run.get("preempted"),
        # Engine-core time outside schedule(), the model step and update_from_output(): from the end of one step's
        # update to the start of the next schedule() (input processing, waiting for requests when idle).
        "between_steps_s": sum(max(0.0, (b[0] - b[1]) - (a[0] + a[7] + a[8]))
                               for a, b in zip(comp, comp[1:]) if len(a) >= 9 and b[0] - a[0] < 5.0) if comp else None,
    }


def pooled(runs: list[dict]) -> dict:
    """Pool several traces' runs: requests concatenated; throughput = total tokens / total span."""
    reqs, span, steps, comp, preempted = [], 0.0, [], [], None
    for r in runs:
        reqs += r["requests"]
        span += r["t_end"] - r["t_first_arrival"]
        steps += r.get("steps") or []
        comp += r.get("comp") or []
        if r.get("preempted") is not None:
            preempted = (preempted or 0) + r["preempted"]
    return {"requests": reqs, "t_first_arrival": 0.0, "t_end": span, "steps": steps, "comp": comp,
            "preempted": preempted}
