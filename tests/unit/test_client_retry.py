"""Retries against a local HTTP server (real sockets) that answers 429/5xx with Retry-After and
x-ratelimit-reset-* headers: waits honoured, insufficient_quota never retried, fallback models on 5xx,
X-Request-ID on every attempt, typed exceptions; sync and async clients."""
import asyncio
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qwen_vllm_ext.client import (AsyncClient, Client, InsufficientQuotaError, NO_RETRIES, RateLimitError,
                                  RetryPolicy, ServerError, ServiceUnavailableError, StreamError,
                                  parse_duration, parse_retry_after)


def err(code, message="x", type_="requests"):
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


OK = {"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class ScriptedServer:
    """Answers POSTs with the next scripted (status, headers, body | list of SSE strings); records requests."""

    def __init__(self, script):
        self.script = list(script)
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"t": time.monotonic(), "headers": dict(self.headers), "body": body})
                status, headers, payload = outer.script.pop(0) if outer.script else (200, {}, OK)
                if isinstance(payload, list):  # a stream
                    self.send_response(status)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    for ev in payload:
                        self.wfile.write(ev.encode())
                        self.wfile.flush()
                    return
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("x-request-id", self.headers.get("X-Request-ID", ""))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def gaps(self):
        ts = [r["t"] for r in self.requests]
        return [b - a for a, b in zip(ts, ts[1:])]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_factory():
    made = []

    def make(script):
        s = ScriptedServer(script)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def fast_policy(**kw):
    return RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, rng=random.Random(1), **kw)


HI = [{"role": "user", "content": "hi"}]


def test_parse_headers():
    assert parse_duration("1s") == 1.0 and parse_duration("6m0s") == 360.0 and parse_duration("20ms") == 0.02
    assert parse_duration("2.5") == 2.5 and parse_duration("soon") is None and parse_duration("") is None
    assert parse_retry_after("3") == 3.0 and parse_retry_after("nope") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0


def test_policy_backoff_is_exponential_jittered_and_capped():
    p = RetryPolicy(initial_backoff_s=1, multiplier=2, max_backoff_s=5, jitter=0.5, rng=random.Random(0))
    for n, cap in ((1, 1), (2, 2), (3, 4), (4, 5), (9, 5)):
        d = p.backoff(n)
        assert cap / 2 <= d <= cap
    with pytest.raises(ValueError):
        RetryPolicy(jitter=2)


def test_retry_after_is_honoured_and_request_ids_sent(server_factory):
    s = server_factory([(429, {"Retry-After": "1"}, err("rate_limit_exceeded")),
                        (503, {}, err("service_unavailable", type_="server_error")),
                        (200, {}, OK)])
    seen = []
    with Client(s.url, "k", retry=fast_policy(), on_retry=lambda n, e, d: seen.append((n, type(e), d))) as c:
        r = c.chat(HI, model="m", max_tokens=3)
    assert r.text == "ok" and r.attempts == 3
    assert [t for _, t, _ in seen] == [RateLimitError, ServiceUnavailableError]
    gaps = s.gaps()
    assert gaps[0] >= 1.0 and seen[0][2] >= 1.0  # the server's wait, never shortened
    assert gaps[1] < 1.0  # then plain backoff
    ids = [q["headers"]["X-Request-ID"] for q in s.requests]
    assert len(set(ids)) == 3 and ids[1] == ids[0] + "-1" and ids[2] == ids[0] + "-2"
    assert all(q["headers"]["Authorization"] == "Bearer k" for q in s.requests)
    assert r.request_id == ids[2]


def test_ratelimit_reset_header_of_the_exhausted_limit(server_factory):
    s = server_factory([(429, {"x-ratelimit-reset-tokens": "400ms", "x-ratelimit-reset-requests": "30s"},
                         err("rate_limit_exceeded", type_="tokens")), (200, {}, OK)])
    with Client(s.url, retry=fast_policy()) as c:
        assert c.chat(HI, model="m").attempts == 2
    assert 0.4 <= s.gaps()[0] < 5


