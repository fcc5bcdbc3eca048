"""Capacity 429s: refuse at admission a request that would wait in the engine's queue longer than a bound (pure).

The aggregator's provider guide asks for "early 429s if under load, rather than queueing requests"
(https://openrouter.ai/docs/guides/providers/integration): a 429 lets it fail over at once, and OpenRouter tracks
429s apart from the errors its uptime counts. Expected wait of a new request = the backlog / the drain rate:

* backlog -- prompt tokens of this API server's engine requests that have not produced their first output (vLLM's
  own ``get_num_queued_tokens()``: the requests in prefill, queued or running), read at admission, plus the prompt
  tokens of requests admitted here that vLLM has not added yet (rendering, tokenizing: a burst arrives all at once);
* drain rate -- prompt tokens the engine finished per second of *busy* time (time during which the backlog was not
  empty), measured over a sliding window from the ledger's records of this process (``engine_prompt_tokens``). Both
  sides count whole prompts, cached tokens included, so the prefix cache's share cancels out.

Neither depends on which scheduler runs. Until the window holds ``min_busy_s`` of busy time nothing is refused
(no measurement, no guess). ``Retry-After`` is the time the measured rate needs to bring the backlog under the bound.
"""
from __future__ import annotations

import collections
import math
import time


class DrainRate:
    """Prompt tokens finished per busy second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0, min_busy_s: float = 2.0, clock=time.monotonic):
        self.window_s, self.min_busy_s, self.clock = window_s, min_busy_s, clock
        self._events: collections.deque = collections.deque()  # (t, tokens, busy seconds credited)
        self._last_t: float | None = None
        self._last_backlog = 0
        self._tokens = 0
        self._busy = 0.0

    def observe(self, backlog_tokens: int, finished_tokens: int = 0) -> None:
        """A sample: the backlog now, and the prompt tokens of a request that just finished (0 at admissions)."""
        now = self.clock()
        busy = (now - self._last_t) if (self._last_t is not None and self._last_backlog > 0) else 0.0
        self._last_t, self._last_backlog = now, backlog_tokens
        if busy or finished_tokens:
            self._events.append((now, finished_tokens, busy))
            self._tokens += finished_tokens
            self._busy += busy
        while self._events and self._events[0][0] < now - self.window_s:
            _, tokens, b = self._events.popleft()
            self._tokens -= tokens
            self._busy -= b

    def rate(self) -> float | None:
        """Tokens per busy second, or None before ``min_busy_s`` of busy time was seen in the window."""
        if self._busy < self.min_busy_s or self._tokens <= 0:
            return None
        return self._tokens / self._busy


class Backlog:
    """The admission check: ``verdict()`` is None (admit) or the ``Retry-After`` and expected wait of a 429."""

    def __init__(self, max_wait_s: float, queued_tokens, rate: DrainRate | None = None, on_wait=None):
        self.max_wait_s = max_wait_s
        self.queued_tokens = queued_tokens  # () -> int: vLLM's backlog, read at each admission
        self.rate = rate or DrainRate()
        self.on_wait = on_wait  # (expected wait seconds) -> None: the gauge
        self.pending = 0  # prompt tokens admitted and not yet added to the engine

    def backlog(self) -> int:
        return int(self.queued_tokens()) + self.pending

    def admitted(self, prompt_tokens: int):
        """An admitted request on its way to the engine; call the returned function once vLLM has added it."""
        self.pending += prompt_tokens
        done = False

        def started() -> None:
            nonlocal done
            if not done:
                done = True
                self.pending -= prompt_tokens

        return started

    def expected_wait(self) -> tuple[float | None, int]:
        backlog = self.backlog()
        self.rate.observe(backlog)
        rate = self.rate.rate()
        wait = None if rate is None else backlog / rate
        if self.on_wait is not None and wait is not None:
            self.on_wait(wait)
        return wait, backlog

    def verdict(self) -> tuple[int, float] | None:
        """None to admit; else (Retry-After seconds, expected wait seconds)."""
        wait, _ = self.expected_wait()
        if wait is None or wait <= self.max_wait_s:
            return None
        return max(1, math.ceil(wait - self.max_wait_s)), wait

    def finished(self, engine_prompt_tokens: int) -> None:
        """A request's ledger record: its prompt tokens left the queue."""
        self.rate.observe(self.backlog(), engine_prompt_tokens)
