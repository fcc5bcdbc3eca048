"""Pure ASGI gate on vLLM's ``GET /health``: 503 while this process's usage-ledger writer is stopped.

vLLM's own ``/health`` (``vllm/entrypoints/serve/instrumentator/health.py``) asks the engine only. The router and
Kubernetes probe it, so a replica whose ledger writer thread has stopped -- it can no longer record what it serves
(:class:`~qwen_vllm_ext.usage.ledger.LedgerWriter` then spills every record synchronously) -- must fail it and be
restarted. A growing spill does *not* fail it: a spill grows by design during a ledger-store outage, which every
replica of a fleet sees at once; ``/qwen_ext/health``'s ``ledger`` section reports it (``ready: false``).
"""
from __future__ import annotations

import json

HEALTH_PATH = "/health"


class LedgerHealthGate:
    """Answers ``GET``/``HEAD /health`` with 503 (an OpenAI-shaped error) when ``writer.alive`` is False; everything
    else passes through untouched."""

    def __init__(self, app, writer):
        self.app, self.writer = app, writer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != HEALTH_PATH or self.writer.alive:
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {
            "message": f"the usage-ledger writer of this process stopped ({self.writer.stopped_reason}); its records "
                       f"are spilled to {self.writer.spill_dir} and replayed at the next start: restart the server",
            "type": "server_error", "code": "ledger_writer_stopped"}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else body})
