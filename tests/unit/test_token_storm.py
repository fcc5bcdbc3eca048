"""TokenStorm pure parts: workloads, exact-length prompts, metrics, accounting and header-honesty findings,
report output; and the CLI end to end against a local streaming test server (real sockets) that gets its
accounting or its rate-limit headers wrong on purpose."""
import json
import random
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qwen_vllm_ext.bench import analysis, report, token_storm
from qwen_vllm_ext.bench.analysis import RequestRecord
from qwen_vllm_ext.bench.prompts import PromptFactory
from qwen_vllm_ext.bench.workload import (ArrivalSpec, LengthSpec, arrival_times, build_sessions, load_trace,
                                          sample_lengths)


# ------------------------------------------------------------------------------------------- workloads
def test_length_distributions():
    rng = random.Random(0)
    fixed = [sample_lengths(LengthSpec("fixed", 100, output_mean=7), rng) for _ in range(50)]
    assert {(t.prompt_tokens, t.output_tokens) for t in fixed} == {(100, 7)}
    normal = [sample_lengths(LengthSpec("normal", 2000), rng).prompt_tokens for _ in range(4000)]
    assert 1950 < statistics.mean(normal) < 2050 and 450 < statistics.stdev(normal) < 550
    tail = [sample_lengths(LengthSpec("long_tail", 2000), rng).prompt_tokens for _ in range(4000)]
    frac = sum(t >= 4000 for t in tail) / len(tail)
    assert 0.035 < frac < 0.07 and max(tail) <= 10_000 and max(tail) > 8000
    capped = [sample_lengths(LengthSpec("long_tail", 2000, output_mean=100, max_model_len=4096), rng)
              for _ in range(2000)]
    assert max(t.prompt_tokens + t.output_tokens for t in capped) <= 4096
    with pytest.raises(ValueError, match="unknown distribution"):
        LengthSpec("zipf")


def test_arrivals_poisson_gamma_burst_and_bounds():
    rng = random.Random(1)
    ts = arrival_times(ArrivalSpec("poisson", rate=20), 10_000, 100.0, rng)
    assert 1900 < len(ts) < 2100 and ts == sorted(ts) and ts[-1] < 100
    g = arrival_times(ArrivalSpec("gamma", rate=20, gamma_shape=0.25), 10_000, 100.0, rng)
    gaps = [b - a for a, b in zip(g, g[1:])]
    assert 1700 < len(g) < 2300 and statistics.stdev(gaps) / statistics.mean(gaps) > 1.5  # burstier
    assert len(arrival_times(ArrivalSpec("constant", rate=10), 10_000, 10.0, rng)) == 100
    b = arrival_times(ArrivalSpec("poisson", rate=5, burst_factor=4, burst_s=10, burst_period_s=60), 10_000, 600.0,
                      rng, burst=True)
    inside = sum(1 for t in b if t % 60 < 10)
    assert 4 * 10 / 50 * 0.7 < inside / (len(b) - inside) < 4 * 10 / 50 * 1.3  # 4x rate for 10 s of 60
    s = build_sessions(LengthSpec("normal", 100), ArrivalSpec(rate=1000), num_requests=7, duration_s=60, turns=3)
    assert [len(x.turns) for x in s] == [3, 3, 1]
    s = build_sessions(LengthSpec("normal", 100), ArrivalSpec(rate=1), num_requests=500, duration_s=5)
    assert len(s) < 20 and all(x.arrival_s < 5 for x in s)  # the duration bounds it too
    closed = build_sessions(LengthSpec("fixed", 10), ArrivalSpec(concurrency=4), num_requests=9, duration_s=5)
    assert len(closed) == 9 and closed[0].arrival_s is None
    with pytest.raises(ValueError):
        ArrivalSpec("poisson", rate=0)


