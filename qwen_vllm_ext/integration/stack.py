"""The extension's layers around vLLM's app, in one place: which are on, their order, and their start-up.

``LAYERS`` lists them outermost first: the error shape (every error response of every route, vLLM's included, in
one OpenAI shape with a string code: ``common/errors.py``), SSE keep-alives (with ``sse_keepalive_s``: outside everything, so no layer
sees the comments), the usage ledger (which records every request, the gateway's rejections included), the gateway
(keys, limits, exact admission, capacity 429s), the OpenRouter listing (with ``openrouter``: inside the gateway, which
authenticates it and applies key scopes), then the KV-reuse middleware (conversation ids, idle sleep; gateway
rejections never wake the engine), then vLLM's own app.

Each capability builds its own state in its ``attach`` and gets it handed back in its ``init_state``; the
:class:`~.app_state.AppState` only keeps the references (health route, idempotent entry points). ``STARTUP`` is the
order of the ``init_state`` calls once vLLM's engine client exists.
"""
from __future__ import annotations

LAYERS = ("errors", "keepalive", "usage", "gateway", "listing", "kv")  # outermost first
STARTUP = ("served", "gateway", "listing", "kv")
"""``init_state`` order: the served model first (its calculator: the gateway's admission counts with it)."""


def _enabled(settings, ledger: bool) -> dict[str, bool]:
    return {"errors": True, "keepalive": settings.sse_keepalive_s > 0, "usage": ledger, "gateway": bool(settings.gateway),
            "listing": bool(settings.openrouter), "kv": True}


def attach(app, state, ledger: bool) -> tuple[list[str], list]:
    """Add the enabled layers to ``app`` with their states (kept on ``state``, the app's
    :class:`~.app_state.AppState`; ``ledger``: the usage-accounting runtime patch is active in this process, without
    which there is no ledger). Returns the layers added, outermost first, and the routers they bring (the caller
    includes them: routes are registered in one place, ``plugin.EndpointPlugin.attach_router``)."""
    settings = state.settings
    enabled = _enabled(settings, ledger)
    if enabled["gateway"] and not ledger:
        raise RuntimeError("qwen-vllm-ext: the gateway needs the usage ledger (settings ledger=true and a supported "
                           "vLLM): it reconciles every reservation with the engine's counts")
    if settings.max_queue_wait_s > 0 and not enabled["gateway"]:
        raise RuntimeError("qwen-vllm-ext: max_queue_wait_s (capacity 429s) needs the gateway (gateway=true): the "
                           "queue is counted in the exact prompt tokens its admission counts")
    from ..gateway import server as gateway_server
    from ..kv import server as kv_server
    from ..provider import server as provider_server
    from ..usage import server as usage_server

    from ..common.errors import ErrorShapeMiddleware

    billing = settings.billing
    routers: list = []

    def gateway():
        # the ledger attaches after the gateway (it sits outside it): its store is looked up when the breaker needs it
        state.gateway, admin = gateway_server.attach(app, settings, billing,
                                                     ledger_store=lambda: state.usage.store if state.usage else None)
        routers.extend(admin)

    attach_fns = {"errors": lambda: app.add_middleware(ErrorShapeMiddleware),
                  "keepalive": lambda: provider_server.attach_keepalive(app, settings),
                  "usage": lambda: setattr(state, "usage", usage_server.attach(  # the KV layer is attached by now
                      app, settings, state.served, billing, reuse=state.kv.tracker if state.kv else None)),
                  "gateway": gateway,
                  "listing": lambda: setattr(state, "listing", provider_server.attach_listing(app, settings)),
                  "kv": lambda: setattr(state, "kv", kv_server.attach(app, settings))}
    added = [name for name in LAYERS if enabled[name]]
    for name in reversed(added):  # Starlette runs the middleware added last first
        attach_fns[name]()
    return added, routers


async def init_state(state, engine_client, args) -> None:
    """Fill every capability's state, in ``STARTUP`` order (``engine_client`` None: a test app without an engine,
    only the served model and the KV state)."""
    from ..counting import server as counting

    settings = state.settings
    for name in STARTUP:
        if name == "served":
            counting.init_state(state.served, args)
        elif name == "gateway" and engine_client is not None and state.gateway is not None:
            from ..gateway import server as gateway_server

            gateway_server.init_state(state.gateway, engine_client, state.served, settings, settings.billing, args)
        elif name == "listing" and engine_client is not None and state.listing is not None:
            from ..provider import server as provider_server

            provider_server.init_state(state.listing, engine_client, settings, settings.billing, args)
        elif name == "kv":
            from ..kv import server as kv_server

            if state.kv is None:  # init_state without attach (a source-patched vLLM's hooks run both; tests may not)
                state.kv = kv_server.KvState()
            await kv_server.init_state(state.kv, engine_client, settings, args)
