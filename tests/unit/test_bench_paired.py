"""qwen_vllm_ext.bench.paired: the intervals and the never-worse test of issue #35's comparisons (pure)."""
import math

import pytest

from qwen_vllm_ext.bench.paired import TARGETS, judge, observations_needed, ratio_interval, t975


def test_the_interval_is_the_t_interval_of_the_mean_log_ratio():
    ratios = [1.0, 1.02, 0.98, 1.01]
    iv = ratio_interval(ratios)
    logs = [math.log(r) for r in ratios]
    m = sum(logs) / 4
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 3)
    assert iv["n"] == 4 and iv["point"] == pytest.approx(math.exp(m))
    assert iv["lo"] == pytest.approx(math.exp(m - 3.182 * sd / 2)) and iv["hi"] == pytest.approx(math.exp(m + 3.182 * sd / 2))
    assert iv["sd_log"] == pytest.approx(sd) and iv["ratios"] == ratios


def test_the_interval_is_symmetric_in_which_side_is_the_numerator():
    ratios = [0.8, 1.3, 1.1, 0.95, 1.05]
    a, b = ratio_interval(ratios), ratio_interval([1 / r for r in ratios])
    assert a["point"] == pytest.approx(1 / b["point"])
    assert a["lo"] == pytest.approx(1 / b["hi"]) and a["hi"] == pytest.approx(1 / b["lo"])


def test_one_observation_gives_no_interval_and_fails_the_test():
    iv = ratio_interval([1.0])
    assert iv["point"] == 1.0 and math.isnan(iv["lo"]) and math.isnan(iv["hi"])
    assert judge({key: iv for key, *_ in TARGETS}) == {"pass": False, "pass_point": True}
    # unusable ratios (a zero reference, a NaN) are left out, not counted
    assert ratio_interval([float("nan"), 0.0, -1.0])["n"] == 0
    assert ratio_interval([1.0, float("inf"), 1.1])["n"] == 2


def test_the_cell_passes_only_when_every_interval_is_inside_its_limit():
    tight = ratio_interval([0.99, 1.0, 1.01, 1.0])
    assert judge({key: tight for key, *_ in TARGETS}) == {"pass": True, "pass_point": True}
    # the same point, a wide interval: the points pass, the cell does not (the A/A case of issue #35 at 1.2x)
    wide = ratio_interval([0.62, 1.6, 1.0, 1.05])
    assert wide["hi"] > 1.08
    assert judge({"ttft_mean_s": tight, "ttft_p99_s": wide, "output_tok_s": tight})["pass"] is False
    # throughput is judged at the lower edge
    slow = ratio_interval([0.95, 0.96, 0.955])
    assert judge({"ttft_mean_s": tight, "ttft_p99_s": tight, "output_tok_s": slow}) == {"pass": False,
                                                                                         "pass_point": False}
    # a mean TTFT point above 1.0 fails the point test even inside the interval limit
    above = ratio_interval([1.01, 1.012, 1.011])
    assert judge({"ttft_mean_s": above, "ttft_p99_s": tight, "output_tok_s": tight}) == {"pass": True,
                                                                                          "pass_point": False}


def test_observations_needed_and_the_t_table():
    assert observations_needed(0.03) == 4 and observations_needed(0.146) == 94
    assert observations_needed(0.475) > 900
    assert t975(1) == 12.706 and t975(5) == 2.571 and t975(30) == 2.042 and t975(200) == 1.96
    with pytest.raises(ValueError):
        t975(0)
