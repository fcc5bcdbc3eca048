"""The extension's ASGI middlewares in an API-server process, in one declared order.

``LAYERS`` lists them outermost first: a request passes the usage ledger (which records every request, the
gateway's rejections included), then the gateway (keys, limits, exact admission), then the KV-reuse middleware
(conversation ids, idle sleep; gateway rejections never wake the engine), then vLLM's own app.
"""
from __future__ import annotations

LAYERS = ("usage", "gateway", "kv")  # outermost first


def _enabled(settings, ledger: bool) -> dict[str, bool]:
    return {"usage": ledger, "gateway": bool(settings.gateway), "kv": True}


def attach(app, settings, ledger: bool) -> list[str]:
    """Add the enabled layers to ``app`` (``ledger``: the usage-accounting runtime patch is active in this process,
    without which there is no ledger). Returns the layers added, outermost first."""
    enabled = _enabled(settings, ledger)
    if enabled["gateway"] and not ledger:
        raise RuntimeError("qwen-vllm-ext: the gateway needs the usage ledger (settings ledger=true and a supported "
                           "vLLM): it reconciles every reservation with the engine's counts")
    from ..gateway import server as gateway_server
    from ..kv import server as kv_server
    from ..usage import server as usage_server

    attach_fns = {"usage": usage_server.attach, "gateway": gateway_server.attach, "kv": kv_server.attach}
    added = [name for name in LAYERS if enabled[name]]
    for name in reversed(added):  # Starlette runs the middleware added last first
        attach_fns[name](app, settings)
    return added
