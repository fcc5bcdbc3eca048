"""Token-weighted admission policy (pure Python, no vLLM import).

**Weight** of a waiting request, in tokens::

    weight = uncached_prompt_tokens + output_weight * expected_output_tokens

``expected_output_tokens`` is the client's hint (``vllm_xargs`` / ``SamplingParams.extra_args`` key
``hint_key``, default ``expected_output_tokens``) when it gives one, else ``max_tokens``; either is capped at
``output_cap`` (``max_tokens`` is often a huge default, not an expectation).

**Aging is multiplicative** (a half-life), not additive::

    effective_weight = weight * 2 ** (-waited / half_life)

so a request's disadvantage against a fresh one shrinks by half every half-life whatever the weights' scale:
a 30x heavier request overtakes fresh light ones after ``log2(30) ~= 4.9`` half-lives. An additive aging
rate (tokens per second) is tied to one weight scale and, once waits reach seconds under overload, swamps
the weights so the order degenerates to FCFS (the throwaway prototype lost to FCFS at 1.7x load that way).
Because every request decays at the same rate, the order is *time-invariant*: ranking by
``log2(weight) + arrival / half_life`` (arrival on the aging clock) is equivalent to ranking by
``effective_weight`` at any instant, so a request's rank key is computed once (and again only when its
cached-prefix estimate or the half-life changes). Requests of equal weight are served in arrival order; ties are
broken by arrival.

**The aging clock is work, not seconds** (``aging_half_life_tokens > 0``, the default): ``waited`` is the token
weight the engine admitted since the request arrived (the queue's *work clock*, advanced by each step's
admissions), and the half-life is in tokens. A light request then overtakes a heavy one only if less than
``log2(weight ratio)`` half-lives of work were admitted between their arrivals, however long that took — so the
order is the same on a slow CPU and on a fast GPU (a half-life in seconds means half the overtaking on a machine
twice as fast: on the benchmark, a 1 s half-life tuned on one machine missed the long-request tail target on one
twice as fast). ``aging_half_life_tokens = 0`` ages in seconds by ``aging_half_life_s`` instead. The hard
``max_wait_s`` stays in seconds: it is a latency guarantee.

**Hard maximum wait**: a request that has waited ``max_wait_s`` or longer is *overdue* and goes before every
scored request, overdue requests in arrival order. This is the starvation guarantee; aging only shapes the
order below it.

**Load-scaled half-life** (``aging_load_exponent > 0``): the half-life is multiplied by ``load ** exponent``,
where ``load`` is the measured overload factor — the weight arriving per second over the weight admitted per
second, both over the last ``rate_window_s`` — clamped to ``[1, MAX_LOAD_FACTOR]``. Below capacity nothing
changes. Under overload the FCFS queue grows faster the heavier the load, and a fixed half-life then lets short
requests overtake only a shrinking share of it: one short enough to keep long prompts' tail near FCFS's at a mild
overload leaves short requests queued behind the older backlog at a heavy one. Scaling with the measured load
(squared, by default) gives each its window (see the README's scheduler section for the sweep in the simulator
and the engine runs). The factor is re-measured at every step;
the queue recomputes every rank when the half-life moves by more than 2%.

**Grouping** (optional, ``group_ratio > 1``): after ordering, requests whose weight is within a factor
``group_ratio`` of the head's weight move ahead of the others (keeping their order) within the first
``lookup_candidates`` positions, so the requests one step admits have similar token loads.

**FCFS fallback** (optional, ``fcfs_above > 0``): with more scored requests waiting than that, order the
scored lane by arrival (no prefix-cache lookups), as SGLang does above 128 waiting.

All factors come from settings (``PolicyConfig.from_settings``); see ``SETTING_FIELDS``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Setting name (qwen_vllm_ext.config.Settings field) -> PolicyConfig field. The defaults are PolicyConfig's;
# the Settings fields repeat them (a unit test keeps the two equal).
SETTING_FIELDS: dict[str, str] = {
    "sched_output_weight": "output_weight",
    "sched_output_cap": "output_cap",
    "sched_output_hint_key": "hint_key",
    "sched_aging_half_life_s": "aging_half_life_s",
    "sched_max_wait_s": "max_wait_s",
    "sched_group_ratio": "group_ratio",
    "sched_lookup_candidates": "lookup_candidates",
    "sched_fcfs_above": "fcfs_above",
    "sched_aging_load_exponent": "aging_load_exponent",
    "sched_rate_window_s": "rate_window_s",
    "sched_aging_half_life_tokens": "aging_half_life_tokens",
}
MAX_LOAD_FACTOR = 4.0
"""Upper clamp of the measured overload factor (a burst's first seconds can read far higher)."""


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy's factors. Defaults serve most loads; every one is a setting (``SETTING_FIELDS``)."""

    output_weight: float = 0.7
    """Weight of one expected output token relative to one uncached prompt token."""
    output_cap: int = 1024
    """Cap on expected output tokens (``max_tokens`` or the client's hint)."""
    hint_key: str = "expected_output_tokens"
    """``vllm_xargs`` key with the client's expected output tokens (empty: ignore hints)."""
    aging_half_life_s: float = 1.0
    """Seconds-clock aging (used only when ``aging_half_life_tokens`` is 0): waiting this long halves a request's
    effective weight (0: no aging)."""
    max_wait_s: float = 30.0
    """Requests waiting this long are admitted first, in arrival order (0: no limit)."""
    group_ratio: float = 0.0
    """Admit requests within this weight factor of the head first (0 or <= 1: off)."""
    lookup_candidates: int = 64
    """Prefix-cache lookups per step: only the first K scored candidates are refreshed."""
    fcfs_above: int = 0
    """Order the scored lane by arrival when more than this many wait (0: never)."""
    aging_load_exponent: float = 2.0
    """The half-life is multiplied by the measured overload factor to this power (0: fixed half-life)."""
    rate_window_s: float = 10.0
    """Window of the arriving and admitted weight rates whose ratio is the overload factor."""
    aging_half_life_tokens: float = 2500.0
    """When > 0, aging runs on the work clock: a request's effective weight halves every this many tokens of
    weight admitted while it waits (``aging_half_life_s`` is then unused)."""

    def __post_init__(self) -> None:
        if not (self.output_weight >= 0 and math.isfinite(self.output_weight)):
            raise ValueError(f"output_weight must be a finite number >= 0, got {self.output_weight!r}")
        if self.output_cap < 0:
            raise ValueError(f"output_cap must be >= 0, got {self.output_cap!r}")
        if self.aging_half_life_s < 0 or math.isnan(self.aging_half_life_s):
            raise ValueError(f"aging_half_life_s must be >= 0, got {self.aging_half_life_s!r}")
        if self.max_wait_s < 0 or math.isnan(self.max_wait_s):
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s!r}")
        if self.group_ratio < 0 or math.isnan(self.group_ratio):
            raise ValueError(f"group_ratio must be >= 0, got {self.group_ratio!r}")
        if self.lookup_candidates < 0:
            raise ValueError(f"lookup_candidates must be >= 0, got {self.lookup_candidates!r}")
        if self.fcfs_above < 0:
            raise ValueError(f"fcfs_above must be >= 0, got {self.fcfs_above!r}")
        if not (self.aging_load_exponent >= 0 and math.isfinite(self.aging_load_exponent)):
            raise ValueError(f"aging_load_exponent must be a finite number >= 0, got {self.aging_load_exponent!r}")
        if not (self.rate_window_s > 0 and math.isfinite(self.rate_window_s)):
            raise ValueError(f"rate_window_s must be a finite number > 0, got {self.rate_window_s!r}")
        if not (self.aging_half_life_tokens >= 0 and math.isfinite(self.aging_half_life_tokens)):
            raise ValueError("aging_half_life_tokens must be a finite number >= 0, "
                             f"got {self.aging_half_life_tokens!r}")

    @property
    def work_clock(self) -> bool:
        """Aging runs on admitted weight (tokens), not seconds."""
        return self.aging_half_life_tokens > 0

    @classmethod
    def from_settings(cls, settings: Any) -> "PolicyConfig":
        """Build from a ``Settings`` object (or anything with the ``sched_*`` attributes; missing = default)."""
        defaults = cls()
        values = {}
        for setting, field in SETTING_FIELDS.items():
            default = getattr(defaults, field)
            values[field] = type(default)(getattr(settings, setting, default))
        return cls(**values)


