"""KV-cache reuse, pure parts: template selection, launcher flags, conversation ids, the reuse-ratio LRU, the
ledger's new columns (backward-compatible SQLite migration) and the idle-sleep timer/wake logic."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import types

import pytest

from qwen_v3_calculator.chat import template_path
from qwen_vllm_ext.kv import reuse
from qwen_vllm_ext.kv.sleep import ASLEEP, AWAKE, FALLING_ASLEEP, IdleSleeper
from qwen_vllm_ext.usage.ledger import LedgerRecord, SqliteLedgerStore


# ------------------------------------------------------------------------------------------- template choice
def _model_dir(tmp_path, model_type, template):
    d = tmp_path / f"m-{model_type}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(d)


def test_reuse_template_applies_to_qwen3_hybrid_models_only(tmp_path):
    from qwen_vllm_ext.common import assets

    qwen3 = assets.chat_template("qwen3")
    assert reuse.reuse_template_applies(_model_dir(tmp_path, "qwen3", qwen3))[0]
    assert not reuse.reuse_template_applies(_model_dir(tmp_path, "qwen2", assets.chat_template("qwen2.5")))[0]
    # Qwen3 architecture but another template (e.g. the 2507 Instruct releases: no thinking switch)
    ok, why = reuse.reuse_template_applies(_model_dir(tmp_path, "qwen3_moe", "{{ messages }}"))
    assert not ok and "not the Qwen3 hybrid-thinking template" in why
    for hf_id in ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B-FP8",
                  "Qwen3-14B-AWQ"):
        assert reuse.reuse_template_applies(hf_id)[0], hf_id
    for hf_id in ("Qwen/Qwen3-30B-A3B-Instruct-2507", "Qwen/Qwen3-4B-Thinking-2507", "Qwen/Qwen3-8B-Base",
                  "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-Coder-30B-A3B-Instruct", "Qwen/Qwen3.5-4B-Base",
                  "Qwen/Qwen3-Next-80B-A3B-Instruct", "meta-llama/Llama-3.1-8B"):
        assert not reuse.reuse_template_applies(hf_id)[0], hf_id


def test_qwen35_family_gets_the_qwen35_reuse_template(tmp_path):
    from qwen_vllm_ext.common import assets

    for hf_id in ("Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-27B", "Qwen/Qwen3.6-35B-A3B", "Qwen/Qwen3.6-27B-FP8"):
        assert reuse.reuse_template_for(hf_id)[0] == "qwen3.5-reuse", hf_id
    q35 = _model_dir(tmp_path, "qwen3_5", assets.chat_template("qwen3.5"))
    assert reuse.reuse_template_for(q35)[0] == "qwen3.5-reuse"
    # a Qwen3.5 config with another template (e.g. a fine-tune's): none of ours
    name, why = reuse.reuse_template_for(_model_dir(tmp_path, "qwen3_5_moe", "{{ messages }}"))
    assert name is None and "not the official Qwen3.5/3.6 template" in why
    # the Qwen3 template is not the Qwen3.5 one (no <function=...> tool calls)
    assert not reuse.is_qwen35_template(assets.chat_template("qwen3"))


def test_demo_models_get_their_reuse_templates():
    from qwen_vllm_ext.demo import HYBRID_VARIANT, ensure_demo_model

    assert reuse.reuse_template_for(str(ensure_demo_model()))[0] == "qwen3-reuse"
    assert reuse.reuse_template_for(str(ensure_demo_model(variant=HYBRID_VARIANT)))[0] == "qwen3.5-reuse"


def test_launcher_flags():
    path = template_path()
    flags, note = reuse.launcher_flags(True, "Qwen/Qwen3-8B", set())
    assert flags == ["--chat-template", path, "--default-chat-template-kwargs", '{"preserve_thinking": true}']
    assert note.startswith("on: qwen3-reuse")
    assert reuse.launcher_flags(False, "Qwen/Qwen3-8B", set())[0] == []          # stock: one setting away
    assert reuse.launcher_flags(True, "Qwen/Qwen3-8B", {"chat_template"})[0] == []  # the user's wins
    assert reuse.launcher_flags(True, "Qwen/Qwen3-8B", {"default_chat_template_kwargs"})[0] == [
        "--chat-template", path]
    assert reuse.launcher_flags(True, "Qwen/Qwen2.5-7B-Instruct", set())[0] == []
    flags, note = reuse.launcher_flags(True, "Qwen/Qwen3.6-35B-A3B", set())
    assert flags == ["--chat-template", template_path("qwen3.5-reuse"), "--default-chat-template-kwargs",
                     '{"preserve_thinking": "answers"}'] and note.startswith("on: qwen3.5-reuse")


def test_served_template_for_the_calculator():
    ns = types.SimpleNamespace
    assert reuse.served_template(ns(chat_template=template_path(), default_chat_template_kwargs=None)) == "qwen3-reuse"
    assert reuse.served_template(ns(chat_template=template_path(),
                                    default_chat_template_kwargs={"preserve_thinking": False})) == "qwen3"
    q35 = template_path("qwen3.5-reuse")
    assert reuse.served_template(ns(chat_template=q35, default_chat_template_kwargs=None)) == "qwen3.5-reuse"
    assert reuse.served_template(ns(chat_template=q35,
                                    default_chat_template_kwargs={"preserve_thinking": False})) == "qwen3.5"
    assert reuse.served_template(ns(chat_template=None, default_chat_template_kwargs=None)) is None
    assert reuse.served_template(ns(chat_template="/other.jinja", default_chat_template_kwargs=None)) is None


# ------------------------------------------------------------------------------------------- conversation ids
def _cid(headers, body):
    return reuse.conversation_id(reuse.conversation_header(headers), body)


def _check(headers):
    return reuse.check_conversation(reuse.conversation_header(headers))


def test_conversation_id_from_header_or_user_field():
    h = [(b"X-Conversation-Id", b"conv-1")]
    assert _cid(h, {"user": "u"}) == "conv-1"
    assert _cid([], {"user": "alice"}) == "alice"
    assert _cid([], {"user": ""}) is None
    assert _cid([], {"user": "x" * 257}) is None
    assert _cid([], {"user": 7}) is None
    assert _cid([], {}) is None
    assert _check(h) is None
    assert _check([(b"x-conversation-id", b"bad id!")])[0].startswith("x-conversation-id must be")
    assert _check([(b"x-conversation-id", b"a" * 129)]) is not None


def test_session_header_wins_it_is_the_one_the_router_hashes():
    both = [(b"x-conversation-id", b"old-name"), (b"X-Session-Id", b"sess-1")]
    assert _cid(both, {"user": "u"}) == "sess-1"
    assert _cid([(b"x-session-id", b"s")], {}) == "s"
    assert _check([(b"x-session-id", b"bad id!")]) == (_check([(b"x-session-id", b"bad id!")])[0], "x-session-id")
    assert _check([(b"x-session-id", b"bad id!")])[0].startswith("x-session-id must be")


def test_the_conversation_header_is_read_once_per_request():
    """The KV middleware validates it and the ledger records it from the request context: one parse."""
    from qwen_vllm_ext.common.context import request_context

    scope = {"headers": [(b"x-session-id", b"sess-2")], "state": {}}
    assert reuse.request_conversation_header(scope) == ("x-session-id", "sess-2")
    scope["headers"] = [(b"x-session-id", b"changed")]  # not read again
    assert reuse.request_conversation_header(scope) == ("x-session-id", "sess-2")
    assert request_context(scope).conversation_header == ("x-session-id", "sess-2")
    assert reuse.request_conversation_header({"headers": [], "state": {}}) is None


def test_reuse_tracker_ratio_and_lru_bound():
    t = reuse.ReuseTracker(capacity=2)
    assert t.observe("a", prompt_tokens=100, cached_tokens=0, completion_tokens=28) is None  # first turn
    assert t.observe("a", prompt_tokens=160, cached_tokens=128, completion_tokens=10) == 1.0   # 128 / (100 + 28)
    assert t.observe("a", prompt_tokens=200, cached_tokens=85, completion_tokens=0) == 0.5     # 85 / 170
    assert t.observe(None, 10, 5, 1) is None and len(t) == 1
    t.observe("b", 10, 0, 0)
    t.observe("c", 10, 0, 0)  # evicts "a" (least recently used)
    assert len(t) == 2 and t.observe("a", 300, 200, 0) is None
    with pytest.raises(ValueError):
        reuse.ReuseTracker(0)
    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.kv import server

    app = types.SimpleNamespace(add_middleware=lambda *a, **k: None)
    assert server.attach(app, Settings(kv_reuse_tracker_size=5)).tracker.capacity == 5  # sized by the setting


# ------------------------------------------------------------------------------------------- ledger columns
_OLD_SCHEMA = """
CREATE TABLE requests (
    request_id TEXT PRIMARY KEY, instance_id TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL,
    status TEXT NOT NULL, http_status INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
    engine_prompt_tokens INTEGER NOT NULL, billed_prompt_micro INTEGER NOT NULL,
    billed_completion_micro INTEGER NOT NULL, received_at REAL NOT NULL, finished_at REAL NOT NULL,
    ttft_s REAL, latency_s REAL NOT NULL, streamed INTEGER NOT NULL, api_key_id TEXT);