def test_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "prompt_tokens": 50, "output_tokens": 5, "session": "a"}\n\n'
                 '{"timestamp": 0.5, "input_length": 70, "output_length": 6}\n'
                 '{"timestamp": 1, "prompt_tokens": 20, "output_tokens": 5, "session": "a"}\n'
                 '{"timestamp": 99, "prompt_tokens": 20, "output_tokens": 5}\n')
    s = load_trace(str(p), num_requests=10, duration_s=10)
    assert [(x.arrival_s, [(t.prompt_tokens, t.output_tokens) for t in x.turns]) for x in s] == \
        [(0.0, [(50, 5), (20, 5)]), (0.5, [(70, 6)])]
    assert len(load_trace(str(p), num_requests=1, duration_s=10)) == 1
    p.write_text('{"prompt_tokens": 0, "output_tokens": 5}\n')
    with pytest.raises(ValueError, match="line 1: prompt_tokens must be a positive integer"):
        load_trace(str(p), 10, 10)
    p.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        load_trace(str(p), 10, 10)


# ------------------------------------------------------------------------------------------- prompts
def test_prompts_have_exact_token_lengths_and_mixed_text():
    f = PromptFactory(seed=3)
    rng = random.Random(3)
    for n in [1, 2, 3, 7, 64, 500, 2000, 9999] + [rng.randint(1, 4000) for _ in range(40)]:
        assert f.count(f.text(n)) == n
        if n > f.chat_overhead:
            assert f.count_chat(f.chat(n)) == n
    text = f.text(3000)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text) and "def " in text and " the " in text
    with pytest.raises(ValueError):
        f.text(0)


# ------------------------------------------------------------------------------------------- analysis
def ok_record(i, prompt=20, completion=4, t0=0.0, **kw):
    u = [(prompt, k, prompt + k) for k in range(1, completion + 1)]
    r = RequestRecord(index=i, prompt_tokens_calc=prompt, max_tokens=completion, sent_at=t0, headers_at=t0 + 0.01,
                      first_token_at=t0 + 0.1, end_at=t0 + 0.1 + 0.02 * (completion - 1),
                      token_times=[t0 + 0.1 + 0.02 * k for k in range(completion)], status="ok", http_status=200,
                      request_id=f"r{i}", chunk_usages=u, streamed_tokens=completion, cached_tokens=0,
                      final_usage={"prompt_tokens": prompt, "completion_tokens": completion,
                                   "total_tokens": prompt + completion})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_latency_metrics_and_goodput():
    recs = [ok_record(i, t0=i * 0.5) for i in range(10)]
    recs.append(RequestRecord(index=10, status="http_error", http_status=429, error_code="rate_limit_exceeded",
                              sent_at=1.0, end_at=1.01))
    rep = analysis.analyse(recs, slos={"ttft_s": 0.2})
    lat = rep["latency"]
    assert lat["ttft_s"]["n"] == 10 and lat["ttft_s"]["p50"] == pytest.approx(0.1)
    assert lat["itl_s"]["mean"] == pytest.approx(0.02) and lat["tpot_s"]["p99"] == pytest.approx(0.02)
    assert lat["e2e_s"]["p90"] == pytest.approx(0.16)
    tp = rep["throughput"]
    assert tp["completed"] == 10 and tp["failed"] == 1 and tp["duration_s"] == pytest.approx(4.5 + 0.16)
    assert tp["goodput"] == pytest.approx(10 / 4.66) and tp["output_tokens"] == 40
    assert rep["errors"] == {"429 rate_limit_exceeded": 1}
    assert analysis.analyse(recs, slos={"ttft_s": 0.05})["throughput"]["good_requests"] == 0
    assert analysis.percentile([1, 2, 3, 4], 50) == 2.5