def expected_output_tokens(max_tokens: int | None, extra_args: Mapping[str, Any] | None,
                           config: PolicyConfig) -> int:
    """The client's hint (if a non-negative number) else ``max_tokens`` (None: the cap), capped."""
    expected: float | None = None
    if config.hint_key and extra_args:
        hint = extra_args.get(config.hint_key)
        if isinstance(hint, (int, float)) and not isinstance(hint, bool) and math.isfinite(hint) and hint >= 0:
            expected = hint
        elif isinstance(hint, str):
            try:
                value = float(hint)
            except ValueError:
                value = -1.0
            if math.isfinite(value) and value >= 0:
                expected = value
    if expected is None:
        expected = config.output_cap if max_tokens is None else max(int(max_tokens), 0)
    return int(min(expected, config.output_cap))


def weight(uncached_prompt_tokens: int, expected_output: int, config: PolicyConfig) -> float:
    """Token weight: uncached prompt tokens + output_weight x expected output tokens."""
    return max(uncached_prompt_tokens, 0) + config.output_weight * max(expected_output, 0)


def load_factor(arriving_per_s: float | None, admitted_per_s: float | None) -> float:
    """The overload factor: weight arriving per second / weight admitted per second, clamped to
    ``[1, MAX_LOAD_FACTOR]`` (1.0 when either rate is unknown)."""
    if not arriving_per_s or not admitted_per_s:
        return 1.0
    return min(max(arriving_per_s / admitted_per_s, 1.0), MAX_LOAD_FACTOR)


