"""Gateway admission against the SQLite limiter: inline on the event loop through the non-blocking connection,
and on a worker thread through the ordinary one when another connection holds SQLite's write lock."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import types

from qwen_v3_calculator import Calculator
from qwen_v3_calculator.billing import get_policy
from qwen_vllm_ext.config import Settings
from qwen_vllm_ext.gateway.admission import Served
from qwen_vllm_ext.keys import KeyCache, SqliteKeyStore
from qwen_vllm_ext.gateway.limiter import SqliteLimiter
from qwen_vllm_ext.gateway.middleware import GatewayMiddleware, GatewayState


def _gateway(tmp_path):
    settings = Settings(data_dir=str(tmp_path), gateway=True)
    keys = SqliteKeyStore(str(tmp_path / "ledger.sqlite3"), "s" * 32)
    secret, key = keys.create("t", rpm=100, tpm=10**6)
    limiter = SqliteLimiter(str(tmp_path / "limiter.sqlite3"))
    inline = limiter.nonblocking()

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    gw = GatewayMiddleware(app, settings=settings, keys=KeyCache(keys), limiter=limiter,
                           policy=get_policy("default"), inline_limiter=inline,
                           state=GatewayState(admission=Served(Calculator(), 4096, names=("m",))))
    return gw, secret, key, limiter, inline


def _call(gw, secret):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}).encode()
    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "state": {},
             "app": types.SimpleNamespace(state=types.SimpleNamespace()), "headers": [(b"authorization", f"Bearer {secret}".encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return messages.pop() if messages else await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(gw(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"])


def test_admission_runs_inline_when_the_store_is_free(tmp_path):
    gw, secret, key, limiter, inline = _gateway(tmp_path)
    ops = limiter._ops
    status, headers = _call(gw, secret)
    assert status == 200 and headers[b"x-ratelimit-remaining-requests"] == b"99"
    assert inline._ops == 1 and limiter._ops == ops      # reserved through the non-blocking connection


def test_admission_waits_on_a_thread_while_another_connection_holds_the_lock(tmp_path):
    gw, secret, key, limiter, inline = _gateway(tmp_path)
    holder = sqlite3.connect(str(tmp_path / "limiter.sqlite3"), isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    timer = threading.Timer(0.3, lambda: holder.execute("ROLLBACK"))
    timer.start()
    ops = limiter._ops
    status, headers = _call(gw, secret)
    timer.join()
    holder.close()
    assert status == 200 and headers[b"x-ratelimit-remaining-requests"] == b"99"
    assert inline._ops == 0 and limiter._ops == ops + 1  # the inline attempt was busy; the thread one waited
    assert limiter.status([(f"key:{key.key_id}:rpm", 100, 60)])[f"key:{key.key_id}:rpm"].remaining == 99
