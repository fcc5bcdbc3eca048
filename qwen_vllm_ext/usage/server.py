"""Wiring of the usage capability into a vLLM server (called by the plugin entry points)."""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ledger import LedgerStore
    from .metrics import LedgerCollector

logger = logging.getLogger("qwen_vllm_ext.usage")


def instance_id() -> str:
    """One id per server (shared by its API-server processes): host + the server's instance directory."""
    from ..observability import status

    return f"{socket.gethostname()}-{os.path.basename(str(status.instance_dir()))}"


@dataclasses.dataclass
class UsageState:
    """This API server's ledger: its store (the gateway's spike breaker reads baselines from it) and its metrics
    collector (the health route's ``ledger`` section)."""

    store: LedgerStore | None = None
    collector: LedgerCollector | None = None

    def health(self) -> dict | None:
        return None if self.collector is None else self.collector.health()


def attach(app, settings, served, billing, reuse=None) -> UsageState | None:
    """Add the ledger middleware (API-server process); ``served``: the server's
    :class:`~qwen_vllm_ext.common.served.ServedModel` (the model labels of records and metrics), ``billing``: its
    billing object (policy and prices), ``reuse``: the KV state's reuse tracker (each record's reuse ratio). Raises
    when the configured store is unreachable. None with the ledger off."""
    if not settings.ledger:
        return None
    from ..store import locations
    from ..store.redis import safe_url
    from .access_log import AccessLog, StratifiedSampler
    from .ledger import LedgerWriter, open_store
    from ..observability import catalog
    from ..observability.stores import declare, store_result
    from .health import LedgerHealthGate
    from .metrics import metrics, observe_record, observe_writer, observe_writer_stop, register_collector
    from .middleware import UsageLedgerMiddleware

    os.makedirs(settings.data_dir, exist_ok=True)
    where = locations.ledger(settings)
    store = open_store(where.backend, where.target)
    writer = LedgerWriter(store, spill_dir=settings.data_dir, on_batch=lambda _s, _r: store_result("ledger", True),
                          on_failure=lambda _e: store_result("ledger", False), on_count=observe_writer,
                          on_stop=observe_writer_stop)
    writer.replay_spill()
    collector = register_collector(writer, store, instance_id(), per_key=catalog.per_key_series(settings))
    declare("ledger")
    # The writer closes itself at interpreter exit, bounded (ledger.writer.CLOSE_TIMEOUT_S): what the store has not
    # taken by then is spilled for the next start. No unbounded close here: SIGTERM must not hang on a stuck store.
    access_log = None
    if settings.access_log:
        from qwen_v3_calculator import default_calculator

        sampler = StratifiedSampler(slow_s=settings.access_log_slow_s, slow_rate=settings.access_log_slow_rate,
                                    rate=settings.access_log_rate)
        access_log = AccessLog(settings.access_log, sampler, default_calculator())
        atexit.register(access_log.close)

    def on_record(record, body):
        observe_record(record, writer.queue_depth(), served.names)
        if access_log is not None:
            access_log.log(record, body)

    app.add_middleware(UsageLedgerMiddleware, writer=writer, policy=billing.policy, prices=billing.prices,
                       served=served, reuse=reuse, keep_body=not settings.gateway,  # the gateway keeps it
                       instance_id=instance_id(), on_record=on_record,
                       unauthenticated_records_per_s=settings.unauthenticated_records_per_s,
                       on_commit=metrics()["write"].observe)
    app.add_middleware(LedgerHealthGate, writer=writer)  # vLLM's /health fails (503) while the writer is stopped
    logger.info("qwen-vllm-ext: usage ledger on %s (%s)", where.backend, safe_url(where.target))
    return UsageState(store=store, collector=collector)
