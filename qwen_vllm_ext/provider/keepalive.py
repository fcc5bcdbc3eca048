"""SSE keep-alives: a comment line on a streamed response that has had nothing to send for a while (pure ASGI).

OpenRouter's provider guide asks providers to "send SSE comments as keep-alives" or it "may cancel with a fetch
timeout" (https://openrouter.ai/docs/guides/providers/integration); proxies with idle timeouts do the same. A
request waiting in the engine's queue, in a long prefill or in a long reasoning block sends nothing; this layer then
writes ``: keep-alive`` (an SSE comment: every conforming client, the ``openai`` SDK, this package's client and
TokenStorm skip it). It is the outermost layer, so the ledger and per-chunk usage never see the comments.
"""
from __future__ import annotations

import asyncio
import time

COMMENT = b": keep-alive\n\n"


class KeepAliveMiddleware:
    def __init__(self, app, interval_s: float, on_comment=None):
        self.app = app
        self.interval_s = interval_s
        self.on_comment = on_comment  # called once per comment sent (a metric)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        lock = asyncio.Lock()
        state = {"last": time.monotonic(), "open": False}
        beat: asyncio.Task | None = None

        async def heartbeat():
            while state["open"]:
                await asyncio.sleep(max(0.0, state["last"] + self.interval_s - time.monotonic()))
                async with lock:
                    if not state["open"] or time.monotonic() - state["last"] < self.interval_s:
                        continue
                    try:
                        await send({"type": "http.response.body", "body": COMMENT, "more_body": True})
                    except Exception:  # noqa: BLE001 - the client went away: the app finds out on its own send
                        state["open"] = False
                        return
                    state["last"] = time.monotonic()
                if self.on_comment is not None:
                    self.on_comment()

        async def wrapped_send(message):
            nonlocal beat
            async with lock:
                try:
                    await send(message)
                finally:
                    state["last"] = time.monotonic()
                    if message["type"] == "http.response.start":
                        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                  for k, v in message.get("headers", []))
                        if sse:
                            state["open"] = True
                            beat = asyncio.get_running_loop().create_task(heartbeat())
                    elif message["type"] == "http.response.body" and not message.get("more_body", False):
                        state["open"] = False

        try:
            await self.app(scope, receive, wrapped_send)
        finally:
            state["open"] = False
            if beat is not None:
                beat.cancel()
