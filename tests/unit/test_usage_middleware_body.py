"""The ledger middleware and the request body: it keeps its own copy only when no gateway parses the body onto the
request context (issue 52: the body is parsed once per request and shared, not copied twice)."""
from __future__ import annotations

import asyncio
import json

import pytest

from qwen_v3_calculator.billing import get_policy
from qwen_vllm_ext.common.context import request_context
from qwen_vllm_ext.common.served import ServedModel
from qwen_vllm_ext.usage.ledger import LedgerWriter, SqliteLedgerStore
from qwen_vllm_ext.usage.middleware import UsageLedgerMiddleware

BODY = {"model": "m", "user": "alice", "messages": [{"role": "user", "content": "hi"}]}


def _request(tmp_path, keep_body: bool, gateway):
    """One POST through the middleware (a real SQLite ledger behind it); ``gateway(request, raw)`` plays the
    gateway: what it leaves on the request context. Returns the committed record."""
    store = SqliteLedgerStore(str(tmp_path / "ledger.sqlite3"))
    writer = LedgerWriter(store, spill_dir=str(tmp_path))

    async def app(scope, receive, send):
        message = await receive()
        gateway(request_context(scope), message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = UsageLedgerMiddleware(app, writer=writer, policy=get_policy("default"), instance_id="t",
                               served=ServedModel(name="m", names=("m",)), keep_body=keep_body)
    raw = json.dumps(BODY).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "state": {}}
    sent = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    try:
        asyncio.run(mw(scope, receive, send))
        rid = dict(sent[0]["headers"])[b"x-request-id"].decode()
        return store.get(rid)
    finally:
        writer.close()


def test_without_a_gateway_the_ledger_parses_its_own_copy(tmp_path):
    record = _request(tmp_path, keep_body=True, gateway=lambda request, raw: None)
    assert record.conversation_id == "alice"


@pytest.mark.parametrize("left", ["parsed", "raw"])
def test_with_the_gateway_the_ledger_reads_what_it_left_on_the_request(tmp_path, left):
    def gateway(request, raw):
        if left == "parsed":
            request.body = json.loads(raw)
        else:  # read but refused before parsing: the bytes, no copy
            request.raw_body = raw

    assert _request(tmp_path, keep_body=False, gateway=gateway).conversation_id == "alice"


def test_with_the_gateway_the_ledger_keeps_no_copy_of_its_own(tmp_path):
    # nothing on the request context: had the middleware copied the body, the record would name the user
    record = _request(tmp_path, keep_body=False, gateway=lambda request, raw: None)
    assert record.conversation_id is None and record.model == "m"
