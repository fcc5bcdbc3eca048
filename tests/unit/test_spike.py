"""Spike breaker: suspends a key once when its 15-minute usage passes factor x baseline (real limiter, fake clock)."""
import types

from qwen_vllm_ext.config import Settings
from qwen_vllm_ext.gateway.limiter import MemoryLimiter
from qwen_vllm_ext.gateway.spike import SpikeBreaker


class Keys:
    def __init__(self):
        self.suspensions = []

    def suspend(self, key_id, until, reason):
        self.suspensions.append((key_id, until, reason))


class Ledger:
    def __init__(self, yesterday_micro):
        self.yesterday_micro = yesterday_micro

    def daily(self, key_id, day):
        return {"billed_micro": self.yesterday_micro}


def breaker(yesterday_micro=0, **settings):
    clock = types.SimpleNamespace(now=1_800_000_000.0)
    keys = Keys()
    sb = SpikeBreaker(Settings(spike_min_units=100, **settings), MemoryLimiter(clock=lambda: clock.now), keys,
                      Ledger(yesterday_micro), clock=lambda: clock.now)
    return sb, keys, clock


KEY = types.SimpleNamespace(key_id="k_1", name="team")


def test_floor_applies_and_suspends_once_per_spike():
    sb, keys, clock = breaker()
    # threshold: 3 x max(baseline 0, floor 100 units) = 300 units in 15 minutes
    assert [sb.check(KEY, 100_000_000) for _ in range(3)] == [False, False, False]
    assert sb.check(KEY, 1) is True
    assert sb.check(KEY, 50_000_000) is False and len(keys.suspensions) == 1  # in-flight requests: no repeat
    key_id, until, reason = keys.suspensions[0]
    assert key_id == "k_1" and until == clock.now + 900 and "3x baseline" in reason
    clock.now += 901  # cooldown over and the old usage left the window: a new spike suspends again
    assert sb.check(KEY, 301_000_000) is True and len(keys.suspensions) == 2


def test_baseline_from_yesterdays_aggregate():
    sb, keys, _ = breaker(yesterday_micro=96 * 1_000_000_000)  # 1,000 units per 15 minutes yesterday
    assert sb.baseline_micro("k_1") == 1_000_000_000
    assert sb.check(KEY, 2_999_000_000) is False
    assert sb.check(KEY, 2_000_000) is True


def test_factor_zero_turns_it_off():
    sb, keys, _ = breaker(spike_factor=0)
    assert sb.observe_sync(KEY, types.SimpleNamespace(billed_total_micro=10**15)) is False  # before any work
    assert keys.suspensions == []
