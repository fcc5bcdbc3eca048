"""benchmarks/bench_scheduler.py's paired analysis (issue #35) on synthetic replays: observations grouped per repeat
and seed with the traces pooled, ratios side 1 / side 0 with intervals, and the cell test that decides the exit
status. No engine: the replays are built here, so the expected ratios are known exactly."""
from __future__ import annotations

import pytest

from benchmarks import bench_scheduler as bench


def replay(ttfts: list[float], span: float, out_tokens: int = 20) -> dict:
    reqs = [{"i": i, "prompt_len": 100 + i, "max_tokens": out_tokens, "long": False, "arrival": float(i),
             "sent_lag": 0.0, "ttft": t, "e2e": t + 1.0, "done": float(i) + t + 1.0, "out_tokens": out_tokens}
            for i, t in enumerate(ttfts)]
    return {"t0": 0.0, "t_first_arrival": 0.0, "t_end": span, "requests": reqs, "comp": [], "steps": [],
            "preempted": 0}


def observations(factor_by_obs: list[float], speed_by_obs: list[float] | None = None) -> list[dict]:
    """Two repeats x seeds, two traces; side 1's TTFTs are side 0's times the observation's factor, its span
    divided by the observation's speed (throughput ratio = speed)."""
    base = [0.1 * (k + 1) for k in range(50)]
    obs = []
    for n, factor in enumerate(factor_by_obs):
        speed = speed_by_obs[n] if speed_by_obs else 1.0
        for trace in ("longtail", "burst"):
            obs.append({"rep": n // 2, "seed": n % 2, "load": 1.2, "trace": trace, "cpus": [0, 1],
                        "runs": [replay(base, 60.0), replay([t * factor for t in base], 60.0 / speed)]})
    return obs


def test_a_uniform_win_is_measured_exactly_and_passes():
    cells = bench.analyse(observations([0.8, 0.8, 0.8, 0.8]), [1.2], ["longtail", "burst"], slo=2.0)
    cell = cells["1.2"]["all"]
    assert cell["observations"] == 4  # two repeats x two seeds, the traces pooled
    mean = cell["metrics"]["ttft_mean_s"]
    assert mean["point"] == pytest.approx(0.8) and mean["lo"] == pytest.approx(0.8) and mean["hi"] == pytest.approx(0.8)
    assert cell["metrics"]["output_tok_s"]["point"] == pytest.approx(1.0)
    assert cell["pass"] and cell["pass_point"]
    assert cells["1.2"]["longtail"]["observations"] == 4 and cells["1.2"]["longtail"]["pass"]


def test_a_noisy_comparison_fails_even_when_its_point_is_even():
    """The A/A case at 1.2x: ratios scattered around 1.0 — the point passes, the interval does not."""
    cell = bench.analyse(observations([0.7, 1.4, 1.0, 1.02]), [1.2], ["longtail", "burst"], 2.0)["1.2"]["all"]
    mean = cell["metrics"]["ttft_mean_s"]
    assert mean["lo"] < 0.8 and mean["hi"] > 1.03
    assert cell["pass"] is False


def test_a_throughput_loss_fails_the_cell():
    cell = bench.analyse(observations([0.9] * 4, [0.95, 0.95, 0.95, 0.95]), [1.2], ["longtail", "burst"],
                         2.0)["1.2"]["all"]
    assert cell["metrics"]["output_tok_s"]["point"] == pytest.approx(0.95)
    assert cell["pass"] is False and cell["pass_point"] is False


def test_the_report_names_the_verdict_and_the_prediction():
    cells = bench.analyse(observations([0.8] * 4), [1.2], ["longtail", "burst"], 2.0)
    prediction = {"cells": {"1.2": {"ttft_mean_s": 0.81, "ttft_p99_s": 0.9, "output_tok_s": 1.0}}}
    text = bench.report(cells, [1.2], ["longtail", "burst"], ["fcfs", "tw"], prediction)
    assert "ratios tw / fcfs" in text and "PASS" in text and "sim mean 0.81" in text


def test_prompts_differ_between_loads_but_not_between_sides():
    req = bench.make_mix("longtail", 3, 0)[0]
    assert bench.prompt_ids(req, salt="-x0.8") == bench.prompt_ids(req, salt="-x0.8")
    assert bench.prompt_ids(req, salt="-x0.8") != bench.prompt_ids(req, salt="-x1.2")
