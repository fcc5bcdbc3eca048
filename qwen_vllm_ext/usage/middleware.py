"""Pure ASGI middleware: one durable ledger record per API request, committed before the response completes.

For each POST to a tracked endpoint it:

* honours an incoming ``X-Request-ID`` (or generates one), passes it to vLLM (which names the request after
  it) and returns it as a response header;
* watches the connection: an ``http.disconnect`` or a failed send means the client went away;
* before the last body message goes out (the one that ends the response, or the one carrying the SSE
  ``data: [DONE]``), waits until every engine request of this HTTP request has settled, builds the record
  from vLLM's own counts (:mod:`.accounting`) and waits until the ledger writer has committed it durably.
  So a response a client saw complete always has its record, even if the server is killed right after;
* when the request ends any other way (client gone, error, cancellation), records it all the same.

Starlette's ``BaseHTTPMiddleware`` would break streaming; this is plain ASGI.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid

from qwen_v3_calculator.billing import to_micro

from ..common.client_strings import MAX_MODEL_CHARS, storable
from ..common.context import find_request_context, request_context
from ..kv.reuse import conversation_id, request_conversation_header
from .accounting import BOOK, CURRENT_HTTP_REQUEST, RequestTotals
from .ledger import LedgerRecord, LedgerWriteError, billed_prompt_tokens

logger = logging.getLogger("qwen_vllm_ext.usage")

TRACKED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
_VALID_ID = re.compile(r"^[A-Za-z0-9._:~-]{1,128}$")
SETTLE_TIMEOUT_S = 5.0
MAX_BODY_KEPT = 16 << 20  # request bytes kept for the record's model name and the access log
COMMIT_TIMEOUT_S = 30.0


@dataclasses.dataclass
class Exchange:
    """One HTTP exchange as the ledger middleware follows it."""

    key: str  # this request's key in the account book (accounting.BOOK)
    received_at: float
    http_status: int = 0
    disconnected: bool = False
    recorded: bool = False
    streamed: bool = False
    body: bytearray = dataclasses.field(default_factory=bytearray)  # the request body (up to MAX_BODY_KEPT)


def _status(totals: RequestTotals, http_status: int, disconnected: bool) -> str:
    if totals.finish in ("stop", "length"):
        return totals.finish
    if totals.finish == "abort" or (totals.finish is None and disconnected):
        return "client_disconnected" if disconnected else "aborted"
    return "error" if totals.finish == "error" or http_status >= 400 or totals.finish is None else "aborted"


class UsageLedgerMiddleware:
    def __init__(self, app, writer, policy, instance_id: str, on_record=None, on_commit=None, prices=None,
                 unauthenticated_records_per_s: float = 1.0, served=None, reuse=None, keep_body: bool = True):
        self.app = app
        self.reuse = reuse  # the KV state's ReuseTracker: each conversation's reuse ratio (None: not recorded)
        # keep the request's bytes for the record (model, user) and the access log; False when the gateway parses
        # every body it lets through onto the request context (the record reads it from there)
        self.keep_body = keep_body
        self.served = served  # the server's ServedModel: its names are the only model labels a record carries
        # requests refused for their API key are counted by the gateway's rejection metric; only this many a second
        # are recorded (an unauthenticated flood must not grow the ledger without bound)
        self.unauthenticated = PerSecondCap(unauthenticated_records_per_s)
        self.writer = writer
        self.policy = policy
        self.prices = prices  # qwen_v3_calculator.billing.Prices or None: the record's cost_pico_usd
        self.instance_id = instance_id
        self.on_record = on_record  # callback(record, request body) for metrics and the access log
        self.on_commit = on_commit  # callback(seconds waited for the durable commit)
        self._in_flight: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in TRACKED_PATHS:
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})  # shared with the app and inner middleware (API key id, callbacks)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"x-request-id"]
        incoming = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), None)
        request_id = incoming if incoming and _VALID_ID.match(incoming) else uuid.uuid4().hex
        # Two concurrent requests reusing one id would share vLLM's request name; keep them apart.
        engine_id = request_id
        if request_id in self._in_flight:
            engine_id = f"{request_id}~{uuid.uuid4().hex[:8]}"
        self._in_flight[engine_id] = 1
        headers.append((b"x-request-id", engine_id.encode()))
        scope = dict(scope, headers=headers)
        state = Exchange(key=uuid.uuid4().hex, received_at=time.time())

        async def wrapped_receive():
            message = await receive()
            if message["type"] == "http.disconnect":
                state.disconnected = True
            elif message["type"] == "http.request" and self.keep_body and len(state.body) < MAX_BODY_KEPT:
                state.body += message.get("body", b"")
            return message

        async def wrapped_send(message):
            if message["type"] == "http.response.start":
                state.http_status = message["status"]
                for k, v in message.get("headers", []):
                    if k.lower() == b"content-type" and v.startswith(b"text/event-stream"):
                        state.streamed = True
                message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", engine_id.encode())])
            elif message["type"] == "http.response.body" and not state.recorded:
                # vLLM sends the SSE terminator as a chunk of its own; model text may contain the same words
                final = not message.get("more_body", False) or message.get("body", b"").strip() == b"data: [DONE]"
                if final and state.http_status < 400:
                    await self._record(scope, engine_id, state)
            try:
                await send(message)
            except OSError:
                state.disconnected = True
                raise

        token = CURRENT_HTTP_REQUEST.set(state.key)  # inherited by every task vLLM starts for this request
        request = request_context(scope)
        BOOK.on_open(state.key, request.engine_started)  # the gateway's capacity backlog listens (context.py)
        try:
            await self.app(scope, wrapped_receive, wrapped_send)
        except BaseException:
            if not state.recorded:
                state.http_status = state.http_status or 500
            raise
        finally:
            CURRENT_HTTP_REQUEST.reset(token)
            if BOOK.forget_open(state.key) is not None:
                request.engine_started()  # never reached the engine: nothing of it is queued any more
            self._in_flight.pop(engine_id, None)
            if not state.recorded:
                # The request ended without a normal final message (client gone, error, cancellation): record
                # it in the background; nothing is waiting for an acknowledgement any more.
                task = asyncio.get_running_loop().create_task(self._record(scope, engine_id, state))
                task.add_done_callback(_log_failure)

    async def _record(self, scope, engine_id: str, state: Exchange) -> None:
        """Build the record from the engine's counts and wait until it is durably committed."""
        state.recorded = True
        await BOOK.wait_settled(state.key, SETTLE_TIMEOUT_S)
        totals = RequestTotals.from_parts(BOOK.collect(state.key))
        BOOK.expire()  # counts of requests whose recording failed must not pile up
        request = find_request_context(scope)
        if request is not None and request.unauthenticated and not self.unauthenticated.allow():
            return  # over unauthenticated_records_per_s: counted by qwen_ext_gateway_rejections_total only
        body = request.body if request is not None and request.body is not None else None
        if body is None:  # the gateway parses the body once onto the request context; it is off or refused it
            raw = request.raw_body if request is not None and request.raw_body is not None else state.body
            raw = raw if len(raw) <= MAX_BODY_KEPT else raw[:MAX_BODY_KEPT]
            body = await asyncio.to_thread(_parse_body, raw)  # up to 16 MB: off the event loop
        record = self._build_record(scope, engine_id, state, totals, _final_usage(scope), body)
        started = time.monotonic()
        try:
            newly = await asyncio.wait_for(asyncio.wrap_future(self.writer.submit(record)), COMMIT_TIMEOUT_S)
            if not newly and not await self._is_ours(record):
                # The id was recorded before by another request (a client reusing its X-Request-ID): this
                # request gets its own record rather than being dropped as a duplicate.
                record = dataclasses.replace(record, request_id=f"{record.request_id}~{uuid.uuid4().hex[:8]}")
                await asyncio.wait_for(asyncio.wrap_future(self.writer.submit(record)), COMMIT_TIMEOUT_S)
            if self.on_commit is not None:
                self.on_commit(time.monotonic() - started)
        except LedgerWriteError as exc:
            if exc.spilled_to is None:
                raise  # not durable anywhere: the response must not complete as if it were
            # spilled (replayed later) or dead-lettered (it can never be written: kept with the reason); either way
            # on disk, so the response completes
            logger.error("qwen-vllm-ext: ledger record %s not written to the store (%s); kept in %s",
                         record.request_id, exc, exc.spilled_to)
        finally:
            # Reconciliation (gateway refunds, budgets, spike breaker) needs the counts, not durability.
            if self.on_record is not None:
                self.on_record(record, body)
            for callback in (request.on_usage if request is not None else ()):
                callback(record)

    async def _is_ours(self, record) -> bool:
        """A duplicate can also be this very record (a store reply lost after the write): compare contents."""
        existing = await asyncio.to_thread(self.writer.store.get, record.request_id)
        return existing is not None and existing.to_dict() == record.to_dict()

    def _build_record(self, scope, engine_id, state, totals: RequestTotals, final_usage, body: dict):
        now = time.time()
        status = _status(totals, state.http_status or 200, state.disconnected)
        reasoning = 0  # reported where vLLM reports it (a reasoning parser is on), counted exactly by the engine hook
        if final_usage is not None and getattr(final_usage, "completion_tokens_details", None) is not None:
            reasoning = totals.reasoning_tokens
        billed_prompt = billed_prompt_tokens(totals.prompt_tokens, totals.engine_prompt_tokens)
        cached = min(totals.cached_tokens, billed_prompt)
        bill = self.policy.bill(billed_prompt, totals.completion_tokens, cached_tokens=cached)
        cost = 0 if self.prices is None else self.prices.cost_pico(billed_prompt, totals.completion_tokens, cached,
                                                                   policy=self.policy)
        request = find_request_context(scope)
        model = record_model(body.get("model"), request.model if request is not None else None,
                             self.served.names if self.served is not None else (),
                             ran=bool(totals.engine_prompt_tokens) or status in ("stop", "length"))
        unauthenticated = request is not None and request.unauthenticated
        # a request refused for its API key: nothing it chose (ids, conversation) is stored
        conversation = None if unauthenticated else conversation_id(request_conversation_header(scope), body)
        reuse_ratio = None
        if status in ("stop", "length") and totals.engine_prompt_tokens and self.reuse is not None:  # a turn run
            reuse_ratio = self.reuse.observe(conversation, totals.prompt_tokens, totals.cached_tokens,
                                                  totals.completion_tokens)
        return LedgerRecord(
            request_id=f"unauth-{uuid.uuid4().hex}" if unauthenticated else engine_id,
            instance_id=self.instance_id,
            model=model,
            endpoint=scope["path"],
            status=status,
            http_status=state.http_status or (499 if state.disconnected else 500),
            prompt_tokens=totals.prompt_tokens,
            cached_tokens=totals.cached_tokens,
            completion_tokens=totals.completion_tokens,
            reasoning_tokens=reasoning,
            engine_prompt_tokens=totals.engine_prompt_tokens,
            billed_prompt_micro=to_micro(bill["prompt_units"]),
            billed_completion_micro=to_micro(bill["completion_units"]),
            received_at=state.received_at,
            finished_at=now,
            ttft_s=(totals.first_token_at - state.received_at) if totals.first_token_at else None,
            latency_s=now - state.received_at,
            streamed=state.streamed,
            api_key_id=request.api_key_id if request is not None else None,
            conversation_id=conversation,
            reuse_ratio=reuse_ratio,
            cost_pico_usd=cost,
        )


