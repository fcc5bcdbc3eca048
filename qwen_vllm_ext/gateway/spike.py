"""Spike breaker: suspend a key whose 15-minute usage jumps far above its baseline.

After each recorded request the key's billed usage over the last 15 minutes (a sliding window in the limiter,
so every API-server process and replica sees the same sum) is compared with ``spike_factor`` x its baseline:
the key's average 15-minute usage over the previous UTC day (the ledger's exact per-key daily aggregate: one
indexed read, never a scan of records), floored at
``spike_min_units``. Above it the key is suspended for ``spike_cooldown_s`` (the suspension reaches every
process within a second, like a revocation), a warning is logged, ``qwen_ext_keys_suspended_total`` is
incremented and, if configured, ``spike_webhook`` receives a JSON POST.
"""
from __future__ import annotations

import json
import logging
import time
import urllib.request

logger = logging.getLogger("qwen_vllm_ext.gateway")

WINDOW_S = 900.0
BASELINE_S = 24 * 3600.0
UNBOUNDED = 1 << 52  # the spike window only sums, never denies (exact in Redis Lua doubles)


class SpikeBreaker:
    def __init__(self, settings, limiter, key_store, ledger_store, counter=None, clock=time.time):
        """``ledger_store``: the usage ledger store, or a zero-argument function returning it."""
        self.factor = settings.spike_factor
        self.floor_micro = int(settings.spike_min_units * 1_000_000)
        self.cooldown_s = settings.spike_cooldown_s
        self.webhook = settings.spike_webhook
        self.limiter, self.key_store, self.ledger_store = limiter, key_store, ledger_store
        self.counter = counter
        self.clock = clock
        self._baselines: dict[str, tuple[float, int]] = {}
        self._suspended: dict[str, float] = {}  # key id -> until: suspend (log, webhook) once per spike

    def baseline_micro(self, key_id: str) -> int:
        """Average billed micro-units per 15 minutes over the previous UTC day (cached 60 s)."""
        now = self.clock()
        cached = self._baselines.get(key_id)
        if cached and now - cached[0] < 60:
            return cached[1]
        store = self.ledger_store() if callable(self.ledger_store) else self.ledger_store
        yesterday = time.strftime("%Y-%m-%d", time.gmtime(now - BASELINE_S))
        value = int(store.daily(key_id, yesterday)["billed_micro"] * WINDOW_S / BASELINE_S)
        self._baselines[key_id] = (now, value)
        return value

    def check(self, key, billed_micro: int) -> bool:
        """Add this request's cost to the key's window; suspend the key on a spike. Returns True if suspended."""
        name = f"spike:{key.key_id}"
        decision = self.limiter.reserve([(name, UNBOUNDED, WINDOW_S, billed_micro)])
        used = UNBOUNDED - decision.descriptors[name].remaining
        threshold = self.factor * max(self.baseline_micro(key.key_id), self.floor_micro)
        if used <= threshold or self._suspended.get(key.key_id, 0.0) > self.clock():
            return False  # no spike, or this spike already suspended the key (requests still in flight)
        until = self.clock() + self.cooldown_s
        self._suspended[key.key_id] = until
        reason = (f"usage spike: {used / 1e6:.2f} billed units in 15 min > {self.factor:g}x baseline "
                  f"({threshold / self.factor / 1e6:.2f})")
        self.key_store.suspend(key.key_id, until, reason)
        logger.warning("qwen-vllm-ext gateway: key %s suspended until %s: %s", key.key_id,
                       time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until)), reason)
        if self.counter is not None:
            self.counter.inc()
        if self.webhook:
            self._notify({"event": "key_suspended", "key_id": key.key_id, "name": key.name, "until": until,
                          "reason": reason, "window_units": used / 1e6})
        return True

    def _notify(self, payload: dict) -> None:
        request = urllib.request.Request(self.webhook, data=json.dumps(payload).encode(),
                                         headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=5).close()
        except OSError as exc:
            logger.error("qwen-vllm-ext gateway: spike webhook %s failed: %s", self.webhook, exc)

    def observe_sync(self, key, record) -> bool:
        """Run the check for a recorded request (blocking: call it on a worker thread). True if suspended."""
        if self.factor <= 0 or record.billed_total_micro <= 0:
            return False
        return self.check(key, record.billed_total_micro)
