"""The extension's ASGI middlewares in an API-server process, in one declared order.

``LAYERS`` lists them outermost first: the error shape (every error response of every route, vLLM's included, in
one OpenAI shape with a string code: ``common/errors.py``), SSE keep-alives (with ``sse_keepalive_s``: outside everything, so no layer
sees the comments), the usage ledger (which records every request, the gateway's rejections included), the gateway
(keys, limits, exact admission, capacity 429s), the OpenRouter listing (with ``openrouter``: inside the gateway, which
authenticates it and applies key scopes), then the KV-reuse middleware (conversation ids, idle sleep; gateway
rejections never wake the engine), then vLLM's own app.
"""
from __future__ import annotations

LAYERS = ("errors", "keepalive", "usage", "gateway", "listing", "kv")  # outermost first


def _enabled(settings, ledger: bool) -> dict[str, bool]:
    return {"errors": True, "keepalive": settings.sse_keepalive_s > 0, "usage": ledger, "gateway": bool(settings.gateway),
            "listing": bool(settings.openrouter), "kv": True}


def attach(app, settings, ledger: bool) -> tuple[list[str], list]:
    """Add the enabled layers to ``app`` (``ledger``: the usage-accounting runtime patch is active in this process,
    without which there is no ledger). Returns the layers added, outermost first, and the routers they bring (the
    caller includes them: routes are registered in one place, ``plugin.EndpointPlugin.attach_router``)."""
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

    attach_fns = {"errors": lambda app, settings: app.add_middleware(ErrorShapeMiddleware),
                  "keepalive": provider_server.attach_keepalive, "usage": usage_server.attach,
                  "gateway": gateway_server.attach, "listing": provider_server.attach_listing, "kv": kv_server.attach}
    added = [name for name in LAYERS if enabled[name]]
    routers = []
    for name in reversed(added):  # Starlette runs the middleware added last first
        routers += attach_fns[name](app, settings) or []
    return added, routers
