"""The token-weighted scheduler's statistics on the API server's ``/metrics`` (and health route).

The scheduler lives in the engine-core process; it publishes ``qwen_status()`` once a second to the server's
instance directory (:mod:`qwen_vllm_ext.observability.status`). This collector reads those files at scrape time.
"""
from __future__ import annotations

from ..observability import status
from ..observability import catalog


def scheduler_status() -> list[dict]:
    """Published status of every live engine core running the token-weighted scheduler."""
    return status.read_processes("scheduler-*.json")


COUNTERS = {"admitted": "qwen_ext_sched_admitted", "max_wait_admissions": "qwen_ext_sched_max_wait_admissions",
            "slip_admissions": "qwen_ext_sched_slip_admissions", "cache_hit_tokens": "qwen_ext_sched_cache_hit_tokens",
            "admitted_weight": "qwen_ext_sched_admitted_weight", "gate_switches": "qwen_ext_sched_gate_switches"}
GAUGES = {"admitted_weight_std_last": "qwen_ext_sched_admitted_weight_std",
          "admitted_weight_std_mean": "qwen_ext_sched_admitted_weight_std_mean",
          "queue_wait_p50_s": "qwen_ext_sched_queue_wait_p50_seconds",
          "queue_wait_p99_s": "qwen_ext_sched_queue_wait_p99_seconds",
          "load_factor": "qwen_ext_sched_load_factor",
          "half_life_tokens": "qwen_ext_sched_aging_half_life_tokens",
          "half_life_s": "qwen_ext_sched_aging_half_life_seconds",
          "output_token_weight": "qwen_ext_sched_output_token_weight",
          "cost_steps_fitted": "qwen_ext_sched_cost_steps_fitted",
          "overloaded": "qwen_ext_sched_overloaded", "backlog_steps": "qwen_ext_sched_backlog_steps"}
"""Published ``stats`` field -> metric (help text and labels in the catalog)."""


class SchedulerCollector(catalog.PublishedStatsCollector):
    """prometheus_client custom collector (register once per API-server process)."""

    def __init__(self):
        super().__init__(scheduler_status, {**COUNTERS, **GAUGES})
