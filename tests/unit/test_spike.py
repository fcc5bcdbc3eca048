"""Spike breaker (gateway/spike.py): runaway use suspends a key once; normal use -- a new key, an exempt key, a
burst its own limits allow, one request of the largest size -- never does. Real limiter, injected clock; the
previous day's aggregate is fed directly (the ledger's daily() is tested with the stores)."""
import types

import pytest

from qwen_v3_calculator.billing import get_policy

from qwen_vllm_ext.config import Settings, SettingsError
from qwen_vllm_ext.gateway.limiter import MemoryLimiter
from qwen_vllm_ext.gateway.spike import SPIKE_FLOOR_REQUESTS, SpikeBreaker, previous_day_start
from qwen_vllm_ext.keys.model import ApiKey

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
DAY = 86400.0
CONTEXT = 16384  # the hybrid demo's context length
MICRO = 1_000_000


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


def breaker(yesterday_units=0.0, context=CONTEXT, **settings):
    clock = types.SimpleNamespace(now=NOW)
    keys = Keys()
    sb = SpikeBreaker(Settings(**settings), MemoryLimiter(clock=lambda: clock.now), keys,
                      Ledger(int(yesterday_units * MICRO)), clock=lambda: clock.now)
    if context:
        sb.served(context, get_policy("default"))
    return sb, keys, clock


def key(age_s=3 * DAY, **fields):
    return ApiKey(key_id="k_1", name="team", prefix="qve-abc", created_at=NOW - age_s, **fields)


def record(units):
    return types.SimpleNamespace(billed_total_micro=int(units * MICRO))


BIGGEST = float(get_policy("default").max_request_units(CONTEXT))  # 22,118.05 units at 16,384 tokens


def test_defaults_floor_is_four_of_the_largest_requests():
    sb, _, _ = breaker()
    assert Settings().spike_factor == 10 and Settings().spike_min_units == 0
    assert sb.floor_micro() == SPIKE_FLOOR_REQUESTS * int(BIGGEST * MICRO)
    # the largest request: the whole context as output at 1.35 (with a code block: x 1 + surcharge 0)
    assert BIGGEST == pytest.approx(1 + (CONTEXT - 1) * 1.35)


def test_runaway_use_suspends_once_within_the_crossing_request():
    """Above 10x the previous day's 15-minute average and above the floor: suspended on the request that crosses."""
    day_units = 96 * 30_000.0  # 30,000 units per 15 minutes yesterday: 10x = 300,000 > the floor (88,472)
    sb, keys, clock = breaker(yesterday_units=day_units)
    k = key()
    assert sb.threshold_micro(k) == 300_000 * MICRO
    steps = [sb.observe_sync(k, record(20_000)) for _ in range(15)]  # 300,000 units: at the threshold, not over
    assert steps == [False] * 15 and keys.suspensions == []
    assert sb.observe_sync(k, record(1)) is True
    assert sb.observe_sync(k, record(20_000)) is False and len(keys.suspensions) == 1  # in flight: no repeat
    key_id, until, reason = keys.suspensions[0]
    assert key_id == "k_1" and until == clock.now + 900
    assert "300000.00" in reason and "10x the previous day's 15-min average 30000.00" in reason
    clock.now += 901  # cooldown over and the old usage left the window: a new spike suspends again
    assert sb.observe_sync(k, record(300_001)) is True and len(keys.suspensions) == 2


def test_under_the_floor_never_suspends_even_far_above_the_baseline():
    sb, keys, clock = breaker(yesterday_units=96 * 10.0)  # 10 units per 15 minutes yesterday: 10x = 100
    k = key()
    floor = sb.floor_micro() / MICRO
    sent = 0.0
    while sent + 500 <= floor:  # hundreds of times the baseline, always under the floor
        assert sb.observe_sync(k, record(500)) is False
        sent += 500
        clock.now += 0.5
    assert keys.suspensions == [] and sent > 100 * 10
    clock.now += 1
    assert sb.observe_sync(k, record(floor - sent + 1)) is True  # over both: suspended


def test_one_request_of_the_largest_size_never_reaches_the_floor():
    sb, keys, _ = breaker()
    k = key()
    assert [sb.observe_sync(k, record(BIGGEST)) for _ in range(SPIKE_FLOOR_REQUESTS)] == [False] * 4
    assert keys.suspensions == []


def test_new_keys_and_exempt_keys_are_never_checked():
    """The OpenRouter key (created exempt) after 1,000 requests of the listing's largest size in 15 minutes, and a
    key in its first hours: no suspension."""
    sb, keys, clock = breaker()
    aggregator = key(spike_breaker=False)
    for _ in range(1000):
        assert sb.observe_sync(aggregator, record(BIGGEST)) is False
        clock.now += 0.8
    fresh = key(age_s=clock.now - NOW + 3600)  # created an hour ago
    assert not sb.checked(fresh) and all(sb.observe_sync(fresh, record(BIGGEST)) is False for _ in range(200))
    # a key is checked once it has a whole previous UTC day
    assert previous_day_start(NOW) == NOW - 8 * 3600 - DAY
    assert not sb.checked(key(age_s=8 * 3600 + DAY - 1)) and sb.checked(key(age_s=8 * 3600 + DAY))
    assert keys.suspensions == []


def test_a_burst_its_own_limits_allow_never_suspends():
    sb, keys, clock = breaker()
    tpm_key = key(tpm=200_000)
    allowed_tokens = 200_000 * 15
    assert sb.allowance_micro(tpm_key) == int(allowed_tokens * BIGGEST * MICRO / CONTEXT)
    sent = 0
    while sent + CONTEXT <= allowed_tokens:  # every token the key's TPM admits in 15 minutes, at the priciest split
        assert sb.observe_sync(tpm_key, record(BIGGEST)) is False
        sent += CONTEXT
        clock.now += 60 * CONTEXT / 200_000
    assert keys.suspensions == []
    rpm_key = key(rpm=2)
    assert sb.allowance_micro(rpm_key) == 30 * int(BIGGEST * MICRO)
    assert sb.allowance_micro(key(rpm=2, tpm=200_000)) == min(30 * int(BIGGEST * MICRO),
                                                              sb.allowance_micro(tpm_key))


def test_off_and_before_the_engine_is_known():
    sb, keys, _ = breaker(spike_factor=0)
    assert sb.observe_sync(key(), record(10**9)) is False  # off
    sb, keys, _ = breaker(context=None)
    assert sb.floor_micro() == 0 and not sb.checked(key())  # no engine yet: no floor, nothing checked
    sb, keys, _ = breaker(context=None, spike_min_units=100)
    assert sb.checked(key()) and sb.observe_sync(key(), record(101)) is True  # an explicit floor works at once
    assert keys.suspensions


@pytest.mark.parametrize("name, value", [("spike_factor", -1), ("spike_factor", float("nan")),
                                         ("spike_min_units", float("inf")), ("spike_cooldown_s", 0),
                                         ("spike_webhook", "hooks.example.com/x")])
def test_malformed_spike_settings_fail_at_start_naming_the_setting(name, value):
    with pytest.raises(SettingsError, match=name):
        Settings.from_flat({name: value})
