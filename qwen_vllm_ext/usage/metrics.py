"""The extension's own Prometheus metrics, served on vLLM's ``/metrics`` (same default registry).

vLLM switches prometheus_client to multiprocess mode when it runs several API-server processes; counters
and histograms aggregate across processes there, and the queue-depth gauge uses the ``livesum`` mode.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def metrics():
    from prometheus_client import Counter, Gauge, Histogram

    return {
        "billed": Counter("qwen_ext_billed_units", "Billed units recorded in the usage ledger", ["model"]),
        "records": Counter("qwen_ext_ledger_records", "Usage ledger records by status", ["status"]),
        "tokens": Counter("qwen_ext_ledger_tokens", "Tokens recorded in the usage ledger", ["kind"]),
        "queue": Gauge("qwen_ext_ledger_queue_depth", "Ledger records waiting to be committed",
                       multiprocess_mode="livesum"),
        "write": Histogram("qwen_ext_ledger_commit_wait_seconds",
                           "Time from a response's end to its ledger record being committed",
                           buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)),
        "reuse": Histogram("qwen_ext_kv_reuse_ratio",
                           "Per conversation turn: cached tokens / previous turn's prompt + completion tokens",
                           buckets=(0.1, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)),
    }


def observe_record(record, queue_depth: int) -> None:
    m = metrics()
    m["records"].labels(record.status).inc()
    m["billed"].labels(record.model).inc(record.billed_total_micro / 1_000_000)
    m["tokens"].labels("prompt").inc(record.prompt_tokens)
    m["tokens"].labels("completion").inc(record.completion_tokens)
    m["queue"].set(queue_depth)
    if getattr(record, "reuse_ratio", None) is not None:
        m["reuse"].observe(record.reuse_ratio)
