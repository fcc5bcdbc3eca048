"""What a TokenStorm run measured (pure: records in, numbers and findings out).

* latency: TTFT, inter-token latency (gaps between chunks that carry tokens), time per output token
  ((end − first token) / (completion tokens − 1)), end-to-end latency — mean/p50/p90/p99;
* throughput (requests, output and total tokens per second) and goodput: requests/s that met every SLO given;
* errors by HTTP status and error code;
* accounting: calculator prompt count vs server ``prompt_tokens``; tokens streamed vs ``completion_tokens``;
  per-chunk usage present, monotonic, and the last choice chunk equal to the final usage; ledger record equal
  to the response usage (zero tolerance);
* header honesty: a 429 ``rate_limit_exceeded`` although the latest ``x-ratelimit-remaining-*`` seen before
  sending, minus what every request that could have been admitted in between reserved, said it fits; and the
  overshoot of the advertised limits (largest admitted cost in any 60 s window minus the limit).
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from decimal import Decimal
from typing import Any

from qwen_v3_calculator.billing import PICO

WINDOW_S = 60.0


@dataclasses.dataclass
class RequestRecord:
    index: int
    session: int = 0
    turn: int = 0
    prompt_tokens_target: int = 0
    prompt_tokens_calc: int = 0  # the calculator's count of the prompt actually sent
    max_tokens: int = 0
    n: int = 1  # parallel samples (TokenStorm --field-mix)
    scheduled_at: float = 0.0  # seconds from the run start
    sent_at: float | None = None
    headers_at: float | None = None
    first_token_at: float | None = None
    end_at: float | None = None
    token_times: list = dataclasses.field(default_factory=list)  # arrival of every chunk carrying tokens
    status: str = "pending"  # ok | http_error | stream_error | connection_error | protocol_error | cancelled
    http_status: int | None = None
    error_code: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    request_id: str | None = None
    chunk_usages: list = dataclasses.field(default_factory=list)  # (prompt, completion, total) of choice chunks
    chunks_without_usage: int = 0
    chunk_tokens: list = dataclasses.field(default_factory=list)  # token ids carried by each choice chunk
    token_ids_counted: bool = False  # True: streamed_tokens / chunk_tokens are token ids, not chunk counts
    final_usage: dict | None = None
    streamed_tokens: int = 0  # token ids (or token-carrying chunks) received, every choice
    first_choice_tokens: int = 0  # the same for choice 0 (what per-chunk usage counts when n > 1)
    cached_tokens: int | None = None
    rate_headers: dict = dataclasses.field(default_factory=dict)  # x-ratelimit-*, retry-after

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def completion_tokens(self) -> int:
        return int((self.final_usage or {}).get("completion_tokens") or 0)

    @property
    def prompt_tokens(self) -> int:
        return int((self.final_usage or {}).get("prompt_tokens") or 0)

    @property
    def ttft(self) -> float | None:
        if self.first_token_at is None or self.sent_at is None:
            return None
        return self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float | None:
        if self.end_at is None or self.sent_at is None:
            return None
        return self.end_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens
        if n < 2 or self.first_token_at is None or self.end_at is None:
            return None
        return (self.end_at - self.first_token_at) / (n - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("token_times")
        d.pop("chunk_tokens")
        d["chunk_usages"] = len(self.chunk_usages)
        d.update(ttft_s=self.ttft, e2e_s=self.e2e, tpot_s=self.tpot)
        return d


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float | None]:
    return {"n": len(values), "mean": (sum(values) / len(values)) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": max(values) if values else None}


def latency_metrics(records: list[RequestRecord]) -> dict[str, dict]:
    ok = [r for r in records if r.ok]
    return {
        "ttft_s": summary([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": summary([x for r in ok for x in r.itls]),
        "tpot_s": summary([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": summary([r.e2e for r in ok if r.e2e is not None]),
    }


def throughput(records: list[RequestRecord], slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Rates over the run's span: from the first send to the last end."""
    sent = [r.sent_at for r in records if r.sent_at is not None]
    ends = [r.end_at for r in records if r.end_at is not None]
    span = (max(ends) - min(sent)) if sent and ends else 0.0
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if meets_slos(r, slos or {})]
    rate = (lambda x: x / span if span > 0 else None)
    return {"duration_s": span, "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
            "request_throughput": rate(len(ok)), "output_token_throughput": rate(out_tokens),
            "total_token_throughput": rate(out_tokens + in_tokens), "input_tokens": in_tokens,
            "output_tokens": out_tokens, "slos": dict(slos or {}), "good_requests": len(good),
            "goodput": rate(len(good))}


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e}
    for name, limit in slos.items():
        v = values[name]
        if v is not None and v > limit:
            return False
        if v is None and name != "tpot_s":
            return False
    return True


