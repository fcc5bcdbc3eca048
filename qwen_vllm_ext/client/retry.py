"""Retry policy: exponential backoff with jitter that honours ``Retry-After`` and ``x-ratelimit-reset-*``.

Pure logic (no I/O, injectable random source) shared by the sync and async clients.
"""
from __future__ import annotations

import dataclasses
import email.utils
import random
import re
import time

from .errors import (APIConnectionError, APIError, InsufficientQuotaError, ServerError, StreamError)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def parse_duration(value: str | None) -> float | None:
    """OpenAI's reset format (``1s``, ``6m0s``, ``1h2m3.5s``, ``250ms``) or plain seconds → seconds; None if bad."""
    if value is None:
        return None
    v = value.strip()
    if not v:
        return None
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _DURATION.finditer(v):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]
        pos = m.end()
    return total if pos == len(v) and pos > 0 else None


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After``: delta seconds or an HTTP date → seconds to wait (≥ 0); None when absent or unparsable."""
    if value is None:
        return None
    v = value.strip()
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


@dataclasses.dataclass
class RetryPolicy:
    """When and how long to wait before the next attempt.

    * ``max_retries`` attempts after the first one (0: never retry);
    * backoff ``initial_backoff_s × multiplier^n`` capped at ``max_backoff_s``, with jitter: the wait is drawn
      uniformly from ``[(1 − jitter) × backoff, backoff]``;
    * a server-given wait (``Retry-After``, else the ``x-ratelimit-reset-*`` of the exhausted limit) replaces the
      backoff and is never shortened (jitter only adds up to ``jitter × 10%`` on top); a server wait above
      ``max_server_wait_s`` is not waited for: the error is raised;
    * never retried: ``insufficient_quota``, 4xx other than 408/409/429, errors after a stream started.
    """

    max_retries: int = 3
    initial_backoff_s: float = 0.5
    multiplier: float = 2.0
    max_backoff_s: float = 20.0
    jitter: float = 0.5
    max_server_wait_s: float = 60.0
    retry_statuses: frozenset = RETRY_STATUSES
    rng: random.Random = dataclasses.field(default_factory=random.Random, repr=False)

    def __post_init__(self):
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be within [0, 1]")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoff values must be >= 0 and multiplier >= 1")

    def retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, InsufficientQuotaError) or isinstance(exc, StreamError):
            return False
        if isinstance(exc, APIError):
            return not exc.mid_stream and (exc.status_code in self.retry_statuses or isinstance(exc, ServerError))
        return isinstance(exc, APIConnectionError)

    def server_wait(self, exc: BaseException) -> float | None:
        """The wait the server asked for, if any."""
        if not isinstance(exc, APIError):
            return None
        wait = parse_retry_after(exc.headers.get("retry-after"))
        if wait is not None:
            return wait
        if exc.status_code != 429:
            return None
        resets = {k: parse_duration(exc.headers.get(f"x-ratelimit-reset-{k}")) for k in ("requests", "tokens")}
        if exc.type in resets and resets[exc.type] is not None:
            return resets[exc.type]
        known = [v for v in resets.values() if v is not None]
        return max(known) if known else None

    def backoff(self, retry_number: int) -> float:
        """Jittered exponential backoff before retry ``retry_number`` (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry_number - 1))
        return self.rng.uniform((1.0 - self.jitter) * base, base)

    def delay(self, retry_number: int, exc: BaseException) -> float | None:
        """Seconds to wait before retry ``retry_number`` after ``exc``, or None: do not retry, raise ``exc``."""
        if retry_number > self.max_retries or not self.retryable(exc):
            return None
        wait = self.server_wait(exc)
        if wait is None:
            return self.backoff(retry_number)
        if wait > self.max_server_wait_s:
            return None
        return wait + self.rng.uniform(0.0, 0.1 * self.jitter * max(wait, 0.1))


NO_RETRIES = RetryPolicy(max_retries=0)