def half_life(config: PolicyConfig, load: float = 1.0) -> float:
    """The effective aging half-life at overload factor ``load``: the base half-life (``aging_half_life_tokens`` on
    the work clock, else ``aging_half_life_s``) x ``load ** aging_load_exponent``, in the aging clock's unit."""
    base = config.aging_half_life_tokens if config.work_clock else config.aging_half_life_s
    if base <= 0:
        return 0.0
    return base * min(max(load, 1.0), MAX_LOAD_FACTOR) ** config.aging_load_exponent


def effective_weight(w: float, waited: float, config: PolicyConfig, load: float = 1.0) -> float:
    """Weight after aging: halves every :func:`half_life` of waiting (``waited`` on the aging clock: admitted
    weight, or seconds)."""
    h = half_life(config, load)
    if h <= 0:
        return w
    return w * 2.0 ** (-max(waited, 0.0) / h)


def rank_key(w: float, arrival: float, config: PolicyConfig, epoch: float = 0.0, load: float = 1.0) -> float:
    """Rank key (lower goes first): ``log2(weight) + (arrival - epoch) / half_life``, ``arrival`` on the aging
    clock (:func:`aging_clock`).

    Comparing keys compares effective weights at any common instant, for one half-life (one ``load``);
    ``epoch`` (any fixed clock value, e.g. the first arrival's) only keeps the float small. Weights below 1 token
    count as 1.
    """
    key = math.log2(max(w, 1.0))
    h = half_life(config, load)
    if h > 0:
        key += (arrival - epoch) / h
    return key


def is_overdue(arrival_time: float, now: float, config: PolicyConfig) -> bool:
    """True when the request has waited at least ``max_wait_s`` (never when that is 0)."""
    return config.max_wait_s > 0 and now - arrival_time >= config.max_wait_s


