"""Stratified access log: JSON lines that keep the expensive failures (pure Python; a writer thread).

A uniform 1% sample of an access log loses exactly the requests that matter: the rare long, failing,
token-heavy ones. Strata (rates configurable):

* ``error``: every response with HTTP status >= 400 or a non-normal finish (disconnect, abort) — rate 1.0;
* ``slow``: successful responses slower than ``slow_s`` — rate ``slow_rate`` (default 10%);
* ``normal``: the rest — rate ``rate`` (default 1%).

Each line carries its stratum and ``sample_weight`` (1 / rate), so totals are reconstructed as
``sum(weight x value)``. Sampling is a deterministic function of the request id (reproducible). No API keys
and no prompt text are written: only ids, counts, timings and the calculator's pre-admission token estimate.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import queue
import threading


@dataclasses.dataclass(frozen=True)
class StratifiedSampler:
    slow_s: float = 5.0
    slow_rate: float = 0.1
    rate: float = 0.01
    error_rate: float = 1.0

    def __post_init__(self):
        for name in ("slow_rate", "rate", "error_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"access log {name} must be within [0, 1], got {value}")

    def stratum(self, http_status: int, status: str, latency_s: float) -> tuple[str, float]:
        if http_status >= 400 or status not in ("stop", "length"):
            return "error", self.error_rate
        if latency_s > self.slow_s:
            return "slow", self.slow_rate
        return "normal", self.rate

    @staticmethod
    def draw(request_id: str) -> float:
        """A uniform number in [0, 1) derived from the request id."""
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64

    def decide(self, request_id: str, http_status: int, status: str, latency_s: float) -> tuple[str, float] | None:
        """(stratum, rate) when this response is logged, else None."""
        stratum, rate = self.stratum(http_status, status, latency_s)
        return (stratum, rate) if rate > 0 and self.draw(request_id) < rate else None


def estimate_prompt_tokens(body: dict, calculator) -> int | None:
    """The calculator's count of the request's prompt (chat template included), or None if not countable."""
    try:
        if isinstance(body.get("messages"), list):
            return calculator.count_chat(body["messages"], tools=body.get("tools"),
                                         **(body.get("chat_template_kwargs") or {}))
        if isinstance(body.get("prompt"), str):
            return calculator.count_tokens(body["prompt"])
    except (TypeError, ValueError):
        return None
    return None


class AccessLog:
    """Writes sampled lines to ``path`` from a background thread (the event loop never blocks on disk)."""

    def __init__(self, path: str, sampler: StratifiedSampler, calculator=None):
        self.path = path
        self.sampler = sampler
        self.calculator = calculator
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="qwen-access-log", daemon=True)
        self._thread.start()

    def log(self, record, body: dict) -> bool:
        decision = self.sampler.decide(record.request_id, record.http_status, record.status, record.latency_s)
        if decision is None:
            return False
        stratum, rate = decision
        line = {
            "ts": record.finished_at, "request_id": record.request_id, "api_key_id": record.api_key_id,
            "model": record.model, "endpoint": record.endpoint, "http_status": record.http_status,
            "status": record.status, "streamed": record.streamed, "latency_s": round(record.latency_s, 6),
            "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 6),
            "estimate_prompt_tokens": estimate_prompt_tokens(body, self.calculator) if self.calculator else None,
            "prompt_tokens": record.prompt_tokens, "cached_tokens": record.cached_tokens,
            "completion_tokens": record.completion_tokens, "billed_micro": record.billed_total_micro,
            "stratum": stratum, "sample_weight": 1.0 / rate,
        }
        self._queue.put(json.dumps(line, ensure_ascii=False))
        return True

    def _run(self) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            while True:
                item = self._queue.get()
                if item is None:
                    fh.flush()
                    return
                fh.write(item + "\n")
                if self._queue.empty():
                    fh.flush()

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
