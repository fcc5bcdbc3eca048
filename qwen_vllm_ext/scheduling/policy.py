"""Token-weighted admission policy (pure Python, no vLLM import).

**Weight** of a waiting request, in tokens::

    weight = uncached_prompt_tokens + output_weight * expected_output_tokens

``expected_output_tokens`` is the client's hint (``vllm_xargs`` / ``SamplingParams.extra_args`` key
``output_hint_key``, default ``expected_output_tokens``) when it gives one, else ``max_tokens``; either is capped at
``output_cap`` (``max_tokens`` is often a huge default, not an expectation).

**Measured costs** (``measured_costs``, the default): inside the engine the token-weighted scheduler replaces this
weight by the request's cost under the engine's own step-cost model, fitted online (:mod:`.costs`), in the same unit
(prefill-token equivalents), and orders by arrival until that fit has enough steps. Everything below applies to
either weight.

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

**FCFS slip bound** (``max_slip > 0``): a request is also overdue once the weight admitted since it arrived
exceeds ``(1 + max_slip)`` x the weight that was waiting ahead of it when it arrived (its *deadline* on the work
clock, :func:`slip_deadline`). FCFS would have admitted it after exactly that weight, so no request is admitted
after more than ``1 + max_slip`` times the work FCFS would have put before it: below capacity (a short queue) the
order stays close to arrival order, and the room to reorder grows with the backlog, where it pays. With
``slip_floor_quantile = q > 0`` the deadline is at least the ``q``-quantile of the weight that was queued ahead of
the recent arrivals (the ``SLIP_HISTORY`` latest): a request that arrived to a short queue may wait as long as a
typical request of the recent backlog would have under FCFS, which leaves FCFS's tail (the requests that met the
deepest backlog, bounded by the slip) alone while short requests overtake the rest.

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

**The overload gate** (``token_weighted_scheduler=auto``): while the engine is not overloaded the queue makes exactly
vLLM's own decisions (insertion order, vLLM's (priority, arrival) order under ``--scheduling-policy priority``), and
the rules above order it only while it is. Overloaded means the waiting requests need more than
``overload_steps`` full steps to start: their uncached prompts, in prefill-token equivalents priced by the engine's
measured step costs (:func:`prefill_tokens`: a token after ``c`` others costs ``1 + c x per_ctx / per_token`` tokens,
the causal-attention term of :mod:`.costs`), over the token budget one step has left after its decodes. Within one
step every admitted request's prefill ends at the same time whatever their order, so a queue that starts within a
step or two is one no order can help; a queue that needs more is one that arrivals outpace. :class:`OverloadGate`
turns the policy on at ``overload_steps`` and off again only once the backlog is down to ``overload_exit_steps``
(hysteresis: it does not flap on one burst) — and only while prefill is at least ``overload_prefill_share`` of the
waiting work: on a decode-bound engine the queue is mostly its requests' outputs, no order shortens them, and the
policy's own CPU time would be the only change.

**FCFS fallback** (optional, ``fcfs_above > 0``): with more scored requests waiting than that, order the
scored lane by arrival (no prefix-cache lookups), as SGLang does above 128 waiting.

All factors come from settings: ``Settings.scheduler`` is a ``PolicyConfig``; its field ``f`` is the setting
``sched_f`` (``SETTING_PREFIX``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SETTING_PREFIX = "sched_"
"""Each ``PolicyConfig`` field ``f`` is the setting ``sched_f`` of :class:`qwen_vllm_ext.config.Settings`, which
nests this class: the fields below (with their defaults and docs) are the one definition of those settings."""
MAX_LOAD_FACTOR = 4.0
"""Upper clamp of the measured overload factor (a burst's first seconds can read far higher)."""


_FINITE_GE0 = ("a finite number >= 0", lambda v: v >= 0 and math.isfinite(v))
_GE0 = (">= 0", lambda v: v >= 0)  # NaN fails every comparison, so it is refused too
_RANGES = (
    ("output_weight", *_FINITE_GE0), ("output_cap", *_GE0), ("aging_half_life_s", *_GE0), ("max_wait_s", *_GE0),
    ("group_ratio", *_GE0), ("lookup_candidates", *_GE0), ("fcfs_above", *_GE0), ("aging_load_exponent", *_FINITE_GE0),
    ("rate_window_s", "a finite number > 0", lambda v: v > 0 and math.isfinite(v)),
    ("aging_half_life_tokens", *_FINITE_GE0), ("max_slip", *_FINITE_GE0),
    ("slip_floor_quantile", "in [0, 1]", lambda v: 0 <= v <= 1),
    ("overload_steps", *_FINITE_GE0), ("overload_exit_steps", *_FINITE_GE0),
    ("overload_prefill_share", "in [0, 1]", lambda v: 0 <= v <= 1),
)
SLIP_HISTORY = 1000
"""Arrivals whose queued-ahead weight the slip floor's quantile is taken over."""


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy's factors. Defaults serve most loads; every field ``f`` is the setting ``sched_f``."""

    output_weight: float = 0.7
    """Weight of expected output tokens: weight = uncached prompt tokens + this x expected output tokens."""
    output_cap: int = 1024
    """Expected output = min(max_tokens, this cap), unless the client hints it (vllm_xargs)."""
    output_hint_key: str = "expected_output_tokens"
    """``vllm_xargs`` key through which a client may hint its expected output length (empty: ignore hints)."""
    aging_half_life_s: float = 1.0
    """Aging in seconds, used only when ``sched_aging_half_life_tokens`` is 0: a waiting request's weight halves
    every this many seconds (both 0 = no aging)."""
    max_wait_s: float = 30.0
    """Hard starvation bound: requests waiting longer are admitted first, in arrival order (0 = none)."""
    group_ratio: float = 0.0
    """When > 1, one step admits requests within this factor of the head's weight first (0 = off)."""
    lookup_candidates: int = 64
    """Prefix-cache lookups per step only for the first K waiting candidates."""
    fcfs_above: int = 0
    """Fall back to arrival order when more than this many requests wait (0 = never)."""
    aging_load_exponent: float = 2.0
    """The aging half-life is multiplied by the measured overload factor to this power (0 = fixed)."""
    rate_window_s: float = 10.0
    """Window of the arriving and admitted weight rates whose ratio is the overload factor, seconds."""
    aging_half_life_tokens: float = 2500.0
    """Aging on the work clock: a waiting request's weight halves every this many tokens of weight the engine
    admits (0 = age in seconds instead, by ``sched_aging_half_life_s``)."""
    measured_costs: bool = True
    """Weigh requests by the engine's own measured costs (a step-cost model fitted online to the steps it runs:
    prefill-token equivalents, :mod:`.costs`) instead of ``uncached prompt + output_weight x output``; until the fit
    has enough steps, admit in arrival order."""
    max_slip: float = 0.10
    """FCFS slip bound: a waiting request goes to the arrival-order lane once the weight admitted since it arrived
    exceeds (1 + this) x the weight waiting ahead of it at its arrival (0 = no bound). 0.10 is the point issue #50
    chose on the overloaded frontier (mean TTFT win against the longest prompts' p99 wait; docs/results/scheduler.md)."""
    slip_floor_quantile: float = 0.0
    """With the slip bound: a request's deadline is at least this quantile of the weight queued ahead of the recent
    arrivals (0 = no floor)."""
    overload_steps: float = 4.0
    """``token_weighted_scheduler=auto``: the policy orders the queue once the waiting requests' uncached prompts need
    more than this many full steps' token budget to start (priced by the measured step costs); below it the queue is
    exactly vLLM's FCFS."""
    overload_exit_steps: float = 1.0
    """``token_weighted_scheduler=auto``: back to exactly FCFS once that backlog is down to this many steps (at most
    ``sched_overload_steps``: the hysteresis)."""
    overload_prefill_share: float = 0.5
    """``token_weighted_scheduler=auto``: the policy orders the queue only while prefill is at least this share of the
    waiting requests' measured cost (the rest: their outputs' decode steps) — on a decode-bound engine no order helps
    and the policy's own CPU time is a loss; back to FCFS below half of it (0 = the backlog alone decides)."""

    def __post_init__(self) -> None:
        for name, what, ok in _RANGES:
            value = getattr(self, name)
            if not ok(value):
                raise PolicyError(name, f"{name} must be {what}, got {value!r}")
        if self.overload_exit_steps > self.overload_steps:
            raise PolicyError("overload_exit_steps", f"overload_exit_steps must be <= overload_steps "
                              f"({self.overload_steps!r}), got {self.overload_exit_steps!r}")

    @property
    def work_clock(self) -> bool:
        """Aging runs on admitted weight (tokens), not seconds."""
        return self.aging_half_life_tokens > 0


class PolicyError(ValueError):
    """A policy factor out of range; ``field`` names it (the setting is ``sched_<field>``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def expected_output_tokens(max_tokens: int | None, extra_args: Mapping[str, Any] | None,
                           config: PolicyConfig) -> int:
    """The client's hint (if a non-negative number) else ``max_tokens`` (None: the cap), capped."""
    expected: float | None = None
    if config.output_hint_key and extra_args:
        hint = extra_args.get(config.output_hint_key)
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


SCHEDULER_MODES = ("false", "true", "auto")
"""The values of the ``token_weighted_scheduler`` setting: vLLM's scheduler, the policy always, or the policy behind
the overload gate."""


def prefill_tokens(uncached: int, cached: int, ctx_ratio: float = 0.0) -> float:
    """A prompt's prefill in prefill-token equivalents: ``uncached`` tokens after ``cached`` ones, each costing
    ``1 + context x ctx_ratio`` (``ctx_ratio``: the step-cost model's per_ctx / per_token; 0 = tokens)."""
    uncached, cached = max(uncached, 0), max(cached, 0)
    return uncached + ctx_ratio * uncached * (cached + uncached / 2)


class OverloadGate:
    """Hysteresis on the backlog in full steps (pure): on above ``overload_steps`` while prefill is at least
    ``overload_prefill_share`` of the waiting work, off at ``overload_exit_steps`` or below half that share."""

    def __init__(self, config: PolicyConfig) -> None:
        self.on_steps, self.off_steps = config.overload_steps, config.overload_exit_steps
        self.min_share = config.overload_prefill_share
        self.overloaded = False
        self.switches = 0
        """Times the gate changed state (on and off both count)."""
        self.backlog_steps = 0.0
        """The backlog the last :meth:`update` saw, in full steps."""
        self.prefill_share: float | None = None
        """The prefill share of the waiting work the last :meth:`update` saw (None: not given)."""

    def update(self, backlog_steps: float, prefill_share: float | None = None) -> bool:
        """The gate's state for a step whose waiting queue needs ``backlog_steps`` full steps to start, prefill being
        ``prefill_share`` of its work (None: not considered)."""
        self.backlog_steps, self.prefill_share = backlog_steps, prefill_share
        decode_bound = prefill_share is not None and prefill_share < self.min_share
        if not self.overloaded and backlog_steps > self.on_steps and not decode_bound:
            self.overloaded, self.switches = True, self.switches + 1
        elif self.overloaded and (backlog_steps <= self.off_steps
                                  or prefill_share is not None and prefill_share < self.min_share / 2):
            self.overloaded, self.switches = False, self.switches + 1
        return self.overloaded


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


def is_overdue(arrival_time: float, now: float, config: PolicyConfig, work: float = 0.0,
               deadline_work: float = math.inf) -> bool:
    """True when the request has waited at least ``max_wait_s`` (never when that is 0) or the work clock
    ``work`` has reached its slip deadline ``deadline_work`` (:func:`slip_deadline`)."""
    return (config.max_wait_s > 0 and now - arrival_time >= config.max_wait_s) or work >= deadline_work


def slip_deadline(arrival_work: float, queued_ahead: float, config: PolicyConfig, floor: float = 0.0) -> float:
    """The work-clock value at which a request that arrived at work clock ``arrival_work`` behind ``queued_ahead``
    weight of waiting requests becomes overdue: ``arrival_work + max((1 + max_slip) x queued_ahead, floor)``
    (``floor``: the slip floor, see :class:`SlipFloor`; infinite when ``max_slip`` is 0: no bound)."""
    if config.max_slip <= 0:
        return math.inf
    return arrival_work + max((1.0 + config.max_slip) * max(queued_ahead, 0.0), floor)


class SlipFloor:
    """The ``slip_floor_quantile`` of the queued-ahead weight over the latest ``SLIP_HISTORY`` arrivals (pure)."""

    def __init__(self, quantile_q: float, history: int = SLIP_HISTORY) -> None:
        from collections import deque

        self.q = quantile_q
        self._recent: deque[float] = deque(maxlen=history)
        self._sorted: list[float] = []

    def observe(self, queued_ahead: float) -> float:
        """Record an arrival's queued-ahead weight; returns the floor for it (the quantile *before* it: 0.0 when
        off or with no history)."""
        if self.q <= 0:
            return 0.0
        import bisect

        floor = quantile(self._sorted, self.q) if self._sorted else 0.0
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(queued_ahead)
        bisect.insort(self._sorted, queued_ahead)
        return floor

    def clear(self) -> None:
        self._recent.clear()
        self._sorted.clear()


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
    deadline_work: float = math.inf
    """The work clock value at which the request becomes overdue (:func:`slip_deadline`; inf: never)."""

    def weight(self, config: PolicyConfig) -> float:
        return weight(self.prompt_tokens - self.cached_tokens,
                      expected_output_tokens(self.max_tokens, self.extra_args, config), config)


def aging_clock(job: Job, config: PolicyConfig) -> float:
    """The job's arrival on the aging clock: its work clock value, or its arrival time (seconds clock)."""
    return job.arrival_work if config.work_clock else job.arrival_time


def lane_key(job: Job, *, overdue: bool, rank: float, use_priority: bool = False, fcfs: bool = False) -> tuple:
    """The ordering rule, the one place it is written (the vLLM queue sorts by it): overdue requests first in
    arrival order, then the scored lane by (rank key, arrival, seq) -- by arrival when ``fcfs``. With
    ``use_priority`` (vLLM's ``--scheduling-policy priority``) the priority comes first, as in vLLM's own queue:
    the policy orders within each priority class, and its fallback to arrival order is vLLM's (priority, arrival)."""
    p = job.priority if use_priority else 0
    if overdue:
        return (p, 0, 0.0, job.arrival_time, job.seq)
    if fcfs:
        return (p, 1, 0.0, job.arrival_time, job.seq)
    return (p, 1, rank, job.arrival_time, job.seq)


def sort_key(job: Job, now: float, config: PolicyConfig, *, epoch: float = 0.0, use_priority: bool = False,
             fcfs: bool = False, load: float = 1.0, work: float = 0.0) -> tuple:
    """:func:`lane_key` of a job at ``now`` and work clock ``work`` (overdue status and rank key computed here)."""
    return lane_key(job, overdue=is_overdue(job.arrival_time, now, config, work, job.deadline_work),
                    rank=rank_key(job.weight(config), aging_clock(job, config), config, epoch, load),
                    use_priority=use_priority, fcfs=fcfs)


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
          load: float = 1.0, work: float = 0.0) -> list[Job]:
    """Reference ordering of a scored lane at time ``now``, overload factor ``load`` and work clock ``work``
    (overdue first by arrival, then by rank key with ties by arrival, FCFS above ``fcfs_above``, then grouping).
    The vLLM queue applies the same rules."""
    jobs = list(jobs)
    epoch = min((aging_clock(j, config) for j in jobs), default=0.0)

    def overdue(j: Job) -> bool:
        return is_overdue(j.arrival_time, now, config, work, j.deadline_work)

    scored = sum(1 for j in jobs if not overdue(j))
    fcfs = 0 < config.fcfs_above < scored
    jobs.sort(key=lambda j: sort_key(j, now, config, epoch=epoch, use_priority=use_priority, fcfs=fcfs, load=load,
                                     work=work))
    if fcfs:
        return jobs
    first_scored = next((i for i, j in enumerate(jobs) if not overdue(j)), len(jobs))
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
        """Admissions through the overdue lane because they had waited ``max_wait_s``."""
        self.slip_admissions = 0
        """Admissions through the overdue lane because they reached their FCFS slip deadline."""
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
                    prompt_tokens: int, slipped: int = 0) -> None:
        self.steps += 1
        self.admitted += len(weights)
        self.max_wait_admissions += overdue
        self.slip_admissions += slipped
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
            "slip_admissions": self.slip_admissions,
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
