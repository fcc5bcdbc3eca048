"""The in-server gateway: pure ASGI middleware (Starlette's BaseHTTPMiddleware would break streaming).

Per request, before the engine sees it: authenticate the API key (``Authorization: Bearer qve-…`` or
``x-api-key``), check the body and the key's scope, count the prompt exactly, reserve 1 request and the
token cost against every RPM/TPM descriptor (key, global) atomically, reserve the estimated billed cost
against the key's daily and monthly budgets, take a concurrency slot; add the rate-limit headers to the
response (streams included: they go out with the first byte). After the response, the usage ledger calls
back with the engine's actual counts and the reservations are reconciled (the unused part refunded).

The ledger middleware sits outside this one, so rejections are recorded too (status ``error``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from qwen_v3_calculator.billing import to_micro

from ..common.context import request_context
from ..common.errors import error_body
from ..observability.stores import store_result
from . import metrics, vllm_requests
from .admission import (GENERATION_PATHS, UNMETERED_POST, Rejection, admit, admit_messages, check_model_scope,
                        duration, parse_body, refusal_reason, strip_hint)

if TYPE_CHECKING:
    from .admission import Served
    from .capacity import Backlog
    from .spike import SpikeBreaker

logger = logging.getLogger("qwen_vllm_ext.gateway")

PUBLIC_PATHS = {"/health", "/ping", "/version", "/metrics", "/qwen_ext/health", "/load"}
METRICS_PATH = "/metrics"  # public unless the metrics_key setting is set (then: check_metrics)
"""vLLM mounts its metrics app on ``^/metrics(?P<path>.*)$``: every path with this prefix is /metrics."""
ADMIN_PREFIX = "/qwen_ext/admin/"
SLOT_LEASE_S = 30.0
WINDOW_S = 60.0
DAY_S, MONTH_S = 86400.0, 31 * 86400.0
OVERHEAD_HEADER = b"x-qwen-gateway-overhead-ms"
PROMPT_TOKENS_HEADER = "x-qwen-prompt-tokens"  # the admission count of the prompt (== usage.prompt_tokens)
RESERVED_TOKENS_HEADER = "x-qwen-reserved-tokens"  # reserved against TPM: prompt + the most the engine may generate
MODELS_PATH = "/v1/models"
ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic-style routes: errors also carry "type": "error"
INLINE_BODY_BYTES = 256 << 10  # bodies up to this size are admitted on the event loop
UNAVAILABLE = object()  # the limiter store failed and limiter_failure=open: admit unmetered


def error_payload(code: str, message: str, type_: str = "invalid_request_error", param=None,
                  anthropic: bool = False) -> bytes:
    """OpenAI's error shape; for Anthropic-style routes also ``"type": "error"`` at the top, which Anthropic clients
    expect (``error.type`` / ``error.message`` are there in both shapes)."""
    body = error_body(message, code, type_, param)
    return json.dumps({"type": "error", **body} if anthropic else body).encode()


async def reject(send, rej: "Rejection", path: str, key_id: str | None = None) -> None:
    """Answer a request with the rejection's status, error body and headers (and count it: by code and status, and
    against the key when it was authenticated)."""
    metrics.rejected(rej.code, rej.status, key_id)
    await respond(send, rej.status, error_payload(rej.code, rej.message, rej.type, rej.param,
                                                  anthropic=path.startswith(ANTHROPIC_PREFIX)), rej.headers)


async def respond(send, status: int, body: bytes, headers: dict | None = None) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def bearer(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            text = value.decode("latin-1").strip()
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
        elif name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


def descriptors(key, settings, cost: int) -> list[tuple[str, int, float, int]]:
    """(descriptor, limit, window_s, cost) for every RPM/TPM limit that applies to this request."""
    items = []
    for name, limit, amount in (
        (f"key:{key.key_id}:rpm", key.rpm, 1), (f"key:{key.key_id}:tpm", key.tpm, cost),
        ("global:rpm", settings.global_rpm or None, 1), ("global:tpm", settings.global_tpm or None, cost),
    ):
        if limit:
            items.append((name, int(limit), WINDOW_S, amount))
    return items


def budget_items(key, cost_micro: int, now: float) -> list[tuple[str, int, float, int]]:
    day = time.strftime("%Y-%m-%d", time.gmtime(now))
    month = day[:7]
    items = []
    if key.daily_budget_micro:
        items.append((f"budget:{key.key_id}:day:{day}", key.daily_budget_micro, 2 * DAY_S, cost_micro))
    if key.monthly_budget_micro:
        items.append((f"budget:{key.key_id}:month:{month}", key.monthly_budget_micro, 2 * MONTH_S, cost_micro))
    return items


def rate_headers(decision, items) -> dict[str, str]:
    """x-ratelimit-* for the tightest request and token descriptors of this request."""
    headers = {}
    for kind, suffix in (("requests", ":rpm"), ("tokens", ":tpm")):
        names = [name for name, *_ in items if name.endswith(suffix)]
        if not names:
            continue
        state = decision.descriptors
        tightest = min(names, key=lambda n: state[n].remaining)
        headers[f"x-ratelimit-limit-{kind}"] = str(state[tightest].limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(state[tightest].remaining)
        headers[f"x-ratelimit-reset-{kind}"] = duration(state[tightest].reset_s)
    return headers


@dataclasses.dataclass
class Held:
    """What one admitted request holds until it is settled: its limiter reservation, budget reservation and
    concurrency slot (None when not taken), the descriptors charged and the rate-limit headers to send."""

    key: Any
    items: list
    cost: int
    reservation: str | None = None
    budget: str | None = None
    slot: str | None = None
    slot_name: str | None = None
    headers: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GatewayState:
    """This API server's gateway state: built by ``gateway.server.attach`` and handed to the middleware, filled by
    ``gateway.server.init_state`` at start-up."""

    admission: Served | None = None  # what admission needs to know about the served model
    capacity: Backlog | None = None  # capacity 429s (max_queue_wait_s > 0)
    spike_breaker: SpikeBreaker | None = None  # told the served context length at init_state


class GatewayMiddleware:
    def __init__(self, app, settings, keys, limiter, policy, on_spike=None, inline_limiter=None,
                 state: GatewayState | None = None):
        self.app = app
        self.state = state if state is not None else GatewayState()
        # admission calls go to inline_limiter first (SqliteLimiter.nonblocking(): microseconds on the event loop,
        # cheaper than a thread hop under load); when it is busy, or without one, to limiter on a worker thread
        self.inline_limiter = inline_limiter
        self.settings = settings
        self.keys = keys  # KeyCache
        self.limiter = limiter
        self.policy = policy
        self.on_spike = on_spike  # SpikeBreaker.observe_sync(key, record) (run on a worker thread) or None

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "websocket":  # (a realtime route): the same keys as HTTP, refused before the handshake
            return await self._websocket(scope, receive, send)
        if path.startswith(METRICS_PATH) and scope["type"] == "http" and self.settings.metrics_key:
            if not check_metrics(scope, self.settings):  # per-key series: only with the scrape credential
                return await reject(send, metrics_rejection(), path)
            return await self.app(scope, receive, send)
        if scope["type"] != "http" or path in PUBLIC_PATHS or path.startswith(ADMIN_PREFIX):
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        try:
            key = await self._authenticate(scope)
        except Rejection as rej:  # (its headers: Retry-After when the key store is unavailable)
            request_context(scope).unauthenticated = rej.status == 401  # its record keeps no client-chosen id
            return await reject(send, rej, path)
        request = request_context(scope)
        request.api_key_id = key.key_id
        served = self.state.admission  # the served model's calculator, context, names
        kind = GENERATION_PATHS.get(path)
        if kind is not None and scope.get("method") != "POST":
            return await self.app(scope, receive, send)  # authenticated; the route answers 405, nothing runs
        if kind is None:
            if scope.get("method") == "GET" and path == MODELS_PATH and key.models:
                return await self.app(scope, receive, _models_filter(send, key))
            if scope.get("method") != "POST":
                return await self.app(scope, receive, send)  # authenticated; nothing to meter
            if path not in UNMETERED_POST and not path.endswith("/render"):
                return await reject(send, Rejection(
                    403, "endpoint_not_allowed", f"{path} is not available through the gateway: it meters "
                    f"{', '.join(GENERATION_PATHS)}; {refusal_reason(path)}", type_="permission_error"), path,
                    key.key_id)
            try:  # generates nothing, but names a model: the key's scope still applies
                raw = await self._read_body(receive)
                check_model_scope(parse_body(raw), key, served)
            except Rejection as rej:
                return await reject(send, rej, path, key.key_id)
            return await self.app(scope, _replay(raw, receive), send)
        capacity = self.state.capacity  # max_queue_wait_s > 0: refuse what would wait too long, before any work
        if capacity is not None:
            verdict = capacity.verdict()
            if verdict is not None:
                retry, wait = verdict
                return await reject(send, Rejection(
                    429, "capacity_exceeded", f"the server is at capacity: a request now would wait about {wait:.1f} s "
                    f"in the engine's queue (this server's bound: {capacity.max_wait_s:g} s); retry after {retry} s or "
                    "send it elsewhere", type_="requests", headers={"retry-after": str(retry)}), path, key.key_id)
        try:
            raw = request.raw_body = await self._read_body(receive)  # the ledger's copy too: no other is kept
            inline = len(raw) <= INLINE_BODY_BYTES  # microseconds: a thread hop would cost more under load
            # exact counting of up to max_body_bytes (~1 s for 8 MB) runs off the event loop
            parsed = parse_body(raw) if inline else await asyncio.to_thread(parse_body, raw)
            request.body = parsed  # parsed once: the ledger reads the model and the conversation id from here
            bounds = dict(over_cap=self.settings.max_tokens_over_cap, max_n=self.settings.max_n,
                          max_sequences=self.settings.max_sequences_per_request)
            if kind == "messages":  # counted as the chat request vLLM converts it to
                chat_body = await vllm_requests.to_chat_body(parsed, scope["app"].state)
                run = lambda: admit_messages(parsed, chat_body, key, served, **bounds)  # noqa: E731
            else:
                run = lambda: admit(parsed, kind, key, served, **bounds)  # noqa: E731
            admission = run() if inline else await asyncio.to_thread(run)
            if kind != "messages":  # (a /v1/messages body was validated by vLLM's converter)
                check = lambda: vllm_requests.check_request(admission.body, kind)  # noqa: E731
                check() if inline else await asyncio.to_thread(check)
            if strip_hint(admission.body, self.settings.scheduler.output_hint_key):
                admission.body_changed = True
            held = await self._reserve(key, admission)
        except Rejection as rej:
            return await reject(send, rej, path, key.key_id)
        request.model = admission.model  # the ledger records the model the engine serves
        body = admission.encoded() if admission.body_changed else raw
        overhead_s = time.perf_counter() - started
        metrics.admitted(overhead_s)
        extra = {**held.headers, PROMPT_TOKENS_HEADER: str(admission.prompt_tokens),
                 RESERVED_TOKENS_HEADER: str(admission.cost), OVERHEAD_HEADER.decode(): f"{overhead_s * 1000:.3f}"}
        request.on_usage.append(lambda record: self._reconcile(held, record))
        if capacity is not None:
            request.on_engine_start.append(capacity.admitted(admission.prompt_tokens))
            request.on_usage.append(lambda record: capacity.finished(record.engine_prompt_tokens))
        renew = asyncio.get_running_loop().create_task(self._renew_slot(held)) if held.slot else None

        replay_receive = _replay(body, receive)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), *((k.encode(), v.encode()) for k, v in extra.items())]
                message = dict(message, headers=headers)
            await send(message)

        if admission.body_changed:
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
        try:
            await self.app(scope, replay_receive, send_with_headers)
        finally:
            if renew is not None:
                renew.cancel()
            if held.slot:
                try:
                    await asyncio.to_thread(self.limiter.release_slot, held.slot_name, held.slot)
                except Exception:  # never mask the request's own outcome; the lease expires by itself
                    logger.exception("qwen-vllm-ext gateway: releasing a concurrency slot failed")

    async def _websocket(self, scope, receive, send):
        """A websocket connection needs a valid API key like any HTTP request: without one the handshake is refused
        (close code 1008, policy violation; the server answers the upgrade with 403) and the app never sees it."""
        try:
            key = await self._authenticate(scope)
        except Rejection as rej:
            metrics.rejected(rej.code, rej.status, None)
            message = await receive()  # websocket.connect
            if message["type"] == "websocket.connect":
                await send({"type": "websocket.close", "code": 1008, "reason": rej.code})
            return
        request_context(scope).api_key_id = key.key_id
        return await self.app(scope, receive, send)

    # ---- steps ----------------------------------------------------------------------------------
    async def _authenticate(self, scope):
        secret = bearer(scope)
        if not secret:
            raise Rejection(401, "invalid_api_key", "no API key: send 'Authorization: Bearer qve-…' (create keys "
                            "with `python -m qwen_vllm_ext.keys create`)", type_="authentication_error")
        from ..keys import KeyStoreUnavailable

        transient = (KeyStoreUnavailable, sqlite3.Error, *getattr(self.keys.store, "transient_errors", (OSError,)))
        try:
            # A cache hit is an HMAC and a dict lookup; at most every 0.5 s it also reads the store's version
            # counter (one indexed read): cheaper inline than a thread hop under load.
            key = self.keys.authenticate(secret)
        except transient as exc:  # keys cannot be checked: never admit unauthenticated traffic
            store_result("keys", False)
            logger.error("qwen-vllm-ext gateway: key store unavailable: %s", exc)
            raise Rejection(503, "service_unavailable", "API keys cannot be checked right now; retry shortly",
                            type_="server_error", headers={"retry-after": "1"}) from None
        store_result("keys", True)
        if key is None:
            raise Rejection(401, "invalid_api_key", "the API key is not valid: check it was copied whole; keys "
                            "are shown only once at creation", type_="authentication_error")
        now = time.time()
        ok, reason = key.active(now)
        if not ok:
            if reason == "suspended":
                lifts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(key.suspended_until))
                wait = max(1, math.ceil(key.suspended_until - now))
                raise Rejection(403, "api_key_suspended", f"this API key is suspended until {lifts} (in {wait} s): "
                                f"{key.suspend_reason or 'suspended by an operator'}; an operator can lift it earlier",
                                type_="permission_error", headers={"retry-after": str(wait)})
            messages = {
                "revoked": ("invalid_api_key", "this API key was revoked; ask for a new one"),
                "expired": ("api_key_expired", "this API key has expired; ask for a new one or an extension"),
            }
            code, message = messages.get(reason, ("invalid_api_key", "this API key cannot be used"))
            raise Rejection(401, code, message, type_="authentication_error")
        return key

    async def _read_body(self, receive) -> bytes:
        chunks, size, limit = [], 0, self.settings.max_body_bytes
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Rejection(400, "client_disconnected", "the client went away while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise Rejection(413, "request_too_large", f"the request body is larger than {limit} bytes; send a "
                                "shorter prompt or raise the server's max_body_bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _limiter_call(self, name, *args):
        from .limiter import LimiterBusy, LimiterUnavailable

        try:
            result = UNAVAILABLE
            if self.inline_limiter is not None:
                try:
                    result = getattr(self.inline_limiter, name)(*args)
                except LimiterBusy:
                    pass  # another connection holds the store's write lock: wait for it on a worker thread
            if result is UNAVAILABLE:
                result = await asyncio.to_thread(getattr(self.limiter, name), *args)
            store_result("limiter", True)
            return result
        except LimiterUnavailable:
            store_result("limiter", False)
            if self.settings.limiter_failure == "open":
                logger.error("qwen-vllm-ext gateway: limiter store unavailable; admitting (limiter_failure=open)")
                return UNAVAILABLE
            raise Rejection(503, "service_unavailable", "the rate limiter's store is unavailable; retry shortly",
                            type_="server_error", headers={"retry-after": "1"})

    async def _reserve(self, key, admission) -> Held:
        """Take every reservation the request needs, all or nothing (what was taken is released on failure)."""
        items = descriptors(key, self.settings, admission.cost)
        held = Held(key, items, admission.cost)
        try:
            if items:
                decision = await self._limiter_call("reserve", items)
                if decision is not UNAVAILABLE:
                    headers = rate_headers(decision, items)
                    if not decision.allowed:
                        raise self._denied(decision, items, headers, admission.cost)
                    held.reservation, held.headers = decision.reservation_id, headers
            estimate = self.policy.bill(admission.prompt_tokens, admission.completion_tokens)
            budgets = budget_items(key, to_micro(estimate["total_units"]), time.time())
            if budgets:
                decision = await self._limiter_call("reserve_quota", budgets)
                if decision is not UNAVAILABLE:
                    if not decision.allowed:
                        period = "day" if any(":day:" in n for n in decision.blocking) else "month"
                        raise Rejection(429, "insufficient_quota", f"this API key's budget is used up for the {period};"
                                        " retrying will not help until it resets or an operator raises it",
                                        type_="insufficient_quota")
                    held.budget = decision.reservation_id
            if key.max_concurrent:
                name = f"slots:{key.key_id}"
                slot = await self._limiter_call("acquire_slot", name, key.max_concurrent, SLOT_LEASE_S)
                if slot is None:
                    raise Rejection(429, "rate_limit_exceeded", f"this API key allows {key.max_concurrent} "
                                    "concurrent requests; wait for one to finish", type_="requests",
                                    headers={**held.headers, "retry-after": "1"})
                if slot is not UNAVAILABLE:
                    held.slot, held.slot_name = slot, name
        except Rejection:
            await self._release(held)
            raise
        return held

    def _denied(self, decision, items, headers, cost) -> Rejection:
        names = ", ".join(decision.blocking)
        if decision.too_large:
            limit = min(limit for name, limit, _, amount in items if amount == cost and name.endswith(":tpm"))
            return Rejection(429, "rate_limit_exceeded", f"this request needs {cost} tokens (prompt + max_tokens) "
                             f"but the limit is {limit} tokens per minute: it can never fit; lower max_tokens or "
                             "shorten the prompt", type_="tokens", headers=headers)
        retry = max(1, math.ceil(decision.retry_after_s))
        kind = "tokens" if all(n.endswith(":tpm") for n in decision.blocking) else "requests"
        return Rejection(429, "rate_limit_exceeded", f"rate limit reached ({names}); retry after {retry} s",
                         type_=kind, headers={**headers, "retry-after": str(retry)})

    async def _release(self, held) -> None:
        """Give back whatever an admission that failed had taken (errors here must not mask the rejection)."""
        for fn, arg in ((self.limiter.release, held.reservation), (self.limiter.release_quota, held.budget)):
            if arg:
                try:
                    await asyncio.to_thread(fn, arg)
                except Exception:  # the store is failing: the reservation expires with its window
                    logger.exception("qwen-vllm-ext gateway: releasing a reservation failed")

    async def _renew_slot(self, held) -> None:
        while True:
            await asyncio.sleep(SLOT_LEASE_S / 3)
            await self._limiter_call("renew_slot", held.slot_name, held.slot, SLOT_LEASE_S)

    def _reconcile(self, held, record) -> None:
        """Ledger callback (event loop): hand the request's settlement to one worker-thread job."""
        actual = record.usage_tokens  # the rule for n > 1: what usage says, the prompt counted once
        adjust = {name: (amount if name.endswith(":rpm") else actual) for name, _, _, amount in held.items}
        if held.reservation or held.budget or self.on_spike is not None:
            asyncio.get_running_loop().run_in_executor(None, self._settle, held, adjust, record)

    def _settle(self, held, adjust, record) -> None:
        """Worker thread: refund what the engine did not use, charge budgets their actual cost, run the spike
        check -- one thread hop per request for all three (each failure is logged; the others still run)."""
        steps = []
        if held.reservation:
            steps.append((self.limiter.adjust, held.reservation, adjust))
        if held.budget:
            steps.append((self.limiter.adjust_quota, held.budget, record.billed_total_micro))
        if self.on_spike is not None:
            steps.append((self.on_spike, held.key, record))
        for fn, *args in steps:
            try:
                fn(*args)
            except Exception:  # the store is failing: reservations expire with their windows
                logger.exception("qwen-vllm-ext gateway: settling a request failed (%s)", getattr(fn, "__name__", fn))