class RateMeter:
    """Weight per second over a sliding window (pure; the queue feeds one for arrivals, one for admissions)."""

    def __init__(self, window_s: float = 10.0) -> None:
        from collections import deque

        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0
        self._first: float | None = None

    def record(self, now: float, weight: float) -> None:
        if self._first is None:
            self._first = now
        if weight > 0:
            self._events.append((now, weight))
            self._sum += weight
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._sum -= self._events.popleft()[1]

    def rate(self, now: float) -> float | None:
        """Weight per second over the window (None before a full second of observation or with nothing recorded
        in the window: no estimate)."""
        if self._first is None or now - self._first < 1.0:
            return None
        self._expire(now)
        if not self._events:
            return None
        return max(self._sum, 0.0) / min(self.window_s, now - self._first)


@dataclasses.dataclass
class Job:
    """A waiting request as the policy sees it (what :func:`order` sorts)."""

    arrival_time: float
    prompt_tokens: int
    cached_tokens: int = 0
    max_tokens: int | None = None
    extra_args: Mapping[str, Any] | None = None
    priority: int = 0
    seq: int = 0
    """Insertion sequence number: the last tie-breaker (unique per queue)."""
    payload: Any = None
    arrival_work: float = 0.0
    """The work clock (weight admitted so far) when the request arrived: its aging clock when aging runs on work."""

    def weight(self, config: PolicyConfig) -> float:
        return weight(self.prompt_tokens - self.cached_tokens,
                      expected_output_tokens(self.max_tokens, self.extra_args, config), config)


def aging_clock(job: Job, config: PolicyConfig) -> float:
    """The job's arrival on the aging clock: its work clock value, or its arrival time (seconds clock)."""
    return job.arrival_work if config.work_clock else job.arrival_time


def sort_key(job: Job, now: float, config: PolicyConfig, *, epoch: float = 0.0, use_priority: bool = False,
             fcfs: bool = False, load: float = 1.0) -> tuple:
    """The full sort tuple: overdue lane (arrival order) < scored lane ((priority), rank key, arrival, seq)."""
    if is_overdue(job.arrival_time, now, config):
        return (0, 0, 0.0, job.arrival_time, job.seq)
    if fcfs:
        return (1, 0, 0.0, job.arrival_time, job.seq)
    return (1, job.priority if use_priority else 0,
            rank_key(job.weight(config), aging_clock(job, config), config, epoch, load), job.arrival_time, job.seq)


def group_window(items: list, weights: Sequence[float], start: int, config: PolicyConfig) -> list:
    """Reorder ``items[start:start+K]`` (K = lookup_candidates) so that those whose weight is within a factor
    ``group_ratio`` of ``items[start]``'s come first, order kept; returns a new list (no-op when off)."""
    ratio = config.group_ratio
    if ratio <= 1.0 or len(items) - start < 3:
        return list(items)
    end = min(len(items), start + max(config.lookup_candidates, 2))
    head = max(weights[start], 1.0)
    lo, hi = head / ratio, head * ratio
    inside = [i for i in range(start, end) if lo <= max(weights[i], 1.0) <= hi]
    outside = [i for i in range(start, end) if not lo <= max(weights[i], 1.0) <= hi]
    return items[:start] + [items[i] for i in inside + outside] + items[end:]


def order(jobs: Iterable[Job], now: float, config: PolicyConfig, *, use_priority: bool = False,
          load: float = 1.0) -> list[Job]:
    """Reference ordering of a scored lane at time ``now`` and overload factor ``load`` (overdue first by
    arrival, then by rank key with ties by arrival, FCFS above ``fcfs_above``, then grouping). The vLLM queue
    applies the same rules."""
    jobs = list(jobs)
    epoch = min((aging_clock(j, config) for j in jobs), default=0.0)
    scored = sum(1 for j in jobs if not is_overdue(j.arrival_time, now, config))
    fcfs = 0 < config.fcfs_above < scored
    jobs.sort(key=lambda j: sort_key(j, now, config, epoch=epoch, use_priority=use_priority, fcfs=fcfs, load=load))
    if fcfs:
        return jobs
    first_scored = next((i for i, j in enumerate(jobs) if not is_overdue(j.arrival_time, now, config)), len(jobs))
    return group_window(jobs, [j.weight(config) for j in jobs], first_scored, config)


