"""Typed contexts the capabilities of one API-server process share (pure Python, no vLLM import).

* :class:`ServerContext` -- one per API-server app: created by the integration layer when it attaches the
  extension (``app.state.qwen_vllm_ext``), filled by the capabilities at start-up (the served model's
  calculator and admission facts, the ledger store), read by the middlewares.
* :class:`RequestContext` -- one per HTTP request (``scope["state"]["qwen_vllm_ext"]``): what the gateway decided
  (API key, the model the engine serves) and the callbacks that want the request's usage record.

Both replace string-keyed attributes: a capability reads a field, never a name another module picked.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # names for the annotations only: nothing of the capabilities is imported at run time
    from qwen_v3_calculator import Calculator
    from qwen_v3_calculator.billing import Prices

    from ..config import Settings
    from ..gateway.admission import Served
    from ..gateway.capacity import Backlog
    from ..gateway.spike import SpikeBreaker
    from ..kv.server import KvState
    from ..provider.listing import ModelFacts
    from ..usage.ledger import LedgerStore

STATE_KEY = "qwen_vllm_ext"


@dataclasses.dataclass
class ServerContext:
    settings: Settings
    attached: bool = False  # the extension's routes and middlewares are on this app (plugin or source patch)
    initialized: bool = False  # init_state ran (plugin or source patch)
    calculator: Calculator | None = None  # for the served tokenizer and chat template
    served_model: str | None = None  # the first served model name (vLLM's default model)
    served_models: tuple[str, ...] = ()  # every served model name: the only model labels records and metrics carry
    admission: Served | None = None  # what the gateway's admission needs (gateway on)
    ledger_store: LedgerStore | None = None  # (ledger on): the spike breaker reads baselines from it
    listing: list[ModelFacts] | None = None  # one per served model (openrouter on)
    prices: Prices | None = None  # (openrouter on)
    capacity: Backlog | None = None  # capacity 429s (max_queue_wait_s > 0)
    spike_breaker: SpikeBreaker | None = None  # (gateway on): told the served context length at init_state
    kv: KvState | None = None  # the served template, the idle sleeper


def server_context(app_or_state) -> ServerContext:
    """The context of this app (``app`` or ``app.state``); raises when the extension did not attach to it."""
    state = getattr(app_or_state, "state", app_or_state)
    ctx = getattr(state, STATE_KEY, None)
    if not isinstance(ctx, ServerContext):
        raise LookupError("qwen-vllm-ext is not attached to this app (no app.state.qwen_vllm_ext)")
    return ctx


def find_server_context(app_or_state) -> ServerContext | None:
    state = getattr(app_or_state, "state", app_or_state)
    ctx = getattr(state, STATE_KEY, None)
    return ctx if isinstance(ctx, ServerContext) else None


def install_server_context(app_or_state, settings) -> ServerContext:
    """The app's context, created on first use (idempotent: the plugin and the source-patch hooks both call it)."""
    ctx = find_server_context(app_or_state)
    if ctx is None:
        ctx = ServerContext(settings=settings)
        setattr(getattr(app_or_state, "state", app_or_state), STATE_KEY, ctx)
    return ctx


@dataclasses.dataclass
class RequestContext:
    api_key_id: str | None = None  # the gateway's authenticated key
    unauthenticated: bool = False  # the gateway refused the request for a missing or unknown API key (401)
    model: str | None = None  # the model the engine serves the request with (the default when none is named)
    body: dict | None = None  # the request body as the gateway parsed it (once; the ledger reads it from here)
    on_usage: list[Callable[[Any], None]] = dataclasses.field(default_factory=list)  # called with the ledger record
    # called once when vLLM adds the request's first engine request (or when it ends without reaching the engine)
    on_engine_start: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def engine_started(self) -> None:
        callbacks, self.on_engine_start = self.on_engine_start, []
        for callback in callbacks:
            callback()


def request_context(scope: MutableMapping) -> RequestContext:
    """This request's context, created on first use."""
    state = scope.setdefault("state", {})
    ctx = state.get(STATE_KEY)
    if ctx is None:
        ctx = state[STATE_KEY] = RequestContext()
    return ctx


def find_request_context(scope: MutableMapping) -> RequestContext | None:
    return (scope.get("state") or {}).get(STATE_KEY)
