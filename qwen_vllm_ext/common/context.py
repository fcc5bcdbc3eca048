"""The per-request context the capabilities of one API-server process share (pure Python, no vLLM import).

:class:`RequestContext` -- one per HTTP request (``scope["state"]["qwen_vllm_ext"]``): what the gateway decided
(API key, the model the engine serves, the parsed body) and the callbacks that want the request's usage record. It
replaces string-keyed attributes: a capability reads a field, never a name another module picked.

Per-server state has no shared home here: each capability builds its own in its ``attach`` and hands it to its
middleware and routes (``integration/app_state.py`` keeps references for the health route and the source-patch
hooks).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping
from typing import Any

STATE_KEY = "qwen_vllm_ext"


@dataclasses.dataclass
class RequestContext:
    api_key_id: str | None = None  # the gateway's authenticated key
    unauthenticated: bool = False  # the gateway refused the request for a missing or unknown API key (401)
    model: str | None = None  # the model the engine serves the request with (the default when none is named)
    body: dict | None = None  # the request body as the gateway parsed it (once; the ledger reads it from here)
    raw_body: bytes | None = None  # the bytes the gateway read (the ledger parses them when the gateway refused them)
    conversation_read: bool = False  # conversation_header below was read (kv.reuse.request_conversation_header)
    conversation_header: tuple[str, str] | None = None  # (name, value) of the conversation header, read once
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
