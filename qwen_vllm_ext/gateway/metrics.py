"""The gateway's Prometheus metrics (names, help, labels from :mod:`qwen_vllm_ext.observability.catalog`):
admissions, rejections by OpenAI error code and HTTP status, the gateway's own overhead per admitted request, and
the most-rejected keys over a sliding window (a bounded label set: the top keys plus ``other``)."""
from __future__ import annotations

import time

from ..observability import catalog
from ..observability.topk import WindowedTopK

_top_rejections = WindowedTopK(catalog.TOP_KEYS, catalog.TOP_WINDOW_S)
ALERTED = (("rate_limit_exceeded", 429), ("insufficient_quota", 429), ("service_unavailable", 503))
"""Rejection series created at 0 on start: the alerts take increase()/rate() of them, which cannot see the first
request of a series that appears with it."""


def admitted(overhead_s: float) -> None:
    catalog.counter("qwen_ext_gateway_admissions").inc()
    catalog.histogram("qwen_ext_gateway_overhead_seconds").observe(overhead_s)


def rejected(code: str, http_status: int, key_id: str | None) -> None:
    catalog.counter("qwen_ext_gateway_rejections").labels(code, str(http_status)).inc()
    if key_id is not None:
        _top_rejections.add(key_id, 1, time.time())


class TopKeyRejections:
    """Custom collector: ``qwen_ext_top_key_rejections`` (register once per process: :func:`register`); with
    ``per_key`` false the family has no samples (:func:`catalog.per_key_series`)."""

    def __init__(self, per_key: bool = True):
        self.per_key = per_key

    def collect(self):
        family = catalog.family("qwen_ext_top_key_rejections")
        if self.per_key:
            for key_id, n in _top_rejections.top(time.time()).items():
                family.add_metric([key_id], n)
        yield family


_registered: TopKeyRejections | None = None


def register(per_key: bool = True) -> None:
    """Create the gateway's families now (so they show at 0 before the first request) and register the collector
    (``per_key``: :func:`catalog.per_key_series` of the server's settings; a later call updates it)."""
    global _registered
    if _registered is not None:
        _registered.per_key = per_key
        return
    catalog.counter("qwen_ext_gateway_admissions")
    rejections = catalog.counter("qwen_ext_gateway_rejections")
    for code, status in ALERTED:
        rejections.labels(code, str(status))
    catalog.histogram("qwen_ext_gateway_overhead_seconds")
    _registered = TopKeyRejections(per_key)
    catalog.register_collector(_registered)