CREATE TABLE daily (
    api_key_id TEXT NOT NULL, day TEXT NOT NULL, model TEXT NOT NULL, requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    billed_micro INTEGER NOT NULL, PRIMARY KEY (api_key_id, day, model));
"""


def _record(rid, **kw):
    base = dict(request_id=rid, instance_id="i", model="m", endpoint="/v1/chat/completions", status="stop",
                http_status=200, prompt_tokens=10, cached_tokens=0, completion_tokens=5, reasoning_tokens=0,
                engine_prompt_tokens=10, billed_prompt_micro=10, billed_completion_micro=5, received_at=1.0,
                finished_at=2.0, ttft_s=0.1, latency_s=1.0, streamed=False)
    return LedgerRecord(**{**base, **kw})


def test_ledger_migrates_an_old_file_and_keeps_its_rows(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_OLD_SCHEMA)
    db.execute("INSERT INTO requests VALUES ('old', 'i', 'm', '/v1/chat/completions', 'stop', 200, 10, 0, 5, 0, 10,"
               " 10, 5, 1.0, 2.0, 0.1, 1.0, 0, NULL)")
    db.commit()
    db.close()
    store = SqliteLedgerStore(str(path))
    old = store.get("old")
    assert old.conversation_id is None and old.reuse_ratio is None and old.prompt_tokens == 10
    assert old.cost_pico_usd == 0  # a record from before prices: no cost
    assert store.write_batch([_record("new", conversation_id="conv-1", reuse_ratio=0.96875,
                                      cost_pico_usd=123_456)]) == 1
    new = store.get("new")
    assert (new.conversation_id, new.reuse_ratio, new.cost_pico_usd) == ("conv-1", 0.96875, 123_456)
    assert store.daily(None, new.day)["cost_pico_usd"] == 123_456  # the old daily table got the column too
    store.close()
    # opening again (migration already done) changes nothing
    again = SqliteLedgerStore(str(path))
    assert sorted(r.request_id for r in again.records()) == ["new", "old"]
    again.close()


def test_ledger_record_validates_new_fields():
    for bad in (-0.1, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="reuse_ratio"):
            _record("x", reuse_ratio=bad)
    with pytest.raises(ValueError, match="conversation_id"):
        _record("x", conversation_id=5)
    assert LedgerRecord.from_dict({k: v for k, v in _record("x").to_dict().items()
                                   if k not in ("conversation_id", "reuse_ratio")}).reuse_ratio is None


# ------------------------------------------------------------------------------------------- idle sleep
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Engine:
    """Stand-in for the engine's sleep/wake calls (pure logic under test; the real ones are vLLM's)."""

    def __init__(self, clock, wake_s=2.0, sleep_s=0.5):
        self.clock, self.wake_s, self.sleep_s = clock, wake_s, sleep_s
        self.sleeping, self.calls, self.fail_wakes = False, [], 0
        self.gate = None  # an asyncio.Event that holds sleep() until set

    async def sleep(self):
        self.calls.append("sleep")
        if self.gate is not None:
            await self.gate.wait()
        self.clock.t += self.sleep_s
        self.sleeping = True

    async def wake(self):
        self.calls.append("wake")
        await asyncio.sleep(0)  # let other requests pile up behind the wake
        if self.fail_wakes:
            self.fail_wakes -= 1
            raise RuntimeError("cuda error")
        self.clock.t += self.wake_s
        self.sleeping = False


def _sleeper(idle_s=300.0, **kw):
    clock = Clock()
    engine = Engine(clock, **kw)
    events = []
    s = IdleSleeper(idle_s, engine.sleep, engine.wake, clock=clock, on_event=lambda n, sec: events.append((n, sec)))
    return s, engine, clock, events


def test_sleeps_only_after_the_idle_period_without_requests_in_flight():
    async def go():
        s, engine, clock, events = _sleeper()
        clock.t += 299
        assert not await s.tick() and s.state == AWAKE
        await s.enter()                    # a long request: in flight past the idle period
        clock.t += 1000
        assert not await s.tick() and engine.calls == []
        s.leave()                          # idle counts from the end of the last request
        clock.t += 299.9
        assert not await s.tick()
        clock.t += 0.1
        assert await s.tick() and s.state == ASLEEP and engine.sleeping
        assert not await s.tick() and engine.calls == ["sleep"]  # asleep: nothing more to do
        assert events == [("sleep", 0.5)] and s.sleeps == 1

    asyncio.run(go())


def test_requests_arriving_while_asleep_wait_for_one_wake():
    async def go():
        s, engine, clock, events = _sleeper(idle_s=10)
        clock.t += 10
        await s.tick()
        woke = await asyncio.gather(*(s.enter() for _ in range(5)))
        assert woke == [None] * 5                     # none failed
        assert engine.calls == ["sleep", "wake"]      # ONE wake for five waiting requests
        assert s.state == AWAKE and not engine.sleeping and s.in_flight == 5
        assert events[-1] == ("wake", 2.0) and s.wakes == 1
        for _ in range(5):
            s.leave()
        assert s.in_flight == 0

    asyncio.run(go())


def test_a_request_during_falling_asleep_waits_then_wakes_the_engine():
    async def go():
        s, engine, clock, _ = _sleeper(idle_s=10)
        engine.gate = asyncio.Event()
        clock.t += 10
        ticking = asyncio.create_task(s.tick())
        await asyncio.sleep(0)
        assert s.state == FALLING_ASLEEP
        entering = asyncio.create_task(s.enter())
        await asyncio.sleep(0)
        assert not entering.done()                    # held until the sleep call returns
        engine.gate.set()
        assert await ticking is True
        await entering
        assert engine.calls == ["sleep", "wake"] and s.state == AWAKE and s.in_flight == 1
        s.leave()

    asyncio.run(go())


def test_a_failed_wake_fails_those_requests_and_the_next_one_retries():
    async def go():
        s, engine, clock, _ = _sleeper(idle_s=10)
        clock.t += 10
        await s.tick()
        engine.fail_wakes = 1
        with pytest.raises(RuntimeError, match="cuda error"):
            await s.enter()
        assert s.state == ASLEEP and s.in_flight == 0     # not counted as in flight
        await s.enter()
        assert s.state == AWAKE and engine.calls == ["sleep", "wake", "wake"]
        s.leave()

    asyncio.run(go())


def test_sleep_failure_keeps_the_engine_awake_and_the_loop_running():
    async def go():
        s, engine, clock, _ = _sleeper(idle_s=0.01)

        async def broken():
            raise RuntimeError("sleep mode not enabled")

        s._sleep = broken
        errors = []
        task = asyncio.create_task(s.run(poll_s=0.001, on_error=errors.append))
        clock.t += 1
        await asyncio.sleep(0.05)
        task.cancel()
        assert errors and s.state == AWAKE and s.sleeps == 0

    asyncio.run(go())
    with pytest.raises(ValueError):
        IdleSleeper(0, None, None)


def test_sleep_never_happens_with_a_request_waiting_to_start():
    """The in-flight count rises before the wake is awaited, so a tick racing a waking request cannot sleep."""
    async def go():
        s, engine, clock, _ = _sleeper(idle_s=10)
        clock.t += 10
        await s.tick()
        entering = asyncio.create_task(s.enter())
        await asyncio.sleep(0)
        clock.t += 100
        assert not await s.tick()
        await entering
        assert not await s.tick() and engine.calls == ["sleep", "wake"]
        s.leave()

    asyncio.run(go())


# ------------------------------------------------------------------------------------------- the ASGI middleware
def _call(app, path="/v1/chat/completions", headers=(), method="POST"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    return app(scope, receive, send), sent


def test_middleware_holds_requests_until_the_engine_is_awake(monkeypatch):
    from qwen_vllm_ext.kv import server

    async def go():
        s, engine, clock, _ = _sleeper(idle_s=10)
        seen = []

        async def app(scope, receive, send):
            seen.append((scope["path"], s.state, engine.sleeping))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        mw = server.KvMiddleware(app, kv=server.KvState(sleeper=s))
        clock.t += 10
        await s.tick()
        calls = [_call(mw) for _ in range(3)]
        await asyncio.gather(*(c for c, _ in calls))
        assert seen == [("/v1/chat/completions", AWAKE, False)] * 3     # every request saw an awake engine
        assert engine.calls == ["sleep", "wake"] and s.in_flight == 0
        assert all(sent[0]["status"] == 200 for _, sent in calls)
        clock.t += 10
        await s.tick()
        coro, sent = _call(mw, path="/v1/tokens/count")                  # answered without the engine
        await coro
        assert s.state == ASLEEP and seen[-1] == ("/v1/tokens/count", ASLEEP, True)
        coro, sent = _call(mw, headers=[(b"x-conversation-id", b"no spaces allowed")])
        await coro
        body = json.loads(sent[1]["body"])
        assert sent[0]["status"] == 400 and body["error"]["code"] == "invalid_conversation_id"
        assert s.state == ASLEEP  # a rejected request does not wake the engine
        engine.fail_wakes = 1
        coro, sent = _call(mw)
        await coro
        body = json.loads(sent[1]["body"])
        assert sent[0]["status"] == 503 and body["error"]["code"] == "service_unavailable" and s.in_flight == 0

    asyncio.run(go())


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_conversation_columns_round_trip_in_both_stores(backend, tmp_path, request):
    from qwen_vllm_ext.usage.ledger import open_store

    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        server.flush()
        location = server.url
    else:
        location = str(tmp_path / "ledger.sqlite3")
    store = open_store(backend, location)
    try:
        store.write_batch([_record("t1", conversation_id="c", reuse_ratio=None),
                           _record("t2", conversation_id="c", reuse_ratio=0.9375, finished_at=3.0)])
        got = {r.request_id: (r.conversation_id, r.reuse_ratio) for r in store.records()}
        assert got == {"t1": ("c", None), "t2": ("c", 0.9375)}
        assert store.get("t2").reuse_ratio == 0.9375
    finally:
        store.close()


def test_client_sends_the_session_header_the_tracker_reads():
    from qwen_vllm_ext.client import SESSION_HEADER, Client

    assert SESSION_HEADER.lower().encode() == reuse.SESSION_HEADER
    headers = Client("http://x")._headers("rid-1", "conv-9")
    assert _cid([(k.encode(), v.encode()) for k, v in headers.items()], {}) == "conv-9"
    assert SESSION_HEADER not in Client("http://x")._headers("rid-1")
