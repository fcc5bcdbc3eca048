"""The API server's connection limits, pure part (qwen_vllm_ext/gateway/connections.py): the cap from the open-file
limit, the open-file limit to set, the admission rule (evict the oldest idle connection, else refuse, else reset),
when a header timer closes its connection, and the answers sent."""
import json

import pytest

from qwen_vllm_ext.config import Settings
from qwen_vllm_ext.gateway import connections as c

INF = -1  # resource.RLIM_INFINITY on Linux


def limits(cap=3, reserve=64, timeout=15.0):
    return c.connection_limits(timeout, cap, reserve, 100_000)


# ---- the cap and the open-file limit ------------------------------------------------------------------------------
def test_the_cap_is_the_open_file_limit_minus_the_reserve():
    got = c.connection_limits(15, 0, 1024, 20_000)
    assert (got.cap, got.fd_limit, got.reserve, got.header_timeout_s) == (18_976, 20_000, 1024, 15.0)
    assert got.how == "derived: open-file limit 20000 - reserve 1024"


def test_a_reserve_larger_than_half_the_limit_leaves_half_and_a_tiny_limit_the_minimum():
    assert c.connection_limits(15, 0, 1024, 1024).cap == 512
    assert "half the open-file limit 1024" in c.connection_limits(15, 0, 1024, 1024).how
    assert c.connection_limits(15, 0, 1024, 100).cap == c.MIN_CAP


def test_a_configured_cap_is_kept_below_what_the_limit_allows():
    assert c.connection_limits(15, 500, 1024, 20_000).cap == 500
    high = c.connection_limits(15, 50_000, 1024, 20_000)
    assert high.cap == 18_976 and high.how.startswith("max_connections 50000 lowered to 18976")


def test_no_open_file_limit_gives_a_fixed_cap_or_the_configured_one():
    assert c.connection_limits(15, 0, 1024, None).cap == c.UNLIMITED_FD_CAP
    assert c.connection_limits(15, 200_000, 1024, None).cap == 200_000


@pytest.mark.parametrize("field,args", [("header_timeout_s", (-1, 0, 0)), ("max_connections", (1, -5, 0)),
                                        ("connection_fd_reserve", (1, 0, -1))])
def test_negative_settings_are_refused_by_name(field, args):
    with pytest.raises(c.ConnectionSettingsError, match=field):
        c.connection_limits(*args, 20_000)


def test_refusal_slots_come_from_the_reserve_within_bounds():
    assert [c.refusal_slots(r) for r in (0, 64, 1024, 100_000)] == [16, 16, 256, 256]


def test_the_soft_open_file_limit_is_raised_to_the_hard_one():
    assert c.fd_limit_target(1024, 20_000, INF) == 20_000
    assert c.fd_limit_target(20_000, 20_000, INF) is None  # nothing to raise
    assert c.fd_limit_target(1024, INF, INF, nr_open=1_048_576) == 1_048_576  # unlimited hard: the kernel's ceiling
    assert c.fd_limit_target(1024, INF, INF) is None
    assert c.fd_limit_target(INF, INF, INF, nr_open=1_048_576) is None


def test_the_settings_defaults_are_sane():
    s = Settings()
    assert s.connection_guard and s.raise_fd_limit
    # nginx's client_header_timeout: 15 s made a client that stalled 17 s between connect and send read a 408
    assert s.header_timeout_s == 60.0 and s.max_connections == 0 and s.connection_fd_reserve == 1024
    assert Settings.resolve(env={"QWEN_VLLM_EXT_HEADER_TIMEOUT_S": "5", "QWEN_VLLM_EXT_MAX_CONNECTIONS": "100"},
                            ).header_timeout_s == 5.0


# ---- admission ----------------------------------------------------------------------------------------------------
def test_under_the_cap_every_connection_is_admitted():
    table = c.ConnectionTable(limits(cap=3))
    assert [table.admit(n, 0.0) for n in range(3)] == [(c.ADMIT, None)] * 3
    assert table.stats.accepted == 3


