"""One API server's extension state, as the integration layer holds it: the settings, the served model's facts and
each capability's own state (built by its ``attach``, filled by its ``init_state``). Capabilities never look it up:
they get their own part handed in. Only the integration layer reads it (the health route's report, the idempotence of
the plugin and source-patch entry points), from ``app.state.qwen_vllm_ext``."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..common.context import STATE_KEY
from ..common.served import ServedModel

if TYPE_CHECKING:  # integration sits above every capability: these imports run one way
    from ..config import Settings
    from ..gateway.middleware import GatewayState
    from ..kv.server import KvState
    from ..provider.server import ListingState
    from ..usage.server import UsageState


@dataclasses.dataclass
class AppState:
    settings: Settings
    attached: bool = False  # the extension's routes and middlewares are on this app (plugin or source patch)
    initialized: bool = False  # init_state ran (plugin or source patch)
    served: ServedModel = dataclasses.field(default_factory=ServedModel)
    usage: UsageState | None = None  # the ledger is on
    gateway: GatewayState | None = None  # the gateway is on
    listing: ListingState | None = None  # openrouter is on
    kv: KvState | None = None


def find_app_state(app_or_state) -> AppState | None:
    """The state of this app (``app`` or ``app.state``), None when the extension did not attach to it."""
    state = getattr(app_or_state, "state", app_or_state)
    found = getattr(state, STATE_KEY, None)
    return found if isinstance(found, AppState) else None


def install_app_state(app_or_state, settings) -> AppState:
    """The app's state, created on first use (idempotent: the plugin and the source-patch hooks both call it)."""
    found = find_app_state(app_or_state)
    if found is None:
        found = AppState(settings=settings)
        setattr(getattr(app_or_state, "state", app_or_state), STATE_KEY, found)
    return found
