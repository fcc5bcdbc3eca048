"""The usage ledger's Prometheus metrics, served on vLLM's ``/metrics`` (same default registry); names, types,
help and buckets come from :mod:`qwen_vllm_ext.observability.catalog`.

vLLM switches prometheus_client to multiprocess mode when it runs several API-server processes; counters
and histograms aggregate across processes there, and the queue-depth gauge uses the ``livesum`` mode.

:class:`LedgerCollector` (registered once per process by :func:`register_collector`) adds, at scrape time, the
writer's failure / spill / replay counts and the store's token totals for this server instance — next to vLLM's
own token counters that is the exact ledger drift, continuously (``usage reconcile`` is the one-off check).
"""
from __future__ import annotations

import functools
import glob
import logging
import os
import threading
import time

from ..observability import catalog
from .ledger.writer import DEAD_LETTER_GLOB, SPILL_GLOB
from ..observability.topk import WindowedTopK

logger = logging.getLogger("qwen_vllm_ext.usage")

TOTALS_EVERY_S = 5.0
"""The store's instance totals are re-read this often, on a background thread (a scrape never waits for the store:
vLLM serves /metrics on the event loop)."""

_top_tokens = WindowedTopK(catalog.TOP_KEYS, catalog.TOP_WINDOW_S)


@functools.lru_cache(maxsize=1)
def metrics():
    return {
        "billed": catalog.counter("qwen_ext_billed_units"),
        "records": catalog.counter("qwen_ext_ledger_records"),
        "tokens": catalog.counter("qwen_ext_ledger_tokens"),
        "queue": catalog.gauge("qwen_ext_ledger_queue_depth"),
        "write": catalog.histogram("qwen_ext_ledger_commit_wait_seconds"),
        "reuse": catalog.histogram("qwen_ext_kv_reuse_ratio"),
        "failed": catalog.counter("qwen_ext_ledger_write_failures"),
        "spilled": catalog.counter("qwen_ext_ledger_spilled_records"),
        "replayed": catalog.counter("qwen_ext_ledger_replayed_records"),
        "dead_lettered": catalog.counter("qwen_ext_ledger_dead_lettered_records"),
        "errors": catalog.counter("qwen_ext_ledger_writer_errors"),
        "writer_up": catalog.gauge("qwen_ext_ledger_writer_up"),
    }


def observe_writer(name: str, n: int) -> None:
    """``LedgerWriter(on_count=...)``: failed, spilled, replayed and dead-lettered records, the errors the writer
    survived (real counters: they aggregate across API-server processes)."""
    metrics()[name].inc(n)


def observe_writer_stop(_reason: str) -> None:
    """``LedgerWriter(on_stop=...)``: the writer thread ended (``qwen_ext_ledger_writer_up`` 0 at once; the collector
    keeps it current too)."""
    metrics()["writer_up"].set(0)


OTHER = "other"
"""The ``model`` label of a record whose model is not one of the served models."""


def model_label(model: str, served: tuple[str, ...]) -> str:
    """A bounded label: a served model's name, else ``other`` (never a client's string)."""
    return model if model in served else OTHER


def observe_record(record, queue_depth: int, served: tuple[str, ...] = ()) -> None:
    m = metrics()
    m["records"].labels(record.status).inc()
    m["billed"].labels(model_label(record.model, served)).inc(record.billed_total_micro / 1_000_000)
    m["tokens"].labels("prompt").inc(record.prompt_tokens)
    m["tokens"].labels("completion").inc(record.completion_tokens)
    m["queue"].set(queue_depth)
    if getattr(record, "reuse_ratio", None) is not None:
        m["reuse"].observe(record.reuse_ratio)
    _top_tokens.add(record.api_key_id, record.prompt_tokens + record.completion_tokens, time.time())


def spill_pending_records(spill_dir: str) -> int:
    """Records in the ledger's spill files in ``spill_dir`` (claimed ones included: a replay in progress)."""
    return ledger_files(spill_dir, SPILL_GLOB)[0]


def ledger_files(spill_dir: str, pattern: str) -> tuple[int, int]:
    """(lines, bytes) of the files matching ``pattern`` in ``spill_dir`` (spill or dead-letter files)."""
    n = size = 0
    for path in glob.glob(os.path.join(spill_dir, pattern)):
        try:
            with open(path, "rb") as f:
                for line in f:
                    size += len(line)
                    n += 1 if line.strip() else 0
        except OSError:
            continue
    return n, size


