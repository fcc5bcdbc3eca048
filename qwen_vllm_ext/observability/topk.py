"""Bounded per-key counts for ``/metrics``: amounts per key over a sliding window, exported as the top ``n`` keys
plus one ``other`` series (pure; the window is kept in per-slot buckets, memory ~ keys active in the window)."""
from __future__ import annotations

import threading
from collections import Counter

OTHER = "other"


class WindowedTopK:
    """``add(key, amount, now)``; ``top(now)`` -> ``{key: amount}`` for the ``n`` largest keys in the last
    ``window_s`` seconds and ``OTHER`` for the rest (present only when there is a rest). Thread-safe."""

    def __init__(self, n: int, window_s: float, slots: int = 10) -> None:
        if n < 1 or window_s <= 0 or slots < 1:
            raise ValueError("n >= 1, window_s > 0 and slots >= 1 are required")
        self.n, self.window_s = n, window_s
        self._slot_s = window_s / slots
        self._buckets: dict[int, Counter[str]] = {}
        self._lock = threading.Lock()

    def _expire(self, now: float) -> int:
        current = int(now // self._slot_s)
        oldest = current - int(round(self.window_s / self._slot_s)) + 1
        for slot in [s for s in self._buckets if s < oldest]:
            del self._buckets[slot]
        return current

    def add(self, key: str | None, amount: float, now: float) -> None:
        if amount <= 0:
            return
        key = "" if key is None else str(key)
        with self._lock:
            slot = self._expire(now)
            self._buckets.setdefault(slot, Counter())[key] += amount

    def top(self, now: float) -> dict[str, float]:
        with self._lock:
            self._expire(now)
            total: Counter[str] = Counter()
            for bucket in self._buckets.values():
                total.update(bucket)
        ranked = sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))
        out = dict(ranked[:self.n])
        rest = sum(v for _, v in ranked[self.n:])
        if rest:
            out[OTHER] = out.get(OTHER, 0) + rest
        return out