def _replay(body: bytes, receive):
    """An ASGI receive that hands the app the body the gateway already read, then the client's messages."""
    replayed = False

    async def replay_receive():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


def _models_filter(send, key):
    """Send wrapper for ``GET /v1/models``: a scoped key sees only the models it may use."""
    start: dict = {}
    chunks: list[bytes] = []

    async def filtered(message):
        if message["type"] == "http.response.start":
            start.update(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        raw = b"".join(chunks)
        try:
            listing = json.loads(raw)
            listing["data"] = [m for m in listing.get("data", []) if key.allows_model(str(m.get("id")))]
            raw = json.dumps(listing).encode()
        except (ValueError, AttributeError, TypeError):
            pass  # not the listing vLLM sends (an error body): pass it on unchanged
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})

    return filtered


def check_admin(scope, admin_key: str) -> bool:
    """Constant-time check of the admin bearer token."""
    token = bearer(scope)
    return bool(admin_key) and token is not None and hmac.compare_digest(token.encode(), admin_key.encode())


def check_metrics(scope, settings) -> bool:
    """May this request read ``/metrics``? Anyone while the ``metrics_key`` setting is empty (the per-key series are
    then left out: ``gateway.metrics.per_key_series``); else only ``Authorization: Bearer <metrics_key>`` or the admin
    key (constant-time comparisons; ``usage reconcile`` and the doctor send the admin key)."""
    if not settings.metrics_key:
        return True
    token = bearer(scope)
    if token is None:
        return False
    return hmac.compare_digest(token.encode(), settings.metrics_key.encode()) or check_admin(scope, settings.admin_key)


def metrics_rejection() -> Rejection:
    return Rejection(401, "invalid_metrics_key", "/metrics needs 'Authorization: Bearer <metrics_key>' (the metrics_key "
                     "setting; it carries per-API-key series). Prometheus: set authorization: {type: Bearer, "
                     "credentials_file: /etc/prometheus/qwen-metrics-key} in the scrape config (docs/operating.md)",
                     type_="authentication_error")
