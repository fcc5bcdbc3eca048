"""vLLM glue of the KV-reuse capability (API-server process): the only module here that touches vLLM.

* :class:`KvMiddleware` (pure ASGI, inside the usage ledger so its rejections are recorded): rejects a malformed
  ``x-session-id``/``x-conversation-id`` with an OpenAI-shaped 400, and — with ``idle_sleep_s > 0`` — holds each engine request
  in the :class:`~.sleep.IdleSleeper` (a request arriving while the engine sleeps waits for the wake).
* :func:`init_state`: binds the sleeper to vLLM's ``engine_client.sleep(level=1, mode="wait")`` /
  ``wake_up()`` and starts its timer. Sleep mode needs ``--enable-sleep-mode`` (the launcher adds it) and a
  platform with ``is_sleep_mode_available()`` (CUDA/ROCm/XPU; the launcher refuses the setting elsewhere).
* Metrics: ``qwen_ext_engine_sleeps_total``, ``qwen_ext_engine_wakes_total``, ``qwen_ext_engine_wake_failures_total``,
  ``qwen_ext_engine_wake_seconds``, ``qwen_ext_engine_asleep``; the reuse-ratio histogram is in
  :mod:`qwen_vllm_ext.usage.metrics`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

from ..common.errors import error_body
from ..observability import catalog
from . import reuse
from .sleep import ASLEEP, IdleSleeper

logger = logging.getLogger("qwen_vllm_ext.kv")

@dataclasses.dataclass
class KvState:
    """This API server's KV-reuse state: built by :func:`attach` and handed to the middleware, filled by
    :func:`init_state`."""

    sleeper: IdleSleeper | None = None  # idle_sleep_s > 0
    task: asyncio.Task | None = None  # the sleeper's timer
    template: str | None = None  # the calculator template vLLM serves ("qwen3-reuse" in reuse mode)
    applies: tuple[bool, str] | None = None  # does the reuse template apply to the served model (and why)
    tracker: reuse.ReuseTracker = dataclasses.field(default_factory=reuse.ReuseTracker)  # each conversation's last
    # turn, for the ledger's reuse ratio (kv_reuse_tracker_size conversations)


def sleep_metrics():
    return {
        "sleeps": catalog.counter("qwen_ext_engine_sleeps"),
        "wakes": catalog.counter("qwen_ext_engine_wakes"),
        "wake_failures": catalog.counter("qwen_ext_engine_wake_failures"),
        "wake_s": catalog.histogram("qwen_ext_engine_wake_seconds"),
        "asleep": catalog.gauge("qwen_ext_engine_asleep"),
    }


def _on_event(name: str, seconds: float) -> None:
    m = sleep_metrics()
    if name == "sleep":
        m["sleeps"].inc()
        m["asleep"].set(1)
        logger.info("qwen-vllm-ext: engine idle, put to sleep in %.2fs", seconds)
    else:
        m["wakes"].inc()
        m["wake_s"].observe(seconds)
        m["asleep"].set(0)
        logger.info("qwen-vllm-ext: engine woken in %.2fs", seconds)


NOT_ENGINE_PATHS = ("/v1/tokens/count",)  # answered by the API server alone: never wakes the engine


def _is_engine_request(scope) -> bool:
    path = str(scope.get("path", ""))
    return scope.get("method") == "POST" and path.startswith(("/v1/", "/inference/")) and path not in NOT_ENGINE_PATHS


async def _send_json(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class KvMiddleware:
    def __init__(self, app, kv: KvState):
        self.app = app
        self.kv = kv

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _is_engine_request(scope):
            return await self.app(scope, receive, send)
        problem = reuse.check_conversation(reuse.request_conversation_header(scope))
        if problem is not None:
            message, header = problem
            return await _send_json(send, 400, error_body(message, "invalid_conversation_id", param=header))
        sleeper = self.kv.sleeper
        if sleeper is None:
            return await self.app(scope, receive, send)
        try:
            await sleeper.enter()
        except Exception as exc:  # noqa: BLE001 - the wake failed; the next request tries again
            sleep_metrics()["wake_failures"].inc()
            logger.error("qwen-vllm-ext: waking the engine failed: %s", exc)
            return await _send_json(send, 503, error_body(
                f"the engine was asleep (idle_sleep_s) and failed to wake: {exc}; retry shortly",
                "service_unavailable", "server_error"))
        try:
            await self.app(scope, receive, send)
        finally:
            sleeper.leave()


def attach(app, settings) -> KvState:
    """Add the middleware with its state, the conversations' reuse tracker included (called by the integration
    layer; the ledger gets the tracker from it)."""
    sleep_metrics()  # the families exist (at 0) on every server, so rules and panels always find them
    kv = KvState(tracker=reuse.ReuseTracker(settings.kv_reuse_tracker_size))
    app.add_middleware(KvMiddleware, kv=kv)
    return kv


async def init_state(kv: KvState, engine_client, settings, args=None) -> None:
    """Record the served template in ``kv``; start the idle-sleep timer on this API server when ``idle_sleep_s > 0``
    (the launcher has checked the platform supports sleep mode and added ``--enable-sleep-mode``)."""
    if args is not None:
        kv.template = reuse.served_template(args)
        kv.applies = reuse.reuse_template_applies(args.model)
    if settings.idle_sleep_s <= 0 or engine_client is None:
        return

    async def sleep():
        await engine_client.sleep(level=1, mode="wait")

    async def wake():
        await engine_client.wake_up()

    kv.sleeper = IdleSleeper(settings.idle_sleep_s, sleep, wake, on_event=_on_event)
    if await engine_client.is_sleeping():
        kv.sleeper.state = ASLEEP
    sleep_metrics()["asleep"].set(1 if kv.sleeper.state == ASLEEP else 0)
    kv.task = asyncio.get_running_loop().create_task(
        kv.sleeper.run(poll_s=1.0, on_error=lambda e: logger.error("qwen-vllm-ext: putting the engine to sleep "
                                                                  "failed: %s", e)))
    logger.info("qwen-vllm-ext: idle sleep after %.0fs without requests", settings.idle_sleep_s)


def status(kv: KvState | None) -> dict:
    """For the health route: the chat template family served in this API server and the idle-sleep state."""
    kv = kv or KvState()
    return {"reuse_template": kv.template in reuse.OFFICIAL_OF, "template": kv.template or "model default",
            "reuse_template_applies": None if kv.applies is None else kv.applies[0],
            "reuse_template_note": None if kv.applies is None else kv.applies[1],
            "conversations_tracked": len(kv.tracker),
            "idle_sleep": None if kv.sleeper is None else kv.sleeper.status()}
