"""What the engine computed for each HTTP request, joined from vLLM's own per-request counters (pure Python).

vLLM's output processor (in each API-server process) counts prompt and generated tokens per engine request;
those very counts feed its Prometheus counters ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``.
The glue in :mod:`qwen_vllm_ext.usage.engine_hooks` reports each engine request's opening and its final counts
(finished, aborted or failed) here, keyed by the HTTP request that created it. The ledger middleware sets
:data:`CURRENT_HTTP_REQUEST` (a context variable) before calling the app; vLLM adds its engine requests from
inside that request's tasks, which inherit the context, so every engine request (one per prompt, one per
parallel sample) is attributed to its HTTP request without matching id strings.

Everything runs on the API server's event-loop thread: no locks.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import time
from collections.abc import Callable

CURRENT_HTTP_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("qwen_http_request", default=None)


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
    reasoning_tokens: int = 0  # generated tokens inside a reasoning block (reasoning_tokens())

    @property
    def engine_prompt_tokens(self) -> int:
        """Prompt tokens as ``vllm:prompt_tokens_total`` counted them (only once prefilled)."""
        return self.prompt_tokens if self.prefilled else 0


class ReasoningCounter:
    """Generated tokens inside a reasoning block, exactly: a block opens at the ``start`` marker (``<think>``) and
    closes at ``end`` (``</think>``); markers themselves are not counted. A prompt whose last marker is ``start``
    (the Qwen3.5/3.6 template's generation prompt ends with ``<think>\\n`` when thinking is on) leaves the block
    open, so everything generated before ``</think>`` is reasoning. ``feed`` takes the ids as they arrive."""

    __slots__ = ("start", "end", "open", "count", "history")

    def __init__(self, start: int | None, end: int | None, prompt_ids=(), keep_history: bool = False):
        self.start, self.end, self.count = start, end, 0
        self.open = False
        self.history: list[int] | None = [0] if keep_history else None  # count after each fed token
        if start is not None and end is not None:
            self.open = _block_open(prompt_ids, start, end)

    def feed(self, ids) -> int:
        for tok in ids:  # without markers (None) no id matches and the block never opens
            if tok == self.end:
                self.open = False
            elif tok == self.start:
                self.open = True
            elif self.open:
                self.count += 1
            if self.history is not None:
                self.history.append(self.count)
        return self.count

    def at(self, n: int) -> int:
        """The count after the first ``n`` fed tokens (``keep_history``): a streamed chunk reports the tokens sent
        so far, which may trail the tokens the engine has already produced."""
        if self.history is None:
            raise ValueError("ReasoningCounter(keep_history=True) is needed for at()")
        return self.history[max(0, min(n, len(self.history) - 1))]


def _block_open(prompt_ids, start: int, end: int) -> bool:
    """Whether the prompt's last reasoning marker opens a block: searched in the last 64 ids first (templates put it
    in the generation prompt), the whole prompt only when the tail has neither; C-level list operations only."""
    ids = prompt_ids if isinstance(prompt_ids, (list, tuple)) else list(prompt_ids or ())
    lo = max(0, len(ids) - 64)
    while True:
        seg = ids[lo:]
        if start in seg or end in seg:
            rev = seg[::-1]
            s = rev.index(start) if start in seg else len(seg)  # distance from the end (smaller: later)
            e = rev.index(end) if end in seg else len(seg)
            return s < e
        if lo == 0:
            return False
        lo = 0


def reasoning_tokens(prompt_ids, output_ids, start: int | None, end: int | None) -> int:
    """Reasoning tokens of one generated sequence (see :class:`ReasoningCounter`). Runs for every finished request
    on the API server's event loop: the common cases (no marker generated) take no Python loop over the ids."""
    if start is None or end is None:
        return 0
    counter = ReasoningCounter(start, end, prompt_ids)
    if start not in output_ids and end not in output_ids:
        return len(output_ids) if counter.open else 0
    return counter.feed(output_ids)


@dataclasses.dataclass
class RequestTotals:
    """One HTTP request's engine usage: what the ledger records."""

    prompt_tokens: int = 0
    engine_prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
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
            totals.reasoning_tokens += p.reasoning_tokens
            if p.first_token_latency is not None:
                at = p.arrival_time + p.first_token_latency
                totals.first_token_at = at if totals.first_token_at is None else min(totals.first_token_at, at)
        reasons = {p.finish_reason for p in parts}
        for reason in ("abort", "error", "length", "stop"):
            if reason in reasons:
                totals.finish = reason
                break
        return totals


class AccountBook:
    """Open engine requests and finished counts, waiting to be collected by the HTTP layer."""

    def __init__(self, retention_s: float = 600.0):
        self._open: dict[str, int] = {}  # HTTP request key -> engine requests still running
        self._done: dict[str, list[EngineCounts]] = {}  # HTTP request key -> finished engine requests
        self._changed: asyncio.Event | None = None  # created lazily, on the running loop
        self._on_open: dict[str, Callable[[], None]] = {}  # HTTP request key -> called at its first engine request
        self.retention_s = retention_s

    # ---- engine side (output processor hooks) ------------------------------------------------
    def engine_opened(self, key: str) -> None:
        self._open[key] = self._open.get(key, 0) + 1
        callback = self._on_open.pop(key, None)
        if callback is not None:
            callback()

    def engine_finished(self, key: str, counts: EngineCounts) -> None:
        left = self._open.get(key, 0) - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)
        self._done.setdefault(key, []).append(counts)
        if self._changed is not None:
            self._changed.set()

    # ---- HTTP side ------------------------------------------------------------------------------
    def on_open(self, key: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the first engine request of ``key`` is added (see :meth:`forget_open`)."""
        self._on_open[key] = callback

    def forget_open(self, key: str) -> Callable[[], None] | None:
        """The HTTP request ended: drop its callback if no engine request was ever added (and return it)."""
        return self._on_open.pop(key, None)

    def pending(self, key: str) -> bool:
        return key in self._open

    def collect(self, key: str) -> list[EngineCounts]:
        """Remove and return the finished counts of every engine request of the HTTP request ``key``."""
        return self._done.pop(key, [])

    async def wait_settled(self, key: str, timeout: float) -> bool:
        """Wait until no engine request of ``key`` is still open (True), or ``timeout`` (False)."""
        deadline = time.monotonic() + timeout
        while self.pending(key):
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
