"""What the engine computed for each HTTP request, joined from vLLM's own per-request counters (pure Python).

vLLM's output processor (in each API-server process) counts prompt and generated tokens per engine request;
those very counts feed its Prometheus counters ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``.
The glue in :mod:`qwen_vllm_ext.usage.engine_hooks` reports each engine request's opening and its final counts
(finished, aborted or failed) here, keyed by vLLM's external request id. The HTTP layer (the ledger middleware)
then collects every engine request of one HTTP request: the id itself (chat) or ``<id>-<i>`` (several prompts
in one completion request); parallel-sampling children share their parent's id.

Everything runs on the API server's event-loop thread: no locks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time


@dataclasses.dataclass
class EngineCounts:
    """Final counts of one engine request (one prompt, one sample)."""

    external_id: str
    prompt_tokens: int
    prefilled: bool  # vLLM counted the prompt (its first output arrived) before the request ended
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    arrival_time: float
    first_token_latency: float | None
    finished_at: float

    @property
    def engine_prompt_tokens(self) -> int:
        """Prompt tokens as ``vllm:prompt_tokens_total`` counted them (only once prefilled)."""
        return self.prompt_tokens if self.prefilled else 0


@dataclasses.dataclass
class RequestTotals:
    """One HTTP request's engine usage: what the ledger records."""

    prompt_tokens: int = 0
    engine_prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish: str | None = None  # "stop" | "length" | "abort" | "error" | None (never reached the engine)
    first_token_at: float | None = None
    parts: int = 0

    @classmethod
    def from_parts(cls, parts: list[EngineCounts]) -> "RequestTotals":
        totals = cls(parts=len(parts))
        seen_prompts: set[str] = set()
        for p in parts:
            if p.external_id not in seen_prompts:  # parallel samples share one prompt (usage counts it once)
                seen_prompts.add(p.external_id)
                totals.prompt_tokens += p.prompt_tokens
                totals.cached_tokens += p.cached_tokens
            totals.engine_prompt_tokens += p.engine_prompt_tokens
            totals.completion_tokens += p.completion_tokens
            if p.first_token_latency is not None:
                at = p.arrival_time + p.first_token_latency
                totals.first_token_at = at if totals.first_token_at is None else min(totals.first_token_at, at)
        reasons = {p.finish_reason for p in parts}
        for reason in ("abort", "error", "length", "stop"):
            if reason in reasons:
                totals.finish = reason
                break
        return totals


def _matches(external_id: str, request_id: str) -> bool:
    return external_id == request_id or (external_id.startswith(request_id) and external_id[len(request_id)] == "-")


class AccountBook:
    """Open engine requests and finished counts, waiting to be collected by the HTTP layer."""

    def __init__(self, retention_s: float = 600.0):
        self._open: dict[str, int] = {}  # external id -> engine requests still running
        self._done: dict[str, list[EngineCounts]] = {}
        self._changed: asyncio.Event | None = None  # created lazily, on the running loop
        self.retention_s = retention_s

    # ---- engine side (output processor hooks) ------------------------------------------------
    def engine_opened(self, external_id: str) -> None:
        self._open[external_id] = self._open.get(external_id, 0) + 1

    def engine_finished(self, counts: EngineCounts) -> None:
        left = self._open.get(counts.external_id, 0) - 1
        if left > 0:
            self._open[counts.external_id] = left
        else:
            self._open.pop(counts.external_id, None)
        self._done.setdefault(counts.external_id, []).append(counts)
        if self._changed is not None:
            self._changed.set()

    # ---- HTTP side ------------------------------------------------------------------------------
    def pending(self, request_id: str) -> bool:
        return any(_matches(e, request_id) for e in self._open)

    def collect(self, request_id: str) -> list[EngineCounts]:
        """Remove and return the finished counts of every engine request of ``request_id``."""
        keys = [e for e in self._done if _matches(e, request_id)]
        parts: list[EngineCounts] = []
        for key in keys:
            parts.extend(self._done.pop(key))
        return parts

    async def wait_settled(self, request_id: str, timeout: float) -> bool:
        """Wait until no engine request of ``request_id`` is still open (True), or ``timeout`` (False)."""
        deadline = time.monotonic() + timeout
        while self.pending(request_id):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    def expire(self, now: float | None = None) -> int:
        """Drop finished counts nobody collected for ``retention_s`` (requests not seen by the middleware)."""
        now = time.time() if now is None else now
        stale = [k for k, v in self._done.items() if all(now - p.finished_at > self.retention_s for p in v)]
        for k in stale:
            del self._done[k]
        return len(stale)


BOOK = AccountBook()
