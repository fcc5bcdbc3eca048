"""SSE parser and OpenAI stream decoder: events split at every byte, several per read, CRLF/CR, comments,
[DONE], empty vs missing deltas, error events mid-stream, and clear errors on malformed input."""
import json

import pytest

from qwen_vllm_ext.client import (IncompleteStreamError, InsufficientQuotaError, RateLimitError, SSEParser,
                                  SSEProtocolError, StreamDecoder, StreamError)


def events_of(raw: bytes, pieces):
    p = SSEParser()
    out = []
    pos = 0
    for n in pieces:
        out += p.feed(raw[pos:pos + n])
        pos += n
    out += p.feed(raw[pos:])
    p.close()
    return [(e.event, e.data, e.id) for e in out]


def every_split(raw: bytes):
    whole = events_of(raw, [])
    for i in range(len(raw) + 1):
        assert events_of(raw, [i]) == whole, i
    for i in range(len(raw)):
        for j in range(i + 1, min(len(raw), i + 7) + 1):  # three pieces, middle one short
            assert events_of(raw, [i, j - i]) == whole, (i, j)
    assert events_of(raw, [1] * len(raw)) == whole  # byte by byte
    return whole


def test_line_endings_comments_fields_and_bom():
    raw = ("\ufeff: keep-alive\r\n\r\nevent: ping\rdata: 1\r\rid: 7\ndata: a\ndata: b\n\n"
           "data:no-space\r\n\r\nretry: 300\ndata: {\"x\": \"中文\"}\n\nfoo: ignored\ndata: z\n\n").encode()
    events = every_split(raw)
    assert events == [("ping", "1", None), ("message", "a\nb", "7"), ("message", "no-space", "7"),
                      ("message", '{"x": "中文"}', "7"), ("message", "z", "7")]


def test_several_events_in_one_read_and_cr_at_read_boundary():
    p = SSEParser()
    got = p.feed(b"data: 1\r")
    assert [e.data for e in got] == []  # the line ended but the event needs its blank line
    got = p.feed(b"\n\r\ndata: 2\n\ndata: 3\n\n")  # LF after the CR of the previous read: one line end
    assert [e.data for e in got] == ["1", "2", "3"]


def test_malformed_inputs_give_clear_errors():
    p = SSEParser()
    with pytest.raises(SSEProtocolError, match="invalid UTF-8.*byte 6"):
        p.feed(b"data: \xff\xfe\n\n")
    with pytest.raises(SSEProtocolError, match="not an SSE field"):
        SSEParser().feed(b'{"choices": []}\n')
    p = SSEParser()
    p.feed(b"data: {\"partial\": ")
    with pytest.raises(IncompleteStreamError, match="middle of an SSE event"):
        p.close()
    with pytest.raises(SSEProtocolError, match="exceeds 64 bytes"):
        SSEParser(max_event_bytes=64).feed(b"data: " + b"x" * 100)
    with pytest.raises(TypeError):
        SSEParser().feed("data: str\n\n")


def chunk(content=..., usage=None, finish=None, **extra):
    delta = {} if content is ... else {"content": content}
    body = {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
    if usage is not None:
        body["usage"] = usage
    return "data: " + json.dumps(body) + "\n\n"


def decode_all(raw: bytes, require_done=True):
    d = StreamDecoder(require_done=require_done)
    out = d.feed(raw)
    d.close()
    return out


def test_decoder_empty_vs_missing_delta_usage_and_done():
    u = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
    raw = (chunk("") + chunk() + chunk("hi", usage=u, token_ids=[5]) +
           'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}\n\n'
           "data: [DONE]\n\n").encode()
    out = decode_all(raw)
    assert [c.text for c in out] == ["", None, "hi", None]
    assert out[2].usage == u and out[2].token_ids() == [5] and not out[2].is_usage_only
    assert out[3].is_usage_only and out[3].usage["total_tokens"] == 10


def test_decoder_errors_mid_stream_are_typed():
    err = {"error": {"message": "budget", "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}
    with pytest.raises(InsufficientQuotaError) as ei:
        decode_all((chunk("a") + "data: " + json.dumps(err) + "\n\n").encode())
    assert ei.value.mid_stream and ei.value.code == "insufficient_quota"
    vllm_style = {"error": {"message": "engine died", "type": "InternalServerError", "param": None, "code": 500}}
    with pytest.raises(StreamError) as ei:
        decode_all((chunk("a") + "data: " + json.dumps(vllm_style) + "\n\n").encode())
    assert ei.value.status_code == 500 and "engine died" in str(ei.value)
    with pytest.raises(RateLimitError):
        decode_all(b'event: error\ndata: {"error": {"message": "slow down", "code": "rate_limit_exceeded"}}\n\n')
    with pytest.raises(SSEProtocolError, match="not JSON"):
        decode_all(b"data: {oops\n\n")
    with pytest.raises(SSEProtocolError, match="data after \\[DONE\\]"):
        decode_all(b"data: [DONE]\n\ndata: {}\n\n")
    with pytest.raises(IncompleteStreamError, match="without 'data: \\[DONE\\]'"):
        decode_all(chunk("a").encode())
    assert [c.text for c in decode_all(chunk("a").encode(), require_done=False)] == ["a"]


def test_completions_chunks_expose_text():
    raw = ('data: {"id":"c","choices":[{"index":0,"text":"yo","finish_reason":null}]}\n\n'
           "data: [DONE]\n\n").encode()
    every_split(raw)
    assert [c.text for c in decode_all(raw)] == ["yo"]


def test_chunks_before_an_error_in_the_same_read_come_first():
    err = {"error": {"message": "quota", "code": "insufficient_quota"}}
    d = StreamDecoder()
    got = d.feed((chunk("a") + chunk("b") + "data: " + json.dumps(err) + "\n\n").encode())
    assert [c.text for c in got] == ["a", "b"]
    with pytest.raises(InsufficientQuotaError):
        d.feed(b"")  # or close(): the error is not lost
    with pytest.raises(InsufficientQuotaError):
        d.close()
