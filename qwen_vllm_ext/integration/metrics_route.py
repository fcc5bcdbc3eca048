"""``GET /metrics`` when vLLM runs several API-server processes (the only glue between the extension's metrics and
vLLM's metrics route).

With ``--api-server-count N > 1`` vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` and serves a fresh registry holding only
prometheus_client's ``MultiProcessCollector`` (``vllm/v1/metrics/prometheus.py``), so custom collectors registered
on the default registry would be missing. This route serves the same multiprocess registry plus the extension's
custom collectors (:func:`qwen_vllm_ext.observability.catalog.custom_collectors`); it replaces vLLM's own
``/metrics`` route through the endpoint-plugin contract ("plugin HTTP routes replace earlier operations with the same
path and method"). With one API-server process nothing changes: vLLM serves the default registry, which has them.
"""
from __future__ import annotations

import asyncio
import os

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _ExtensionCollectors:
    def collect(self):
        from ..observability import catalog

        for collector in catalog.custom_collectors():
            yield from collector.collect()


def wanted() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def add_metrics_route(router) -> None:
    from fastapi import Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(_ExtensionCollectors())

    @router.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)