def test_price_check_compares_ledger_cost_and_usage_cost_with_the_listed_prices():
    from qwen_v3_calculator.billing import Prices

    prices = Prices.per_million("0.15", "0.6", "0.075", "0.0001")
    r = ok_record(0, cached_tokens=8)
    want = prices.cost_pico(20, 4, 8)  # 12 x 150,000 + 8 x 75,000 + 4 x 600,000 + 100,000,000 pico-dollars
    assert want == 12 * 150_000 + 8 * 75_000 + 4 * 600_000 + 100_000_000
    r.final_usage["cost"] = float("0.0001048")  # the JSON number the server sends: the exact decimal's text
    ledger = {"prompt_tokens": 20, "completion_tokens": 4, "cached_tokens": 8, "status": "stop", "cost_pico_usd": want}
    assert analysis.accounting_findings(r, ledger, True, prices=prices) == []
    checks = [m["check"] for m in analysis.accounting_findings(r, {**ledger, "cost_pico_usd": want + 1}, True,
                                                              prices=prices)]
    assert checks == ["ledger_cost"]
    r.final_usage["cost"] = 0.000105
    assert [m["check"] for m in analysis.accounting_findings(r, ledger, True, prices=prices)] == ["usage_cost"]
    del r.final_usage["cost"]
    assert [m["check"] for m in analysis.accounting_findings(r, ledger, True, prices=prices)] == ["usage_cost"]
    assert analysis.accounting_findings(r, ledger, True) == []  # without prices: not checked


def test_accounting_findings_catch_every_disagreement():
    assert analysis.accounting_findings(ok_record(0), {"prompt_tokens": 20, "completion_tokens": 4,
                                                       "cached_tokens": 0, "status": "length"}, True) == []
    checks = lambda r, led=None, chk=False: [m["check"] for m in analysis.accounting_findings(r, led, chk)]
    assert checks(ok_record(0, prompt_tokens_calc=21)) == ["prompt_tokens"]
    assert checks(ok_record(0, streamed_tokens=3)) == ["completion_tokens"]
    r = ok_record(0)
    r.chunk_usages[2] = (20, 1, 21)
    assert checks(r) == ["chunk_usage_not_monotonic"]
    r = ok_record(0)
    r.chunk_usages[-1] = (20, 3, 23)
    assert checks(r) == ["last_chunk_usage"]
    r = ok_record(0)
    r.chunk_tokens, r.token_ids_counted = [1, 1, 1, 1], True
    assert checks(r) == []
    r.chunk_tokens = [1, 2, 1, 0]  # a chunk carried two token ids but usage grew by one
    assert checks(r) == ["chunk_usage_delta", "chunk_usage_delta"]
    assert checks(ok_record(0, chunks_without_usage=2)) == ["chunk_usage_missing"]
    assert checks(ok_record(0), None, True) == ["ledger_missing"]
    assert checks(ok_record(0), {"prompt_tokens": 20, "completion_tokens": 5, "cached_tokens": 0,
                                 "status": "stop"}, True) == ["ledger_completion_tokens"]
    assert checks(ok_record(0, final_usage=None)) == ["final_usage_missing"]
    assert checks(RequestRecord(index=1, status="http_error")) == []


def hdr(rem_t, rem_r=100, lim_t=1000, lim_r=100):
    return {"x-ratelimit-remaining-tokens": str(rem_t), "x-ratelimit-remaining-requests": str(rem_r),
            "x-ratelimit-limit-tokens": str(lim_t), "x-ratelimit-limit-requests": str(lim_r)}


def denied(i, t, **kw):
    return RequestRecord(index=i, prompt_tokens_calc=20, max_tokens=4, sent_at=t, headers_at=t + 0.01, end_at=t + 0.01,
                         status="http_error", http_status=429, error_code="rate_limit_exceeded",
                         error_message="rate limit reached", **kw)


