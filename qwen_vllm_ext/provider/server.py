"""Wiring of the provider capability into a vLLM server (API-server process): the listing route and SSE keep-alives."""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from ..common.errors import error_body
from .listing import FORMATS, listing

if TYPE_CHECKING:
    from qwen_v3_calculator.billing import Prices

    from .listing import ModelFacts

logger = logging.getLogger("qwen_vllm_ext.provider")

MODELS_PATH = "/v1/models"


@dataclasses.dataclass
class ListingState:
    """This API server's listing: built by :func:`attach_listing`, filled by :func:`init_state` at start-up."""

    listing: list[ModelFacts] | None = None  # one per served model
    prices: Prices | None = None


class ListingMiddleware:
    """``GET /v1/models?format=openrouter`` (or ``openrouter-legacy``): the aggregator's listing of the served models.
    Without ``format`` the request goes to vLLM's own listing. Inside the gateway, which authenticates it and drops
    the models a scoped key may not use, exactly as for vLLM's listing."""

    def __init__(self, app, state: ListingState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") != MODELS_PATH:
            return await self.app(scope, receive, send)
        fmt = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("format", [""])[0]
        if not fmt:
            return await self.app(scope, receive, send)
        ctx = self.state
        if fmt not in FORMATS:
            status, body = 400, error_body(f"unknown listing format {fmt!r}; this server lists {', '.join(FORMATS)} "
                                           "(or leave format out for the OpenAI listing)", "invalid_value",
                                           "invalid_request_error", "format")
        elif ctx.listing is None:
            status, body = 503, error_body("the listing is not ready: the server is still starting", "not_ready",
                                           "server_error")
        else:
            status, body = 200, listing(ctx.listing, ctx.prices, fmt)
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})


def attach_listing(app, settings) -> ListingState:
    state = ListingState()
    app.add_middleware(ListingMiddleware, state=state)
    return state


def attach_keepalive(app, settings) -> None:
    from .keepalive import KeepAliveMiddleware
    from ..observability import catalog

    counter = catalog.counter("qwen_ext_sse_keepalives")
    app.add_middleware(KeepAliveMiddleware, interval_s=settings.sse_keepalive_s, on_comment=counter.inc)


def init_state(state: ListingState, engine_client, settings, billing, args) -> None:
    """Read the engine's facts for the listing into ``state``; raises ``ListingError`` (naming the setting) when the
    settings ask for a listing that would not describe this engine."""
    from .listing import ListingError
    from .vllm_facts import model_facts

    if billing.prices is None:
        raise ListingError("settings 'price_prompt' / 'price_completion': openrouter=true publishes prices and none is "
                           "set; set them (USD per million tokens; '0' for a free model)")
    state.prices = billing.prices
    state.listing = model_facts(engine_client, args, settings, billing.policy)
    logger.info("qwen-vllm-ext: OpenRouter listing on GET /v1/models?format=openrouter (%s)",
                ", ".join(m.id for m in state.listing))
