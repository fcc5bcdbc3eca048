"""Spike breaker: suspend a key whose use runs away from its own history, never one doing what it may do.

**Runaway** (what suspends a key): its billed units over the last 15 minutes (a sliding window in the limiter, so
every API-server process and replica sees the same sum) exceed the **threshold**

    max(spike_factor x baseline, floor, allowance)

* ``baseline`` -- the key's average billed units per 15 minutes over the previous UTC day (the ledger's exact
  per-key daily aggregate: one indexed read, cached 60 s);
* ``floor`` -- ``spike_min_units``, or with 0 (the default) ``SPIKE_FLOOR_REQUESTS`` x the most one request can cost
  on this server (``BillingPolicy.max_request_units`` at the served context length): one request of the largest
  size, or a few, never reach it;
* ``allowance`` -- what the key's own limits let it use in 15 minutes (``tpm`` tokens a minute at the priciest
  units per token, or ``rpm`` requests of the largest size; the smaller of the two when both are set): a burst the
  key's limits allow is not a spike, its limits already bound it.

**Never checked**: a key created exempt (``spike_breaker: false``; ``keys create --no-spike-breaker``: an
aggregator's key, which carries all of a provider's traffic), and a key without a full previous UTC day of
history (created after the start of yesterday, UTC): with no baseline there is nothing to run away from, and its
limits and budgets bound it meanwhile.

Above the threshold the key is suspended for ``spike_cooldown_s`` (the suspension reaches every process within a
second, like a revocation; the request that crossed it has already run, the next ones get 403
``api_key_suspended`` with the time it lifts), a warning is logged, ``qwen_ext_keys_suspended_total`` is
incremented and, if configured, ``spike_webhook`` receives a JSON POST. ``keys update KEY --unsuspend`` (or
``PATCH /qwen_ext/admin/keys/{id}`` with ``suspended_until: null``) lifts it early.
"""
from __future__ import annotations

import calendar
import json
import logging
import time
import urllib.request

logger = logging.getLogger("qwen_vllm_ext.gateway")

WINDOW_S = 900.0
BASELINE_S = 24 * 3600.0
UNBOUNDED = 1 << 52  # the spike window only sums, never denies (exact in Redis Lua doubles)
SPIKE_FLOOR_REQUESTS = 4
"""The default floor: this many requests of the largest size the server accepts, in 15 minutes."""
MICRO = 1_000_000


def previous_day_start(now: float) -> float:
    """Unix time of 00:00 UTC of the day before ``now``'s UTC day."""
    day = time.gmtime(now - BASELINE_S)
    return float(calendar.timegm((day.tm_year, day.tm_mon, day.tm_mday, 0, 0, 0)))


class SpikeBreaker:
    def __init__(self, settings, limiter, key_store, ledger_store, counter=None, clock=time.time):
        """``ledger_store``: the usage ledger store, or a zero-argument function returning it. The engine's
        context length comes later (:meth:`served`): until then the default floor is unknown and no key is
        checked."""
        self.factor = settings.spike_factor
        self.floor_setting_micro = int(settings.spike_min_units * MICRO)
        self.cooldown_s = settings.spike_cooldown_s
        self.webhook = settings.spike_webhook
        self.limiter, self.key_store, self.ledger_store = limiter, key_store, ledger_store
        self.context_length: int | None = None
        self.max_request_micro: int | None = None  # the most one request can cost on this server
        self.counter = counter
        self.clock = clock
        self._baselines: dict[str, tuple[float, int]] = {}
        self._suspended: dict[str, float] = {}  # key id -> until: suspend (log, webhook) once per spike

    # ------------------------------------------------------------------------------------------ the rule
    def floor_micro(self) -> int:
        """``spike_min_units``, or SPIKE_FLOOR_REQUESTS requests of the largest size (0 while unknown: then the
        breaker waits, see :meth:`checked`)."""
        if self.floor_setting_micro > 0:
            return self.floor_setting_micro
        return SPIKE_FLOOR_REQUESTS * self.max_request_micro if self.max_request_micro else 0

    def allowance_micro(self, key) -> int:
        """The most the key's own rpm/tpm let it bill in WINDOW_S (0: no limit set, or the server's size unknown)."""
        biggest, context = self.max_request_micro, self.context_length
        if not biggest:
            return 0
        minutes = WINDOW_S / 60
        bounds = []
        if getattr(key, "rpm", None):
            bounds.append(int(key.rpm * minutes) * biggest)
        if getattr(key, "tpm", None) and context:
            bounds.append(int(key.tpm * minutes * biggest / context))  # the priciest units per token
        return min(bounds) if bounds else 0

    def threshold_micro(self, key) -> int:
        return max(int(self.factor * self.baseline_micro(key.key_id)), self.floor_micro(), self.allowance_micro(key))

    def checked(self, key) -> bool:
        """Whether the breaker watches this key: on, not exempt, with a previous day of history, and the server's
        largest request known (the default floor depends on it)."""
        if self.factor <= 0 or getattr(key, "spike_breaker", True) is False:
            return False
        created = getattr(key, "created_at", None)
        if created is None or created > previous_day_start(self.clock()):
            return False
        return self.floor_micro() > 0

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
        threshold = self.threshold_micro(key)
        if used <= threshold or self._suspended.get(key.key_id, 0.0) > self.clock():
            return False  # no spike, or this spike already suspended the key (requests still in flight)
        until = self.clock() + self.cooldown_s
        self._suspended[key.key_id] = until
        baseline = self.baseline_micro(key.key_id)
        reason = (f"usage spike: {used / MICRO:.2f} billed units in 15 min > threshold {threshold / MICRO:.2f} "
                  f"(max of {self.factor:g}x the previous day's 15-min average {baseline / MICRO:.2f}, the floor "
                  f"{self.floor_micro() / MICRO:.2f} and what the key's limits allow "
                  f"{self.allowance_micro(key) / MICRO:.2f})")
        self.key_store.suspend(key.key_id, until, reason)
        logger.warning("qwen-vllm-ext gateway: key %s suspended until %s: %s", key.key_id,
                       time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until)), reason)
        if self.counter is not None:
            self.counter.inc()
        if self.webhook:
            self._notify({"event": "key_suspended", "key_id": key.key_id, "name": key.name, "until": until,
                          "reason": reason, "window_units": used / MICRO})
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
        if record.billed_total_micro <= 0 or not self.checked(key):
            return False
        return self.check(key, record.billed_total_micro)

    def served(self, context_length: int, policy) -> None:
        """The engine is known: its context length and the billing policy give the largest request's cost."""
        self.context_length = int(context_length)
        self.max_request_micro = int(policy.max_request_units(self.context_length) * MICRO)