def test_header_honesty_flags_denials_the_headers_promised_and_overshoot():
    # the first response said 100 tokens remain; the next request costs 24 and nothing else ran: a lie
    a = ok_record(0, rate_headers=hdr(100))
    d = denied(1, 1.0, rate_headers=hdr(100))
    hh = analysis.header_honesty([a, d])
    assert hh["denials_checked"] == 1 and [v["index"] for v in hh["violations"]] == [1]
    # same, but four requests that could have been admitted in between reserved 4 x 24 = 96: honest
    between = [ok_record(i, t0=0.5, rate_headers=hdr(50)) for i in range(2, 6)]
    hh = analysis.header_honesty([a, *between, denied(1, 0.5)])
    assert hh["violations"] == []
    # a denial after a header that said it would not fit is fine; concurrency denials are not judged
    assert analysis.header_honesty([ok_record(0, rate_headers=hdr(10)), denied(1, 1.0)])["violations"] == []
    conc = denied(1, 1.0)
    conc.error_message = "this API key allows 2 concurrent requests; wait for one to finish"
    assert analysis.header_honesty([a, conc])["denials_checked"] == 0
    # overshoot: 50 admitted requests of 24 tokens within 60 s against a limit of 1000 tokens
    many = [ok_record(i, t0=i * 0.1, rate_headers=hdr(0)) for i in range(50)]
    ov = analysis.overshoot(many)
    assert ov["max_admitted_tokens"] == 1200 and ov["overshoot_tokens"] == 200 and ov["overshoot_requests"] == 0
    spread = [ok_record(i, t0=i * 10.0, rate_headers=hdr(0)) for i in range(50)]
    assert analysis.overshoot(spread)["overshoot_tokens"] == 0  # 6 per window


def test_report_table_json_and_png(tmp_path):
    recs = [ok_record(i, t0=i * 0.3, rate_headers=hdr(100)) for i in range(5)] + [denied(9, 1.0)]
    recs[1].prompt_tokens_calc = 19
    rep = analysis.analyse(recs, slos={"ttft_s": 1.0})
    text = report.table(rep)
    assert "TTFT" in text and "1 mismatches" in text and "prompt_tokens expected 19 got 20" in text
    assert "goodput (ttft ≤ 1000 ms)" in text and "429 rate_limit_exceeded × 1" in text
    report.write_json(rep, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["accounting"]["mismatches"][0]["check"] == "prompt_tokens"
    report.plot(rep, [r.ttft for r in recs if r.ttft], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- CLI
class FakeOpenAI:
    """A minimal streaming /v1/chat/completions server with a configurable fault (test double for unit tests;
    the e2e test runs TokenStorm against the real vLLM server)."""

    def __init__(self, fault=None, tpm=None, deny_at=None, template="qwen3", vocabulary="qwen3"):
        self.fault = fault
        self.deny_at = deny_at  # the n-th request (1-based) is denied although the quota has room
        self.seen = 0
        self.tpm_left = tpm
        self.lock = threading.Lock()
        self.counter = PromptFactory(template=template, model=vocabulary)
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":  # vLLM's: the count with the template the server renders
                    body = json.dumps({"count": outer.counter.count_chat(req["messages"])}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                outer.handle(self, req)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, h, req):
        prompt = self.counter.count_chat(req["messages"])
        n = req["max_tokens"]
        if self.fault == "prompt":
            prompt += 1
        headers = {"x-request-id": h.headers["X-Request-ID"]}
        if self.tpm_left is not None:
            with self.lock:
                cost = prompt + n
                self.seen += 1
                admit = self.tpm_left >= cost and self.seen != self.deny_at
                if admit:
                    self.tpm_left -= cost
                headers.update({"x-ratelimit-limit-tokens": "100000", "x-ratelimit-limit-requests": "1000",
                                "x-ratelimit-remaining-tokens": str(self.tpm_left),
                                "x-ratelimit-remaining-requests": "999"})
            if not admit:
                body = json.dumps({"error": {"message": "rate limit reached", "type": "tokens", "param": None,
                                             "code": "rate_limit_exceeded"}}).encode()
                h.send_response(429)
                for k, v in {**headers, "Content-Length": str(len(body)), "Retry-After": "1"}.items():
                    h.send_header(k, v)
                h.end_headers()
                h.wfile.write(body)
                return
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        sent = n - 1 if self.fault == "drop" else n
        for k in range(1, sent + 1):
            usage = {"prompt_tokens": prompt, "completion_tokens": k, "total_tokens": prompt + k}
            ch = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [1]}], "usage": usage}
            h.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        h.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("fault,check", [(None, None), ("prompt", "prompt_tokens"), ("drop", "completion_tokens")])