def record_model(client_model, resolved: str | None, served: tuple[str, ...], ran: bool) -> str:
    """The model a record (and the ``model`` metric label) carries: a served model's name, never an arbitrary client
    string. The gateway's resolved model or the client's when the server serves it (or the engine ran the request:
    vLLM accepted the name, a LoRA adapter say) and it is storable; the default served model when the request named
    none; else ``""`` (a request for a model this server does not serve, refused)."""
    for name in (resolved, client_model):
        if isinstance(name, str) and name and (name in served or (ran and storable(name, MAX_MODEL_CHARS))):
            return name
    if not client_model and served:
        return served[0]
    return resolved if resolved and not client_model and storable(resolved, MAX_MODEL_CHARS) else ""


class PerSecondCap:
    """At most ``rate`` events per second (a token bucket of one second's worth); ``rate`` 0: none. Thread-safe enough
    for the event loop it runs on (one API-server process)."""

    def __init__(self, rate: float, clock=time.monotonic):
        self.rate, self.clock = rate, clock
        self._tokens, self._last = max(rate, 1.0), clock()

    def allow(self) -> bool:
        if self.rate <= 0:
            return False
        now = self.clock()
        self._tokens = min(max(self.rate, 1.0), self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


def _parse_body(raw: bytearray) -> dict:
    import json

    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {}
    return body if isinstance(body, dict) else {}


def _final_usage(scope):
    metadata = (scope.get("state") or {}).get("request_metadata")
    return getattr(metadata, "final_usage_info", None)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("qwen-vllm-ext: recording a ledger entry failed", exc_info=task.exception())
