"""Wiring of the gateway into a vLLM server (called by the endpoint plugin in each API-server process)."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

logger = logging.getLogger("qwen_vllm_ext.gateway")


def attach(app, settings, billing, ledger_store: Callable[[], object]):
    """Add the gateway middleware with its state (:class:`~.middleware.GatewayState`, filled by :func:`init_state`);
    ``billing``: the server's billing object (policy and prices); ``ledger_store``: returns the usage ledger's store
    (the spike breaker reads baselines from it; the ledger attaches after the gateway). Returns the state and the
    routers (the admin routes) for the integration layer to include. Raises when a configured store cannot be
    reached."""
    from ..observability import catalog
    from ..observability.stores import declare
    from ..store import locations
    from . import admin, metrics
    from ..keys import KeyCache, open_key_store
    from .limiter import open_limiter
    from .middleware import GatewayMiddleware, GatewayState
    from .spike import SpikeBreaker

    os.makedirs(settings.data_dir, exist_ok=True)
    key_store = open_key_store(settings=settings)
    where = locations.limiter(settings)
    limiter = open_limiter(where.backend, where.target)
    breaker = SpikeBreaker(settings, limiter, key_store, ledger_store, counter=catalog.counter("qwen_ext_keys_suspended"))
    state = GatewayState(spike_breaker=breaker)
    metrics.register(per_key=catalog.per_key_series(settings))
    declare("keys", "limiter")
    inline = limiter.nonblocking() if hasattr(limiter, "nonblocking") else None  # SQLite: admission inline
    app.add_middleware(GatewayMiddleware, settings=settings, keys=KeyCache(key_store), limiter=limiter,
                       policy=billing.policy, on_spike=breaker.observe_sync, inline_limiter=inline, state=state)
    logger.info("qwen-vllm-ext: gateway on (keys: %s, limiter: %s)", settings.ledger_backend, settings.limiter_backend)
    return state, [admin.router(key_store, settings.admin_key)]


def init_state(state, engine_client, served, settings, billing, args) -> None:
    """Fill the gateway's state with what admission needs to know about the served model (``served``: filled by
    ``counting.server.init_state`` first, for its calculator), the spike breaker's floor and the capacity backlog."""
    from . import vllm_requests
    from .admission import Served

    state.admission = Served(
        calculator=served.calculator,
        max_model_len=engine_client.model_config.max_model_len,
        names=served.names,
        engine_fields=vllm_requests.request_fields(),
        template_defaults=dict(getattr(args, "default_chat_template_kwargs", None) or {}),
        exclude_tools_when_tool_choice_none=bool(getattr(args, "exclude_tools_when_tool_choice_none", False)),
    )
    if state.spike_breaker is not None:  # the default floor: a few requests of the largest size this engine takes
        state.spike_breaker.served(state.admission.max_model_len, billing.policy)
    if settings.max_queue_wait_s > 0:
        from ..observability import catalog
        from .capacity import Backlog

        gauge = catalog.gauge("qwen_ext_expected_queue_wait_seconds")
        state.capacity = Backlog(settings.max_queue_wait_s, vllm_requests.queued_tokens(engine_client),
                                 on_wait=gauge.set)