def throughput_timeline(records: list[RequestRecord], bucket_s: float = 1.0) -> list[dict[str, float]]:
    """Output tokens and completed requests per ``bucket_s`` over the run (for the plot)."""
    if not records:
        return []
    end = max((r.end_at or 0.0) for r in records)
    n = int(end // bucket_s) + 1
    tokens = [0] * n
    done = [0] * n
    for r in records:
        for t in r.token_times:
            tokens[min(n - 1, int(t // bucket_s))] += 1
        if r.ok and r.end_at is not None:
            done[min(n - 1, int(r.end_at // bucket_s))] += 1
    return [{"t_s": i * bucket_s, "output_chunks_per_s": tokens[i] / bucket_s, "requests_per_s": done[i] / bucket_s}
            for i in range(n)]


def errors(records: list[RequestRecord]) -> dict[str, Any]:
    by = Counter()
    for r in records:
        if not r.ok:
            by[f"{r.http_status if r.http_status is not None else '-'} {r.error_code or r.status}"] += 1
    return dict(sorted(by.items()))


# ---------------------------------------------------------------------------------------------- accounting
def _usage_tuple(u: dict) -> tuple[int, int, int]:
    return (int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0), int(u.get("total_tokens") or 0))


def accounting_findings(r: RequestRecord, ledger_record: dict | None = None, check_ledger: bool = False,
                        expect_chunk_usage: bool = True, prices=None) -> list[dict]:
    """Mismatches of one successful request (empty list: everything agrees). ``prices``
    (``qwen_v3_calculator.billing.Prices``, as the server's listing publishes them): the ledger's cost must be the
    usage at those prices, exactly, and the final usage's ``cost`` the same amount."""
    if not r.ok:
        return []
    out = []

    def bad(kind, expected, got, detail=""):
        out.append({"index": r.index, "request_id": r.request_id, "check": kind, "expected": expected, "got": got,
                    **({"detail": detail} if detail else {})})

    u = r.final_usage
    if u is None:
        bad("final_usage_missing", "a usage object", None)
        return out
    if r.prompt_tokens_calc != r.prompt_tokens:
        bad("prompt_tokens", r.prompt_tokens_calc, r.prompt_tokens, "calculator count vs server prompt_tokens")
    if r.streamed_tokens != r.completion_tokens:
        bad("completion_tokens", r.streamed_tokens, r.completion_tokens, "tokens streamed vs server completion_tokens")
    p, c, t = _usage_tuple(u)
    if p + c != t:
        bad("total_tokens", p + c, t, "final usage total != prompt + completion")
    if expect_chunk_usage:
        if r.chunks_without_usage:
            bad("chunk_usage_missing", 0, r.chunks_without_usage, "choice chunks without usage")
        prev = None
        exact = r.token_ids_counted and len(r.chunk_tokens) == len(r.chunk_usages)
        for i, (cp, cc, ct) in enumerate(r.chunk_usages):
            if cp + cc != ct:
                bad("chunk_usage_total", cp + cc, ct, f"chunk {i}")
            if prev is not None and (cp != prev[0] or cc < prev[1] or ct < prev[2]):
                bad("chunk_usage_not_monotonic", prev, (cp, cc, ct), f"chunk {i}")
            elif exact and cc - (prev[1] if prev else 0) != r.chunk_tokens[i]:
                bad("chunk_usage_delta", r.chunk_tokens[i], cc - (prev[1] if prev else 0),
                    f"chunk {i}: token ids received vs increase of completion_tokens")
            prev = (cp, cc, ct)
        # n > 1: a chunk's usage counts its own choice's tokens; the final usage sums every choice
        last = (p, c, t) if r.n == 1 else (p, r.first_choice_tokens, p + r.first_choice_tokens)
        if prev is not None and prev != last:
            bad("last_chunk_usage", last, prev, "last choice chunk vs final usage" if r.n == 1 else
                "last chunk of choice 0 vs its tokens")
    if check_ledger:
        if ledger_record is None:
            bad("ledger_missing", r.request_id, None, "no ledger record for the response's x-request-id")
        else:
            cached = r.cached_tokens or 0
            for field, want in (("prompt_tokens", p), ("completion_tokens", c), ("cached_tokens", cached)):
                if ledger_record.get(field) != want:
                    bad(f"ledger_{field}", want, ledger_record.get(field), "ledger record vs response usage")
            if ledger_record.get("status") not in ("stop", "length"):
                bad("ledger_status", "stop|length", ledger_record.get("status"))
            if prices is not None:
                want = prices.cost_pico(p, c, cached)  # the check runs under a flat policy: exact, no rounding
                if ledger_record.get("cost_pico_usd") != want:
                    bad("ledger_cost", want, ledger_record.get("cost_pico_usd"), "ledger cost (pico-USD) vs usage x "
                        "listed prices")
                if u.get("cost") is None or Decimal(repr(u["cost"])) * PICO != want:
                    bad("usage_cost", want, u.get("cost"), "final usage cost (USD) vs usage x listed prices")
    return out


# ---------------------------------------------------------------------------------------------- header honesty
def _int_header(h: dict, name: str) -> int | None:
    v = h.get(name)
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def request_cost(r: RequestRecord) -> int:
    """What the gateway reserves against the token limit: the prompt once + max_tokens per sample."""
    return r.prompt_tokens_calc + r.n * r.max_tokens


def _is_limit_denial(r: RequestRecord) -> bool:
    """429 rate_limit_exceeded from an RPM/TPM limit (concurrency-slot denials carry no remaining header)."""
    return (r.http_status == 429 and r.error_code == "rate_limit_exceeded"
            and "concurrent" not in (r.error_message or ""))


def header_honesty(records: list[RequestRecord]) -> dict[str, Any]:
    """Denials that contradict an earlier ``x-ratelimit-remaining-*``; overshoot of the advertised limits.

    For a denied request D sent at ``s_D`` whose 429 arrived at ``h_D``: take the latest response H whose headers
    arrived before ``s_D``. Any admitted request J (other than H) with headers after H was sent and sent before
    ``h_D`` may have been admitted between H's snapshot and D's decision; its reservation (prompt + max_tokens,
    one request) is subtracted. Refunds and the sliding window only add room, so if the rest still fits D, the
    header promised room the limiter did not give: a violation.
    """
    seen = sorted((r for r in records if r.headers_at is not None and r.sent_at is not None
                   and _int_header(r.rate_headers, "x-ratelimit-remaining-tokens") is not None),
                  key=lambda r: r.headers_at)
    # anything not denied may have been admitted (a broken connection too): a superset keeps the check sound
    admitted = [r for r in records if not (r.http_status is not None and r.http_status >= 400)]
    violations, checked = [], 0
    for d in records:
        if not _is_limit_denial(d) or d.sent_at is None:
            continue
        h = None
        for r in seen:  # latest header before D was sent
            if r.headers_at < d.sent_at and r is not d:
                h = r
            elif r.headers_at >= d.sent_at:
                break
        if h is None:
            continue
        checked += 1
        rem_t = _int_header(h.rate_headers, "x-ratelimit-remaining-tokens")
        rem_r = _int_header(h.rate_headers, "x-ratelimit-remaining-requests")
        end_d = d.headers_at if d.headers_at is not None else d.end_at
        between = [j for j in admitted if j is not h and j is not d and j.sent_at is not None
                   and (j.headers_at or 0) > (h.sent_at or 0) and end_d is not None and j.sent_at < end_d]
        left_t = rem_t - sum(request_cost(j) for j in between)
        left_r = (rem_r - len(between)) if rem_r is not None else None
        if left_t >= request_cost(d) and (left_r is None or left_r >= 1):
            violations.append({"index": d.index, "request_id": d.request_id, "header_from": h.index,
                               "remaining_tokens": rem_t, "remaining_requests": rem_r,
                               "reserved_in_between": left_t - rem_t, "cost": request_cost(d),
                               "message": d.error_message})
    return {"denials_checked": checked, "violations": violations, "overshoot": overshoot(records)}


def overshoot(records: list[RequestRecord], window_s: float = WINDOW_S) -> dict[str, Any]:
    """Largest admitted tokens / requests in any ``window_s`` window vs the advertised limits (charged cost =
    the engine's actual prompt + completion, as the gateway reconciles it)."""
    lim_t = [v for r in records if (v := _int_header(r.rate_headers, "x-ratelimit-limit-tokens")) is not None]
    lim_r = [v for r in records if (v := _int_header(r.rate_headers, "x-ratelimit-limit-requests")) is not None]
    if not lim_t and not lim_r:
        return {"limit_tokens": None, "limit_requests": None}
    adm = sorted(((r.headers_at, r.prompt_tokens + r.completion_tokens) for r in records
                  if r.ok and r.headers_at is not None), key=lambda x: x[0])
    best_t = best_r = 0
    j = acc = 0
    for i, (t, cost) in enumerate(adm):
        acc += cost
        while adm[j][0] <= t - window_s:
            acc -= adm[j][1]
            j += 1
        best_t, best_r = max(best_t, acc), max(best_r, i - j + 1)
    limit_t = min(lim_t) if lim_t else None
    limit_r = min(lim_r) if lim_r else None
    return {"window_s": window_s, "limit_tokens": limit_t, "max_admitted_tokens": best_t,
            "overshoot_tokens": max(0, best_t - limit_t) if limit_t is not None else None,
            "limit_requests": limit_r, "max_admitted_requests": best_r,
            "overshoot_requests": max(0, best_r - limit_r) if limit_r is not None else None}


def analyse(records: list[RequestRecord], slos: dict | None = None, ledger: dict | None = None,
            check_ledger: bool = False, expect_chunk_usage: bool = True, prices=None) -> dict[str, Any]:
    """The whole report as one JSON-able dict. ``ledger``: request id → ledger record dict."""
    mismatches = []
    for r in records:
        rec = (ledger or {}).get(r.request_id) if r.request_id else None
        mismatches.extend(accounting_findings(r, rec, check_ledger, expect_chunk_usage, prices))
    return {
        "latency": latency_metrics(records),
        "throughput": throughput(records, slos),
        "errors": errors(records),
        "accounting": {"checked_requests": sum(1 for r in records if r.ok), "ledger_checked": check_ledger,
                       "prices_checked": prices is not None,
                       "mismatches": mismatches},
        "header_honesty": header_honesty(records),
        "timeline": throughput_timeline(records),
    }