class LedgerCollector:
    """Scrape-time ledger figures: the records waiting in spill files and the store's totals for ``instance_id`` as
    last read by :meth:`refresh` (every ``TOTALS_EVERY_S`` on a daemon thread once :meth:`start` ed; the totals are
    missing while the store cannot answer), and the busiest keys of this process (with ``per_key`` false the family
    has no samples: :func:`catalog.per_key_series`)."""

    def __init__(self, writer, store, instance_id: str, per_key: bool = True) -> None:
        metrics()  # the writer's counters exist (at 0) from the start
        self.writer, self.store, self.instance_id = writer, store, instance_id
        self.per_key = per_key
        self.totals: dict[str, int] | None = None
        self.spill_pending = self.spill_bytes = self.dead_letter_records = self.dead_letter_bytes = 0
        self._stop = threading.Event()

    def refresh(self) -> None:
        metrics()["writer_up"].set(1 if self.writer.alive else 0)
        self.spill_pending, self.spill_bytes = ledger_files(self.writer.spill_dir, SPILL_GLOB)
        self.dead_letter_records, self.dead_letter_bytes = ledger_files(self.writer.spill_dir, DEAD_LETTER_GLOB)
        try:
            self.totals = self.store.instance_tokens(self.instance_id)
        except Exception as exc:  # noqa: BLE001 - the gauge goes missing; the next refresh tries again
            if self.totals is not None:
                logger.warning("qwen-vllm-ext: reading the ledger totals for /metrics failed: %s", exc)
            self.totals = None

    def start(self) -> None:
        def run():
            while not self._stop.is_set():
                try:
                    self.refresh()
                except Exception:  # noqa: BLE001 - e.g. too many open files: the figures are kept, tried again
                    logger.exception("qwen-vllm-ext: refreshing the ledger figures for /metrics failed")
                self._stop.wait(TOTALS_EVERY_S)

        threading.Thread(target=run, name="qwen-ext-ledger-totals", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def collect(self):
        family = catalog.family("qwen_ext_ledger_spill_pending_records")
        family.add_metric([], self.spill_pending)
        yield family
        totals = self.totals
        family = catalog.family("qwen_ext_ledger_instance_tokens")
        if totals is not None:
            family.add_metric(["engine_prompt"], totals["engine_prompt_tokens"])
            family.add_metric(["completion"], totals["completion_tokens"])
        yield family
        family = catalog.family("qwen_ext_top_key_tokens")
        if self.per_key:
            for key_id, tokens in _top_tokens.top(time.time()).items():
                family.add_metric([key_id], tokens)
        yield family


    def health(self) -> dict:
        """The ``ledger`` section of ``/qwen_ext/health``: the writer's state and the files in the data_dir (as of the
        latest refresh, at most ``TOTALS_EVERY_S`` old). ``ready`` is False while the writer is stopped or spilling
        (it spilled within ``SPILL_GROWING_S``: the store fails); reported only -- a spill grows by design while
        the store is out, and must not take a fleet's replicas out of service."""
        state = self.writer.status()
        reasons = []
        if not state["writer_alive"]:
            reasons.append(f"the ledger writer stopped ({state['stopped_reason']}): vLLM's /health answers 503")
        if state["spill_growing"]:
            reasons.append("records are being spilled: the ledger store is failing (they are replayed when it answers)")
        return {"ready": not reasons, "not_ready_reasons": reasons, **state,
                "spill_pending_records": self.spill_pending, "spill_pending_bytes": self.spill_bytes,
                "dead_letter_records": self.dead_letter_records, "dead_letter_bytes": self.dead_letter_bytes,
                "spill_dir": self.writer.spill_dir}


_collector: LedgerCollector | None = None


def register_collector(writer, store, instance_id: str, per_key: bool = True) -> LedgerCollector:
    """Register (once per process; a later call replaces the previous server's collector) and start it (``per_key``:
    :func:`catalog.per_key_series` of the server's settings)."""
    global _collector
    if _collector is not None:
        _collector.stop()
        catalog.unregister_collector(_collector)
    _collector = LedgerCollector(writer, store, instance_id, per_key=per_key)
    _collector.refresh()
    catalog.register_collector(_collector)
    _collector.start()
    return _collector