def stddev(values: Sequence[float]) -> float:
    """Population standard deviation (0.0 for fewer than two values)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / n)


class AdmissionStats:
    """Per-step admission statistics a token-weighted scheduler keeps for metrics (pure Python).

    Counters only grow; sample windows are bounded (``window`` newest samples). An exporter either reads
    :meth:`snapshot` (counters + p50/p99 over the window) or calls :meth:`drain` to take the samples
    recorded since its last drain (for histograms).
    """

    def __init__(self, window: int = 4096) -> None:
        from collections import deque

        self.steps = 0
        """schedule() calls."""
        self.admitted = 0
        """Requests admitted from the waiting queue (first admissions and resumptions)."""
        self.max_wait_admissions = 0
        """Admissions through the max-wait (overdue) lane."""
        self.cache_hit_tokens = 0
        """Prefix-cache hit tokens of first admissions (the tokens admission did not have to prefill)."""
        self.prompt_tokens = 0
        """Prompt tokens of first admissions (cache_hit_tokens / prompt_tokens = hit rate at admission)."""
        self.lookups = 0
        """Prefix-cache lookups the policy made (one per arrival + at most K per step)."""
        self.last_weight_std = 0.0
        self.weight_std = deque(maxlen=window)
        """Per-step standard deviation of admitted weights (steps admitting two or more requests)."""
        self.queue_wait_s = deque(maxlen=window)
        """Queue wait (arrival to first admission) of each first admission, seconds."""
        self._drained_std = 0
        self._drained_wait = 0
        self._std_total = 0
        self._wait_total = 0

    def record_step(self, weights: Sequence[float], waits: Sequence[float], overdue: int, cache_hits: int,
                    prompt_tokens: int) -> None:
        self.steps += 1
        self.admitted += len(weights)
        self.max_wait_admissions += overdue
        self.cache_hit_tokens += cache_hits
        self.prompt_tokens += prompt_tokens
        if len(weights) >= 2:
            self.last_weight_std = stddev(weights)
            self.weight_std.append(self.last_weight_std)
            self._std_total += 1
        for w in waits:
            self.queue_wait_s.append(w)
        self._wait_total += len(waits)

    def drain(self) -> dict[str, list[float]]:
        """Samples recorded since the previous drain (at most ``window`` of each)."""
        new_std = min(self._std_total - self._drained_std, len(self.weight_std))
        new_wait = min(self._wait_total - self._drained_wait, len(self.queue_wait_s))
        self._drained_std, self._drained_wait = self._std_total, self._wait_total
        return {
            "admitted_weight_std": list(self.weight_std)[len(self.weight_std) - new_std:],
            "queue_wait_s": list(self.queue_wait_s)[len(self.queue_wait_s) - new_wait:],
        }

    def snapshot(self) -> dict[str, float | int]:
        waits = sorted(self.queue_wait_s)
        stds = list(self.weight_std)
        return {
            "steps": self.steps,
            "admitted": self.admitted,
            "max_wait_admissions": self.max_wait_admissions,
            "cache_hit_tokens": self.cache_hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "lookups": self.lookups,
            "admitted_weight_std_last": self.last_weight_std,
            "admitted_weight_std_mean": sum(stds) / len(stds) if stds else 0.0,
            "queue_wait_p50_s": quantile(waits, 0.5),
            "queue_wait_p99_s": quantile(waits, 0.99),
        }


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of already sorted values (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])
