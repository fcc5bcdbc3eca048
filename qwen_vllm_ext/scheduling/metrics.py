"""The token-weighted scheduler's statistics on the API server's ``/metrics`` (and health route).

The scheduler lives in the engine-core process; it publishes ``qwen_status()`` once a second to the server's
instance directory (:mod:`qwen_vllm_ext.status`). This collector reads those files at scrape time.
"""
from __future__ import annotations

from .. import status


def scheduler_status() -> list[dict]:
    """Published status of every live engine core running the token-weighted scheduler."""
    return status.read_processes("scheduler-*.json")


class SchedulerCollector:
    """prometheus_client custom collector (register once per API-server process)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        statuses = scheduler_status()
        counters = {
            "admitted": ("qwen_ext_sched_admitted", "Requests admitted by the token-weighted scheduler"),
            "max_wait_admissions": ("qwen_ext_sched_max_wait_admissions",
                                    "Admissions through the arrival-order lane after waiting sched_max_wait_s"),
            "slip_admissions": ("qwen_ext_sched_slip_admissions",
                                "Admissions through the arrival-order lane at their FCFS slip deadline"),
            "cache_hit_tokens": ("qwen_ext_sched_cache_hit_tokens", "Prefix-cache hit tokens at admission"),
            "admitted_weight": ("qwen_ext_sched_admitted_weight",
                                "Token weight admitted from the waiting queue (the aging work clock)"),
        }
        gauges = {
            "admitted_weight_std_last": ("qwen_ext_sched_admitted_weight_std",
                                         "Standard deviation of admitted request weights in the last step"),
            "admitted_weight_std_mean": ("qwen_ext_sched_admitted_weight_std_mean",
                                         "Mean per-step standard deviation of admitted weights (recent steps)"),
            "queue_wait_p50_s": ("qwen_ext_sched_queue_wait_p50_seconds", "Queue wait p50 (recent admissions)"),
            "queue_wait_p99_s": ("qwen_ext_sched_queue_wait_p99_seconds", "Queue wait p99 (recent admissions)"),
            "load_factor": ("qwen_ext_sched_load_factor",
                            "Measured overload factor: weight arriving / weight admitted per second (>= 1)"),
            "half_life_tokens": ("qwen_ext_sched_aging_half_life_tokens",
                                 "Aging half-life in use on the work clock, tokens of admitted weight (load-scaled)"),
            "half_life_s": ("qwen_ext_sched_aging_half_life_seconds",
                            "Aging half-life in use on the seconds clock (load-scaled)"),
            "output_token_weight": ("qwen_ext_sched_output_token_weight",
                                    "Measured weight of one output token in prompt tokens (absent: token weight)"),
            "cost_steps_fitted": ("qwen_ext_sched_cost_steps_fitted",
                                  "Engine steps the online step-cost fit has seen"),
        }
        for family_cls, table in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
            for field, (name, doc) in table.items():
                family = family_cls(name, doc, labels=["pid"])
                for published in statuses:
                    value = published["stats"].get(field)
                    if value is not None:
                        family.add_metric([str(published["pid"])], value)
                yield family
