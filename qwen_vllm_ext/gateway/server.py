"""Wiring of the gateway into a vLLM server (called by the endpoint plugin in each API-server process)."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("qwen_vllm_ext.gateway")


def attach(app, settings) -> list:
    """Add the gateway middleware; returns its routers (the admin routes) for the integration layer to include.
    Raises when a configured store cannot be reached."""
    from qwen_v3_calculator.billing import get_policy

    from ..common.context import server_context
    from ..observability import catalog
    from ..observability.stores import declare
    from ..store import locations
    from . import admin, metrics
    from ..keys import KeyCache, open_key_store
    from .limiter import open_limiter
    from .middleware import GatewayMiddleware
    from .spike import SpikeBreaker

    os.makedirs(settings.data_dir, exist_ok=True)
    key_store = open_key_store(settings=settings)
    where = locations.limiter(settings)
    limiter = open_limiter(where.backend, where.target)
    breaker = SpikeBreaker(settings, limiter, key_store, lambda: server_context(app).ledger_store,
                           counter=catalog.counter("qwen_ext_keys_suspended"))
    server_context(app).spike_breaker = breaker
    metrics.register(per_key=catalog.per_key_series(settings))
    declare("keys", "limiter")
    inline = limiter.nonblocking() if hasattr(limiter, "nonblocking") else None  # SQLite: admission inline
    app.add_middleware(GatewayMiddleware, settings=settings, keys=KeyCache(key_store), limiter=limiter,
                       policy=get_policy(settings.billing_policy), on_spike=breaker.observe_sync, inline_limiter=inline)
    logger.info("qwen-vllm-ext: gateway on (keys: %s, limiter: %s)", settings.ledger_backend, settings.limiter_backend)
    return [admin.router(key_store, settings.admin_key)]


def init_state(engine_client, state, args) -> None:
    """Put what admission needs to know about the served model on the server context
    (after ``counting.init_state`` has built the calculator)."""
    from ..common.context import server_context
    from . import vllm_requests
    from .admission import Served

    ctx = server_context(state)
    names = getattr(args, "served_model_name", None) or [args.model]
    ctx.admission = Served(
        calculator=ctx.calculator,
        max_model_len=engine_client.model_config.max_model_len,
        names=tuple([names] if isinstance(names, str) else names),
        engine_fields=vllm_requests.request_fields(),
        template_defaults=dict(getattr(args, "default_chat_template_kwargs", None) or {}),
        exclude_tools_when_tool_choice_none=bool(getattr(args, "exclude_tools_when_tool_choice_none", False)),
    )
    if ctx.spike_breaker is not None:  # the default floor: a few requests of the largest size this engine takes
        from qwen_v3_calculator.billing import get_policy

        ctx.spike_breaker.served(ctx.admission.max_model_len, get_policy(ctx.settings.billing_policy))
    if ctx.settings.max_queue_wait_s > 0:
        from ..observability import catalog
        from .capacity import Backlog

        gauge = catalog.gauge("qwen_ext_expected_queue_wait_seconds")
        ctx.capacity = Backlog(ctx.settings.max_queue_wait_s, vllm_requests.queued_tokens(engine_client),
                               on_wait=gauge.set)