def test_at_the_cap_the_oldest_idle_connection_makes_room():
    table = c.ConnectionTable(limits(cap=2))
    a, b = object(), object()
    table.waiting(a, 0.0)
    table.waiting(b, 0.5)
    assert table.admit(2, 10.0) == (c.EVICT, a)
    assert not table.is_waiting(a) and table.is_waiting(b)
    assert table.admit(2, 10.0) == (c.EVICT, b)
    assert table.stats.evicted == 2


def test_a_connection_that_just_opened_is_not_evicted():
    table = c.ConnectionTable(limits(cap=1))
    young = object()
    table.waiting(young, 10.0)
    assert table.admit(1, 10.0 + c.EVICT_MIN_AGE_S / 2)[0] == c.REFUSE
    assert table.admit(1, 10.0 + c.EVICT_MIN_AGE_S) == (c.EVICT, young)


def test_a_connection_that_waits_again_moves_to_the_young_end():
    table = c.ConnectionTable(limits(cap=2))
    a, b = object(), object()
    table.waiting(a, 0.0)
    table.waiting(b, 1.0)
    table.waiting(a, 5.0)  # a's next request on a kept-alive connection
    assert table.admit(2, 100.0) == (c.EVICT, b)


def test_with_every_connection_busy_newcomers_are_refused_then_reset():
    table = c.ConnectionTable(limits(cap=2, reserve=0))  # 16 refusal slots
    busy = object()
    table.waiting(busy, 0.0)
    table.done(busy)  # its request head arrived
    decisions = [table.admit(2, 50.0)[0] for _ in range(18)]
    assert decisions == [c.REFUSE] * 16 + [c.RESET] * 2
    assert (table.stats.refused, table.stats.reset, table.lingering) == (16, 2, 16)
    table.refusal_closed()
    assert table.admit(2, 50.0)[0] == c.REFUSE


def test_no_cap_admits_everything():
    table = c.ConnectionTable(c.ConnectionLimits(15.0, 0, None, 0, 16, "off"))
    assert table.admit(10**6, 0.0) == (c.ADMIT, None)


def test_status_reports_limits_and_counters():
    table = c.ConnectionTable(limits(cap=2))
    x = object()
    table.waiting(x, 0.0)
    table.timed_out(x)
    status = table.status(open_connections=1)
    assert status["cap"] == 2 and status["open"] == 1 and status["waiting_for_headers"] == 0
    assert status["header_timeouts"] == 1 and status["header_timeout_s"] == 15.0


# ---- the header timer ---------------------------------------------------------------------------------------------
def test_a_header_timer_closes_only_a_connection_with_no_request_since_it_was_armed():
    first, second = object(), object()
    assert c.timer_should_close(None, None, False, False)  # opened, never sent a head
    assert not c.timer_should_close(None, first, False, False)  # a request started and is running
    assert not c.timer_should_close(None, first, True, False)  # a request came and went: not this timer's business
    assert c.timer_should_close(first, first, True, False)  # kept alive, next head never completed
    assert not c.timer_should_close(first, first, False, False)  # the same request still streaming
    assert not c.timer_should_close(first, second, False, False)  # a pipelined head arrived
    assert not c.timer_should_close(None, None, False, True)  # already closing


# ---- the answers --------------------------------------------------------------------------------------------------
def _parse(raw: bytes):
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["content-length"]) == len(body) and headers["connection"] == "close"
    return lines[0], headers, json.loads(body)


def test_the_answers_are_http_with_openai_shaped_errors():
    status, headers, body = _parse(c.refusal_response(18_976))
    assert status == "HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "1"
    assert body["error"]["code"] == "too_many_connections" and "18976" in body["error"]["message"]
    status, _, body = _parse(c.header_timeout_response(15.0))
    assert status == "HTTP/1.1 408 Request Timeout" and body["error"]["code"] == "request_header_timeout"
    assert "15 s" in body["error"]["message"]
    status, _, body = _parse(c.evicted_response())
    assert status.startswith("HTTP/1.1 408") and body["error"]["code"] == "idle_connection_closed"
