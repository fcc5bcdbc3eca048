"""Paired A/B comparisons with intervals (issue #35): pure statistics, no vLLM.

A comparison replays the same traces on two sides (side 0 the reference) and forms, per observation, the ratio
side 1 / side 0 of a metric. :func:`ratio_interval` gives the geometric-mean point and the 95% Student t interval of
the mean log ratio over the observations; :func:`judge` applies issue #35's never-worse test to a cell's intervals.
Used by ``benchmarks/bench_scheduler.py`` (the real CPU engine) and ``benchmarks/gpu_check.py`` (one GPU).
"""
from __future__ import annotations

import math

TARGETS = (("ttft_mean_s", "mean", "<=", 1.03, 1.0), ("ttft_p99_s", "p99", "<=", 1.08, 1.05),
           ("output_tok_s", "tput", ">=", 0.97, 0.98))
"""(metric, label, comparison, limit on the interval's edge, limit on the point): a cell passes when the 95% interval
of side 1 / side 0 stays below 1.03 (mean TTFT) and 1.08 (p99 TTFT) and above 0.97 (output throughput); the points
are held to the never-worse targets themselves (<= 1.0, <= 1.05, >= 0.98)."""

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Two-sided 95% Student t quantiles for 1-30 degrees of freedom; beyond, the normal's 1.96."""


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("an interval needs at least two observations")
    return T975[df - 1] if df <= len(T975) else 1.96


def ratio_interval(ratios: list[float]) -> dict:
    """Point and 95% interval of a ratio from paired observations: the t interval of the mean log ratio,
    exponentiated (the geometric mean: symmetric in which side is the numerator). Non-positive or non-finite
    ratios are left out; with fewer than two usable observations the interval is NaN (and :func:`judge` fails it)."""
    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    k = len(logs)
    nan = float("nan")
    if k == 0:
        return {"point": nan, "lo": nan, "hi": nan, "n": 0, "ratios": list(ratios)}
    m = sum(logs) / k
    if k < 2:
        return {"point": math.exp(m), "lo": nan, "hi": nan, "n": k, "ratios": list(ratios)}
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / (k - 1))
    h = t975(k - 1) * sd / math.sqrt(k)
    return {"point": math.exp(m), "lo": math.exp(m - h), "hi": math.exp(m + h), "n": k, "sd_log": sd,
            "half_width": math.exp(h) - 1.0, "ratios": list(ratios)}


def observations_needed(sd_log: float, half_width: float = 0.03) -> int:
    """About how many paired observations give a 95% half-width of ``half_width`` (relative) at a spread of
    ``sd_log`` (normal approximation: (1.96 sd / ln(1 + half_width))^2)."""
    return math.ceil((1.96 * sd_log / math.log1p(half_width)) ** 2)


def judge(metrics: dict) -> dict:
    """Issue #35's test of one cell (``metrics``: :data:`TARGETS`' keys -> :func:`ratio_interval` results): ``pass``
    when every interval's edge is inside its limit (a NaN edge fails), ``pass_point`` when every point meets the
    target."""
    ok_int, ok_pt = True, True
    for key, _label, op, lim_int, lim_pt in TARGETS:
        iv = metrics[key]
        edge = iv["hi"] if op == "<=" else iv["lo"]
        ok_int = ok_int and bool((edge <= lim_int) if op == "<=" else (edge >= lim_int))
        ok_pt = ok_pt and bool((iv["point"] <= lim_pt) if op == "<=" else (iv["point"] >= lim_pt))
    return {"pass": ok_int, "pass_point": ok_pt}