def test_cli_detects_accounting_faults(tmp_path, capsys, fault, check):
    srv = FakeOpenAI(fault)
    try:
        rc = token_storm.main(["--base-url", srv.url, "--model", "m", "--distribution", "fixed", "--input-len", "40",
                               "--output-len", "3", "--concurrency", "3", "--num-requests", "6", "--duration", "30",
                               "--output-dir", str(tmp_path), "--no-progress", "--no-plot", "--strict"])
    finally:
        srv.close()
    rep = json.loads((tmp_path / "token_storm.json").read_text())
    assert rep["throughput"]["completed"] == 6 and len(rep["records"]) == 6
    got = {m["check"] for m in rep["accounting"]["mismatches"]}
    if fault is None:
        assert rc == 0 and got == set()
    else:
        assert rc == 3 and check in got
    assert "accounting: 6 requests checked" in capsys.readouterr().out


@pytest.mark.parametrize("vocabulary,template", [("qwen3", "qwen3"), ("qwen3", "qwen3-reuse"), ("qwen3", "qwen2.5"),
                                                 ("qwen3.6", "qwen3.5")])
def test_template_is_detected_from_the_servers_tokenize(vocabulary, template):
    srv = FakeOpenAI(template=template, vocabulary=vocabulary)
    try:
        vocab, name, how = token_storm.detect_template(srv.url + "/v1", "m", None)
    finally:
        srv.close()
    assert (vocab, name) == (vocabulary, template) and "matches" in how
    vocab, name, how = token_storm.detect_template("http://127.0.0.1:9", "m", None)  # nothing listens there
    assert (vocab, name) == ("qwen3", "qwen3") and "did not answer" in how


def storm(srv, out, n, *extra):
    return token_storm.main(["--base-url", srv.url, "--model", "m", "--distribution", "fixed", "--input-len", "40",
                             "--output-len", "3", "--concurrency", "1", "--num-requests", str(n), "--duration", "30",
                             "--output-dir", str(out), "--no-progress", "--no-plot", "--strict", *extra])


@pytest.mark.parametrize("deny_at,violations", [(None, 0), (1, 0), (2, 1)])
def test_cli_detects_dishonest_rate_limit_headers(tmp_path, deny_at, violations):
    srv = FakeOpenAI(tpm=200, deny_at=deny_at)  # 43 tokens per request: 4 fit
    try:
        rc = storm(srv, tmp_path, 6)
    finally:
        srv.close()
    rep = json.loads((tmp_path / "token_storm.json").read_text())
    hh = rep["header_honesty"]
    assert len(hh["violations"]) == violations and rc == (3 if violations else 0)
    # deny_at=1: nothing was promised before the first request, so that denial is not a violation
    assert rep["errors"] == {"429 rate_limit_exceeded": 2} and rep["throughput"]["completed"] == 4
    assert hh["denials_checked"] == 2 - (deny_at == 1)
    assert hh["overshoot"]["overshoot_tokens"] == 0 and hh["overshoot"]["limit_tokens"] == 100000


def test_cli_rejects_unbounded_or_bad_arguments(capsys):
    for argv, msg in ((["--duration", "0"], "--duration must be > 0"), (["--num-requests", "0"], "--num-requests"),
                      (["--rate", "0"], "--rate must be > 0"), (["--distribution", "zipf"], "unknown distribution")):
        with pytest.raises(SystemExit) as ei:
            token_storm.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--max-model-len", "4096", *argv])
        assert ei.value.code == 2 and msg in capsys.readouterr().err
