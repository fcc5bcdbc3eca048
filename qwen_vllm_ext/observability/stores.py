"""Health of the shared stores (API keys, rate limiter, usage ledger) as every caller sees it: one call per store
operation outcome feeds ``qwen_ext_store_up`` and ``qwen_ext_store_errors_total``."""
from __future__ import annotations

from . import catalog

STORES = ("keys", "limiter", "ledger")


def declare(*stores: str) -> None:
    """The stores this server uses: their error counters exist (at 0) from the start, so a rate() over them is 0, not
    absent."""
    for store in stores:
        if store not in STORES:
            raise ValueError(f"unknown store {store!r}")
        catalog.counter("qwen_ext_store_errors").labels(store)


def store_result(store: str, ok: bool) -> None:
    """Record the outcome of one call to ``store`` (one of :data:`STORES`)."""
    if store not in STORES:
        raise ValueError(f"unknown store {store!r}")
    catalog.gauge("qwen_ext_store_up").labels(store).set(1 if ok else 0)
    if not ok:
        catalog.counter("qwen_ext_store_errors").labels(store).inc()