def test_insufficient_quota_is_never_retried(server_factory):
    s = server_factory([(429, {"Retry-After": "1"}, err("insufficient_quota", type_="insufficient_quota"))])
    with Client(s.url, retry=fast_policy(max_retries=5)) as c, pytest.raises(InsufficientQuotaError) as ei:
        c.chat(HI, model="m")
    assert len(s.requests) == 1 and ei.value.status_code == 429 and ei.value.code == "insufficient_quota"


def test_gives_up_after_max_retries_and_on_a_too_long_wait(server_factory):
    s = server_factory([(500, {}, err(None, type_="server_error"))] * 3)
    with Client(s.url, retry=fast_policy(max_retries=2)) as c, pytest.raises(ServerError):
        c.chat(HI, model="m")
    assert len(s.requests) == 3
    s = server_factory([(429, {"Retry-After": "3600"}, err("rate_limit_exceeded"))])
    with Client(s.url, retry=fast_policy(max_server_wait_s=60)) as c, pytest.raises(RateLimitError) as ei:
        c.chat(HI, model="m")
    assert len(s.requests) == 1 and ei.value.retry_after == "3600"
    s = server_factory([(400, {}, err("invalid_request_error"))])
    with Client(s.url, retry=fast_policy()) as c, pytest.raises(Exception):
        c.chat(HI, model="m")
    assert len(s.requests) == 1


def test_fallback_models_on_5xx(server_factory):
    s = server_factory([(502, {}, {"error": "bad gateway"}), (500, {}, err(None, type_="server_error")),
                        (200, {}, OK)])
    with Client(s.url, retry=fast_policy(max_retries=0), fallback_models=["b", "c"]) as c:
        r = c.chat(HI, model="a")
    assert [q["body"]["model"] for q in s.requests] == ["a", "b", "c"] and r.model == "c"


def test_async_client_retries_and_streams(server_factory):
    stream = ['data: {"id":"c","choices":[{"index":0,"delta":{"content":"he"}}],'
              '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n',
              'data: {"id":"c","choices":[{"index":0,"delta":{"content":"llo."}}]}\n\n', "data: [DONE]\n\n"]
    s = server_factory([(429, {"Retry-After": "0.2"}, err("rate_limit_exceeded")), (200, {}, stream)])

    async def go():
        async with AsyncClient(s.url + "/v1", retry=fast_policy()) as c:
            st = await c.chat(HI, model="m", stream=True)
            got = [ch.text async for ch in st]
            return got, st.usage, st.attempts

    got, usage, attempts = asyncio.run(go())
    assert got == ["he", "llo."] and usage["total_tokens"] == 2 and attempts == 2
    assert s.requests[1]["body"]["stream"] is True and s.gaps()[0] >= 0.2


def test_error_event_mid_stream_is_raised_and_not_retried(server_factory):
    stream = ['data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
              'data: {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}}\n\n']
    s = server_factory([(200, {}, stream)])
    with Client(s.url, retry=fast_policy(max_retries=3)) as c:
        st = c.chat(HI, model="m", stream=True)
        it = iter(st)
        assert next(it).text == "a"
        with pytest.raises(StreamError, match="engine failed"):
            next(it)
    assert len(s.requests) == 1


def test_sync_stream_text_through_the_adaptive_buffer(server_factory):
    parts = ["One", " two", ".", " Three", "\n", "end"]
    stream = ['data: {"choices":[{"index":0,"delta":{"content":%s}}]}\n\n' % json.dumps(p) for p in parts]
    s = server_factory([(200, {}, stream + ["data: [DONE]\n\n"])])
    with Client(s.url, retry=NO_RETRIES) as c:
        pieces = list(c.chat(HI, model="m", stream=True).iter_text(expected_tokens=100))
    assert pieces == ["One two.", " Three\n", "end"]
