"""The scheduler's /metrics collector: each engine core's published stats become Prometheus families, and the
half-life gauge is named by the aging clock's unit (a clock's gauge is absent when no engine uses it)."""
import os

import pytest

from qwen_vllm_ext.observability import status
from qwen_vllm_ext.scheduling.metrics import SchedulerCollector


def published(pid: int, **stats) -> dict:
    base = {"steps": 10, "admitted": 7, "max_wait_admissions": 1, "cache_hit_tokens": 64, "prompt_tokens": 900,
            "lookups": 12, "admitted_weight_std_last": 5.0, "admitted_weight_std_mean": 4.0,
            "queue_wait_p50_s": 0.1, "queue_wait_p99_s": 0.9, "load_factor": 1.2, "admitted_weight": 1234.5}
    return {"pid": pid, "scheduler": "TokenWeightedScheduler", "policy": {}, "stats": {**base, **stats}}


def families(monkeypatch, tmp_path, *records) -> dict:
    monkeypatch.setenv(status.INSTANCE_ENV, str(tmp_path))
    for i, record in enumerate(records):
        status.write_json(f"scheduler-{i}.json", record)
    return {f.name: {s.labels["pid"]: s.value for s in f.samples if not s.name.endswith("_created")}
            for f in SchedulerCollector().collect()}


def test_work_clock_engine_exports_tokens_half_life_and_admitted_weight(monkeypatch, tmp_path):
    pid = str(os.getpid())
    got = families(monkeypatch, tmp_path, published(os.getpid(), half_life_tokens=3600.0, half_life_s=None))
    assert got["qwen_ext_sched_aging_half_life_tokens"] == {pid: 3600.0}
    assert got["qwen_ext_sched_aging_half_life_seconds"] == {}      # no engine ages in seconds
    assert got["qwen_ext_sched_admitted_weight"] == {pid: 1234.5}   # a counter (exposed as ..._total)
    assert got["qwen_ext_sched_load_factor"] == {pid: 1.2}


def test_each_engine_reports_its_own_clock(monkeypatch, tmp_path):
    mine, parent = os.getpid(), os.getppid()  # two live processes, as two engine cores would be
    got = families(monkeypatch, tmp_path, published(mine, half_life_tokens=2500.0, half_life_s=None),
                   published(parent, half_life_tokens=None, half_life_s=1.44))
    assert got["qwen_ext_sched_aging_half_life_tokens"] == {str(mine): 2500.0}
    assert got["qwen_ext_sched_aging_half_life_seconds"] == {str(parent): pytest.approx(1.44)}
    assert set(got["qwen_ext_sched_admitted"]) == {str(mine), str(parent)}


def test_slip_admissions_and_measured_costs_are_exported(monkeypatch, tmp_path):
    pid = str(os.getpid())
    got = families(monkeypatch, tmp_path, published(os.getpid(), slip_admissions=3, output_token_weight=92.5,
                                                    cost_steps_fitted=1200))
    assert got["qwen_ext_sched_slip_admissions"] == {pid: 3}           # a counter (exposed as ..._total)
    assert got["qwen_ext_sched_max_wait_admissions"] == {pid: 1}
    assert got["qwen_ext_sched_output_token_weight"] == {pid: 92.5}
    assert got["qwen_ext_sched_cost_steps_fitted"] == {pid: 1200}
    cold = families(monkeypatch, tmp_path, published(os.getpid(), output_token_weight=None, cost_steps_fitted=10))
    assert cold["qwen_ext_sched_output_token_weight"] == {}            # still weighing by tokens: no gauge
