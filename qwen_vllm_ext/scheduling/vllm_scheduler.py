"""vLLM V1 scheduler classes for token-weighted, cache-aware admission (the only module touching vLLM's
scheduler internals; written against vLLM 0.32/0.33 ``vllm/v1/core/sched``).

Use ``--scheduler-cls qwen_vllm_ext.scheduling.vllm_scheduler.TokenWeightedScheduler``: constructing it
yields :class:`TokenWeightedAsyncScheduler` (an ``AsyncScheduler``) when the config has async scheduling on
(the GPU default), else the plain-``Scheduler`` variant (CPU), the way upstream pairs
``DiffusionScheduler`` / ``DiffusionAsyncScheduler``. :func:`pick_scheduler_cls` makes the same choice.

What changes against upstream: only ``self.waiting``. The scheduler's admission loop peeks the head,
pops it when admitted, ``break`` s on KV-allocation failure and *prepends* preempted and skipped requests.
:class:`TokenWeightedRequestQueue` keeps

* a FIFO **front lane** for everything prepended (preempted, skipped), served first, in order;
* a **scored lane**: overdue requests (waited ``max_wait_s``, or past their FCFS slip deadline) first in arrival
  order, then the rest by
  the policy's rank key (:mod:`.policy`), re-sorted once per ``schedule()`` — never between a peek and the
  following pop, so peek and pop return the same request. The queue measures the weight arriving and the weight
  admitted per second; their ratio (the overload factor) scales the aging half-life. It also sums the weight
  admitted — the work clock aging runs on by default (fed by the scheduler after each ``schedule()``).

Cache awareness: a request's cached-prefix tokens are looked up once on arrival and again, at the start of
each step, for the first ``lookup_candidates`` scored requests only, through
``kv_cache_manager.get_computed_blocks()`` — a read-only lookup (no block is touched, no stats recorded).
Requests holding KV blocks stay in upstream's ``kv_holding_waiting`` queue (drained first, FCFS).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from .costs import CostFit, StepCostModel, features
from .policy import (AdmissionStats, Job, OverloadGate, PolicyConfig, RateMeter, SlipFloor, aging_clock,
                     expected_output_tokens, group_window, half_life, is_overdue, lane_key, load_factor,
                     prefill_tokens, rank_key, slip_deadline, weight)

__all__ = [
    "TokenWeightedRequestQueue",
    "TokenWeightedMixin",
    "TokenWeightedScheduler",
    "TokenWeightedAsyncScheduler",
    "pick_scheduler_cls",
    "step_composition",
]


@dataclasses.dataclass(eq=False)
class _Entry(Job):
    w: float = 0.0
    rank: float = 0.0
    sort: tuple = ()
    overdue: bool = False
    slipped: bool = False
    """Overdue by its slip deadline (not by ``max_wait_s``)."""
    removed: bool = False
    queued_w: float = 0.0
    """The weight this request adds to the queue's ``queued_weight`` while it is in the scored lane."""
    prefill: float = 0.0
    """Its uncached prompt in prefill-token equivalents: what it adds to the queue's ``queued_prefill``."""


def _sort_tuple(e: _Entry, use_priority: bool, fcfs: bool) -> tuple:
    return lane_key(e, overdue=e.overdue, rank=e.rank, use_priority=use_priority, fcfs=fcfs)


RERANK_TOLERANCE = 0.02
"""Ranks are recomputed when the load-scaled half-life moves by more than this fraction."""


def _sort_of(e: _Entry) -> tuple:
    return e.sort


class TokenWeightedRequestQueue(RequestQueue):
    """vLLM ``RequestQueue`` with a FIFO front lane and a token-weighted scored lane (see module doc).

    ``lookup(request)`` returns the request's prefix-cache hit in tokens (or None: unknown, counts as 0);
    ``refresh(now)`` re-sorts the scored lane and must be called once per scheduling step, before the
    scheduler looks at the queue.

    ``gated`` (``token_weighted_scheduler=auto``): the policy orders the queue only while the overload gate is on
    (:class:`~.policy.OverloadGate`, fed by ``refresh``); otherwise the queue's order is exactly vLLM's own queue's
    — insertion order behind the prepended requests (``FCFSRequestQueue``), or vLLM's request order (priority,
    arrival, id) over both lanes (``PriorityRequestQueue``) — and it makes no prefix-cache lookups per step.
    """

    def __init__(self, config: PolicyConfig, lookup: Callable[[Request], int | None] | None = None,
                 use_priority: bool = False, stats: AdmissionStats | None = None, gated: bool = False) -> None:
        self.config = config
        self.gate = OverloadGate(config) if gated else None
        """The overload gate (None: the policy always orders)."""
        self._exact = gated
        """The queue makes vLLM's own decisions (gated and not overloaded)."""
        self.queued_prefill = 0.0
        """Uncached prompt tokens of the scored lane in prefill-token equivalents (the gate's backlog)."""
        self._lookup = lookup
        self._use_priority = use_priority
        self.stats = stats if stats is not None else AdmissionStats()
        self._front: deque[Request] = deque()
        self._lane: list[_Entry] = []
        self._head = 0
        self._members: dict[Request, _Entry] = {}
        self._seq = 0
        self._epoch: float | None = None
        self._now = 0.0
        self._fcfs = False
        self.admitted_rate = RateMeter(config.rate_window_s)
        """Weight admitted per second (fed by the scheduler each step)."""
        self.arriving_rate = RateMeter(config.rate_window_s)
        """Weight arriving per second (fed by add_request)."""
        self.work = 0.0
        """The work clock: total weight admitted so far (fed by record_admitted)."""
        self.costs: StepCostModel | None = None
        """The engine's measured step-cost model (set by the scheduler with ``measured_costs``; None: token
        weight)."""
        self.batch = 1.0
        """The engine's mean requests per step (shares a step's base cost among its requests)."""
        self.await_costs = False
        """Order the scored lane by arrival while no cost model is set (the scheduler sets this with
        ``measured_costs``: until the engine knows its costs it cannot tell whether reordering pays)."""
        self.slip_floor = SlipFloor(config.slip_floor_quantile)
        self.queued_weight = 0.0
        """Weight of the requests in the scored lane (each counted at its arrival estimate): what FCFS would admit
        before a request arriving now, the base of its slip deadline."""
        self.load = 1.0
        """The overload factor of the last refresh() (arriving / admitted weight rate, clamped; 1.0 = unknown)."""
        self._rank_load = 1.0
        self.half_life = half_life(config, 1.0)
        """The aging half-life the ranks were computed with (at overload factor ``_rank_load``), in the unit of the
        aging clock: tokens of admitted weight, or seconds."""
        # Requests popped since begin_step() -> which overdue reason brought them: "max_wait", "slip" or None.
        self.step_popped: dict[Request, str | None] = {}

    # ---- policy ---------------------------------------------------------------------------------
    def _cached_tokens(self, request: Request) -> int:
        if self._lookup is None:
            return 0
        self.stats.lookups += 1
        hit = self._lookup(request)
        return max(int(hit or 0), 0)

    def weigh(self, uncached: int, cached: int, expected_output: int) -> float:
        """A request's weight: its measured cost in prefill-token equivalents when a cost model is set, else the
        token weight (uncached prompt + output_weight x expected output)."""
        if self.costs is not None:
            w = self.costs.request_weight(uncached, cached, expected_output, self.batch)
            if w is not None:
                return w
        return weight(uncached, expected_output, self.config)

    def _ctx_ratio(self) -> float:
        costs = self.costs
        return costs.per_ctx / costs.per_token if costs is not None and costs.per_token > 0 else 0.0

    @staticmethod
    def _prefill_of(e: _Entry, ctx_ratio: float) -> float:
        cached = min(e.cached_tokens, e.prompt_tokens)
        return prefill_tokens(e.prompt_tokens - cached, cached, ctx_ratio)

    def _set_prefill(self, e: _Entry) -> None:
        p = self._prefill_of(e, self._ctx_ratio())
        if e.payload in self._members:
            self.queued_prefill += p - e.prefill
        e.prefill = p

    def prefill_share(self) -> float | None:
        """Prefill's share of the scored lane's weight (None when empty): a decode-bound engine's queue is mostly its
        requests' outputs, which no order shortens."""
        if self.queued_weight <= 0:
            return None
        return min(self.queued_prefill / self.queued_weight, 1.0)

    def backlog_tokens(self) -> float:
        """What the waiting requests still have to prefill, in prefill-token equivalents (prepended ones by their
        uncomputed tokens)."""
        ratio = self._ctx_ratio()
        front = sum(prefill_tokens(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens, ratio)
                    for r in self._front)
        return max(self.queued_prefill, 0.0) + front

    @property
    def exact(self) -> bool:
        """The queue currently makes vLLM's own decisions (gated and not overloaded)."""
        return self._exact

    def _exact_key(self, e: _Entry) -> tuple:
        """vLLM's own order: insertion order, or (priority, arrival, id) under the priority policy."""
        if self._use_priority:
            request: Request = e.payload
            return (request.priority, request.arrival_time, request.request_id, e.seq)
        return (e.seq,)

    def _key(self, e: _Entry) -> tuple:
        return self._exact_key(e) if self._exact else _sort_tuple(e, self._use_priority, self._fcfs)

    def _weight_of(self, e: _Entry) -> float:
        cached = min(e.cached_tokens, e.prompt_tokens)
        return self.weigh(e.prompt_tokens - cached, cached,
                          expected_output_tokens(e.max_tokens, e.extra_args, self.config))

    def _rescore(self, e: _Entry) -> None:
        request: Request = e.payload
        e.prompt_tokens = request.num_tokens
        arrival = aging_clock(e, self.config)
        if self._epoch is None:
            self._epoch = arrival
        e.w = self._weight_of(e)
        e.rank = rank_key(e.w, arrival, self.config, self._epoch, self._rank_load)
        self._set_prefill(e)

    def set_costs(self, costs: StepCostModel | None, batch: float) -> None:
        """Weigh by ``costs`` (at ``batch`` requests per step) from now on: every waiting request is re-weighed and
        re-ranked, and the queued weight recounted; slip deadlines already given are kept (the slip floor's history
        restarts when the weight's unit changes: token weight to measured costs or back)."""
        if (costs is None) != (self.costs is None):
            self.slip_floor.clear()
        self.costs, self.batch = costs, max(batch, 1.0)
        total = prefill = 0.0
        ratio = self._ctx_ratio()
        for e in self._lane[self._head:]:
            if e.removed:
                continue
            e.w = e.queued_w = self._weight_of(e)
            e.rank = rank_key(e.w, aging_clock(e, self.config), self.config, self._epoch or 0.0, self._rank_load)
            e.prefill = self._prefill_of(e, ratio)
            total += e.w
            prefill += e.prefill
        self.queued_weight, self.queued_prefill = total, prefill

    def refresh(self, now: float, max_lookups: int | None = None, step_tokens: float | None = None) -> None:
        """Re-sort the scored lane for the step starting at ``now`` (the only place its order changes).

        The cached-prefix estimates of the first ``min(lookup_candidates, max_lookups)`` scored requests are
        looked up again first (the scheduler passes about twice its free running slots: no more can be
        admitted this step, and with a full batch no lookup is needed at all). ``step_tokens``: the token budget
        a step has for prefills (the gate's unit; None: the gate does not move).
        """
        self._now = now
        cfg = self.config
        if self.gate is not None and step_tokens is not None:
            was_exact = self._exact
            self._exact = not self.gate.update(self.backlog_tokens() / max(step_tokens, 1.0), self.prefill_share())
            if self._exact and was_exact:
                return  # the lane is in vLLM's order already: added in it (insort), removals skipped when popped
        live = [e for e in self._lane[self._head:] if not e.removed]
        if self._exact:  # vLLM's own order: no overdue lane, no lookups, no grouping
            for e in live:
                e.overdue = e.slipped = False
                e.sort = self._key(e)
            live.sort(key=_sort_of)
            self._lane, self._head = live, 0
            return
        self.load = load_factor(self.arriving_rate.rate(now), self.admitted_rate.rate(now))
        h = half_life(cfg, self.load)
        if abs(h - self.half_life) > RERANK_TOLERANCE * self.half_life:
            # Ranks compare effective weights for one half-life: recompute them all when it moves.
            self.half_life, self._rank_load = h, self.load
            for e in live:
                e.rank = rank_key(e.w, aging_clock(e, cfg), cfg, self._epoch or 0.0, self._rank_load)
        num_scored = 0
        for e in live:
            e.overdue = is_overdue(e.arrival_time, now, cfg, self.work, e.deadline_work)
            e.slipped = e.overdue and not is_overdue(e.arrival_time, now, cfg)
            num_scored += not e.overdue
        self._fcfs = 0 < cfg.fcfs_above < num_scored or (self.await_costs and self.costs is None)
        for e in live:
            e.sort = self._key(e)
        live.sort(key=_sort_of)
        # the first request not overdue (with priorities the classes come first: overdue ones of a lower class sort
        # after it)
        first_scored = next((i for i, e in enumerate(live) if not e.overdue), len(live))
        num_lookups = cfg.lookup_candidates if max_lookups is None else min(cfg.lookup_candidates, max_lookups)
        if not self._fcfs and num_lookups > 0 and self._lookup is not None and num_scored:
            window = live[first_scored:first_scored + num_lookups]
            changed = False
            for e in window:
                cached = self._cached_tokens(e.payload)
                if cached != e.cached_tokens or e.prompt_tokens != e.payload.num_tokens:
                    e.cached_tokens = cached
                    self._rescore(e)
                    e.sort = self._key(e)
                    changed = True
            if changed:
                live.sort(key=_sort_of)  # nearly sorted: linear time
        if not self._fcfs and cfg.group_ratio > 1.0 and num_scored >= 3:
            live = self._group(live, first_scored)
        self._lane = live
        self._head = 0

    def _group(self, live: list[_Entry], start: int) -> list[_Entry]:
        end = min(len(live), start + max(self.config.lookup_candidates, 2))
        weights = [0.0] * start + [e.w for e in live[start:end]]
        weights += [0.0] * (len(live) - end)
        # The window's sort tuples are no longer monotone; that only affects where a request added
        # before the next refresh() is inserted (the scheduler always refreshes first).
        return group_window(live, weights, start, self.config)

    def begin_step(self) -> None:
        self.step_popped = {}

    def half_life_stat(self) -> dict[str, float | None]:
        """The half-life in use, keyed by its clock's unit (the other key None)."""
        tokens = self.config.work_clock
        return {"half_life_tokens": self.half_life if tokens else None,
                "half_life_s": None if tokens else self.half_life}

    def record_admitted(self, now: float, weight: float) -> None:
        """Weight admitted by the step at ``now``: feeds the admitted rate and advances the work clock."""
        self.admitted_rate.record(now, weight)
        self.work += weight

    # ---- RequestQueue ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Add a new waiting request to the scored lane (looked up in the prefix cache once, now)."""
        if request in self._members:
            return
        self._seq += 1
        e = _Entry(arrival_time=request.arrival_time, prompt_tokens=request.num_tokens,
                   max_tokens=request.max_tokens, extra_args=_extra_args(request), priority=request.priority,
                   seq=self._seq, payload=request, arrival_work=self.work)
        if self._lookup is not None and not self._fcfs and self.config.lookup_candidates > 0:
            e.cached_tokens = self._cached_tokens(request)
        self._rescore(e)
        self.arriving_rate.record(e.arrival_time, e.w)
        floor = self.slip_floor.observe(self.queued_weight) if self.config.max_slip > 0 else 0.0
        e.deadline_work = slip_deadline(self.work, self.queued_weight, self.config, floor)
        e.queued_w = e.w
        self.queued_weight += e.w
        e.overdue = not self._exact and is_overdue(e.arrival_time, self._now, self.config, self.work,
                                                   e.deadline_work)
        self._members[request] = e
        self.queued_prefill += e.prefill
        e.sort = self._key(e)
        if self._head and self._head * 2 > len(self._lane):
            self._lane = [x for x in self._lane[self._head:] if not x.removed]
            self._head = 0
        bisect.insort(self._lane, e, lo=self._head, key=_sort_of)

    def _next_entry(self) -> _Entry | None:
        lane = self._lane
        while self._head < len(lane) and lane[self._head].removed:
            self._head += 1
        return lane[self._head] if self._head < len(lane) else None

    def _from_front(self, e: _Entry | None) -> bool:
        """Whether the next request comes from the front lane (``e``: the scored lane's head). Under vLLM's FCFS
        the front lane always goes first; under its priority policy a prepended request waits for its class, as
        in vLLM's heap — and while the queue is exact, the whole of vLLM's request order decides."""
        if not self._front:
            return False
        if e is None or not self._use_priority:
            return True
        head: Request = self._front[0]
        if self._exact:
            return head < e.payload
        return head.priority <= e.priority

    def pop_request(self) -> Request:
        e = self._next_entry()
        if self._from_front(e):
            request = self._front.popleft()
            self.step_popped[request] = None
            return request
        if e is None:
            raise IndexError("pop from an empty queue")
        self._head += 1
        del self._members[e.payload]
        self._drop(e)
        self.step_popped[e.payload] = ("slip" if e.slipped else "max_wait") if e.overdue else None
        return e.payload

    def peek_request(self) -> Request:
        e = self._next_entry()
        if self._from_front(e):
            return self._front[0]
        if e is None:
            raise IndexError("peek from an empty queue")
        return e.payload

    def _drop(self, e: _Entry) -> None:
        """Mark a scored-lane entry gone (its weight leaves ``queued_weight``, its prefill ``queued_prefill``)."""
        e.removed = True
        self.queued_weight = max(self.queued_weight - e.queued_w, 0.0) if self._members else 0.0
        self.queued_prefill = max(self.queued_prefill - e.prefill, 0.0) if self._members else 0.0

    def _leave_scored_lane(self, request: Request) -> None:
        e = self._members.pop(request, None)
        if e is not None:  # never the case in vLLM's use; keeps every request in one lane only
            self._drop(e)

    def _front_insert(self, request: Request) -> None:
        """Under the priority policy the front lane is kept in vLLM's request order (its queue is a heap)."""
        self._front.insert(bisect.bisect(self._front, request), request)

    def prepend_request(self, request: Request) -> None:
        self._leave_scored_lane(request)
        if self._use_priority:
            self._front_insert(request)
        else:
            self._front.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # Same order contract as FCFSRequestQueue (deque.extendleft): the scheduler passes its skipped
        # requests reversed, so the front lane keeps their original order.
        requests = list(requests)
        for request in requests:
            self._leave_scored_lane(request)
        if self._use_priority:
            for request in requests:
                self._front_insert(request)
        else:
            self._front.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        e = self._members.pop(request, None)
        if e is not None:
            self._drop(e)
        else:
            self._front.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        targets = set(requests)
        in_front = False
        for request in targets:
            e = self._members.pop(request, None)
            if e is not None:
                self._drop(e)
            else:
                in_front = True
        if in_front and self._front:
            kept = [r for r in self._front if r not in targets]
            self._front.clear()
            self._front.extend(kept)

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._members)

    def __len__(self) -> int:
        return len(self._front) + len(self._members)

    def __iter__(self) -> Iterator[Request]:
        yield from list(self._front)
        yield from [e.payload for e in self._lane[self._head:] if not e.removed]

    def __contains__(self, request: object) -> bool:
        return request in self._members or request in self._front

    @property
    def front_lane(self) -> list[Request]:
        return list(self._front)


def _extra_args(request: Request) -> dict[str, Any] | None:
    params = request.sampling_params
    return params.extra_args if params is not None else None


_BOUND_POLICY: PolicyConfig | None = None
"""The policy :func:`install` bound in this process (the engine core's settings, passed in by the general plugin)."""
_BOUND_AUTO = False
"""Whether that policy sits behind the overload gate (``token_weighted_scheduler=auto``)."""


def bind_policy(policy: PolicyConfig, mode: str = "true") -> None:
    """The policy every token-weighted scheduler built in this process starts with, and the
    ``token_weighted_scheduler`` mode (``auto``: behind the overload gate; ``true``/``false``: not gated — an
    explicit ``--scheduler-cls`` with the setting false runs the policy always, as before the gate existed)."""
    global _BOUND_POLICY, _BOUND_AUTO
    _BOUND_POLICY, _BOUND_AUTO = policy, mode == "auto"


class TokenWeightedMixin:
    """Mixin for a vLLM V1 ``Scheduler`` subclass: token-weighted, cache-aware admission.

    Replaces ``self.waiting`` after ``Scheduler.__init__`` and, at the start of each ``schedule()``,
    refreshes the cached-prefix estimates of the first K candidates and re-sorts the scored lane. The policy
    is the one :func:`install` bound (the ``sched_*`` settings; the defaults when none was bound), behind the
    overload gate with ``token_weighted_scheduler=auto``; :meth:`qwen_configure` swaps the policy, the gate or the
    clock (``time.time``, the clock of ``Request.arrival_time``), e.g. in tests.
    """

    qwen_stats: AdmissionStats
    waiting: TokenWeightedRequestQueue

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qwen_clock: Callable[[], float] = time.time
        self.qwen_stats = AdmissionStats()
        self.qwen_policy = _BOUND_POLICY or PolicyConfig()
        self.qwen_auto = _BOUND_AUTO
        """Behind the overload gate: exactly vLLM's decisions until the engine is overloaded."""
        self.qwen_costs = CostFit(COST_FORGET)
        """The online step-cost fit (fed every step; solved every ``COST_REFIT_STEPS``)."""
        self.qwen_batch = 0.0
        """Requests per step, exponentially averaged over busy steps."""
        self._qwen_steps: deque[tuple[float, tuple[float, ...]]] = deque(maxlen=2)
        """The latest busy steps: (time schedule() started, step-cost features)."""
        self._qwen_install_queue()

    def _qwen_install_queue(self) -> None:
        old = self.waiting
        new = TokenWeightedRequestQueue(
            self.qwen_policy, lookup=self._qwen_cached_tokens,
            use_priority=self.policy == SchedulingPolicy.PRIORITY, stats=self.qwen_stats, gated=self.qwen_auto)
        new.await_costs = self.qwen_policy.measured_costs
        # Empty right after __init__; qwen_configure() carries the waiting requests over.
        if isinstance(old, TokenWeightedRequestQueue):
            front, scored = old.front_lane, [r for r in old if r not in set(old.front_lane)]
            new.work = old.work
        else:
            front = [r for r in old if r.status == RequestStatus.PREEMPTED]
            scored = [r for r in old if r.status != RequestStatus.PREEMPTED]
        new._front.extend(front)
        for request in scored:
            new.add_request(request)
        self.waiting = new
        self._qwen_apply_costs()

    def qwen_configure(self, policy: PolicyConfig | None = None,
                       clock: Callable[[], float] | None = None, auto: bool | None = None) -> None:
        """Change the policy, the gate (``auto``) and/or the clock (re-queues the waiting requests under the new
        policy)."""
        if clock is not None:
            self.qwen_clock = clock
        if auto is not None:
            self.qwen_auto = auto
        if policy is not None or auto is not None:
            self.qwen_policy = policy or self.qwen_policy
            self._qwen_install_queue()

    def _qwen_cached_tokens(self, request: Request) -> int | None:
        """Read-only prefix-cache hit of a request that holds no blocks (None when not looked up)."""
        if request.num_computed_tokens > 0:
            return None
        manager = self.kv_cache_manager
        if (getattr(manager, "enable_kv_cache_events", False)
                and getattr(request, "kv_cache_report_mode", "incremental") == "full"):
            return None  # that lookup would publish BlockStored events: not read-only
        _, num_cached, _ = manager.get_computed_blocks(request)
        return num_cached

    def _qwen_free_slots(self) -> int:
        """Upper bound on this step's admissions from the waiting queues (as the admission loop counts)."""
        limit = getattr(self, "max_num_active_reqs", None) or self.max_num_running_reqs
        busy = len(self.running) + getattr(self, "num_waiting_for_streaming_input", 0)
        return max(limit - busy, 0)

    def _qwen_step_tokens(self) -> int:
        """The token budget a step has for prefills: the engine's budget less one token per running request (its
        decode)."""
        return max(self.max_num_scheduled_tokens - len(self.running), 1)

    def schedule(self, *args: Any, **kwargs: Any):
        now = self.qwen_clock()
        self._qwen_observe_step(now)
        queue = self.waiting
        queue.refresh(now, max_lookups=2 * self._qwen_free_slots(), step_tokens=self._qwen_step_tokens())
        queue.begin_step()
        output = super().schedule(*args, **kwargs)
        self._qwen_record_step(output, now)
        _publish(self, now)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(*args, **kwargs)
        if not self.has_unfinished_requests():
            self._qwen_steps.clear()  # the engine goes idle: the next interval is not a step's duration
            _publish(self, self.qwen_clock(), idle=True)
        return outputs

    # ---- the engine's own costs -------------------------------------------------------------------
    def _qwen_observe_step(self, now: float) -> None:
        """Feed one step to the online cost fit: the interval from the previous ``schedule()`` call to this one is
        the duration of the previous step — or, with async scheduling (a batch queue of two: vLLM schedules step k+1
        as soon as step k-1 has finished, while step k runs), of the step before it. Re-solve every
        ``COST_REFIT_STEPS`` steps."""
        steps = self._qwen_steps
        lag = 1 if isinstance(self, AsyncScheduler) else 0
        if len(steps) < 1 + lag:
            return
        dt = now - steps[-1][0]
        x = steps[-1 - lag][1]
        if not 0 < dt <= COST_MAX_GAP_S:
            return
        fit = self.qwen_costs
        fit.add(x, dt)
        self.qwen_batch = x[1] if fit.samples == 1 else (1 - BATCH_EWMA) * self.qwen_batch + BATCH_EWMA * x[1]
        if fit.samples >= COST_MIN_STEPS and fit.samples % COST_REFIT_STEPS == 0:
            self._qwen_apply_costs()

    def qwen_warm_costs(self, fit: CostFit, batch: float) -> None:
        """Start the online cost fit from ``fit`` (a copy) and ``batch`` requests per step: a scheduler restarted on
        an engine whose costs are known, or a simulation of one that has been serving (:mod:`.sim`)."""
        import copy

        self.qwen_costs = copy.deepcopy(fit)
        self.qwen_costs.forget = COST_FORGET
        self.qwen_batch = batch
        self._qwen_apply_costs(min_steps=0)

    def _qwen_apply_costs(self, min_steps: int | None = None) -> None:
        """Give the queue the current cost fit (with ``measured_costs`` and ``min_steps`` steps fitted; else None:
        the token weight, or arrival order while ``measured_costs`` waits for a fit)."""
        model = None
        min_steps = COST_MIN_STEPS if min_steps is None else min_steps
        if self.qwen_policy.measured_costs and self.qwen_costs.samples >= min_steps:
            model = self.qwen_costs.solve()
            if model is not None and not model.per_token > 0:
                model = None
        self.waiting.set_costs(model, self.qwen_batch)

    def _qwen_record_step(self, output: Any, now: float) -> None:
        popped = self.waiting.step_popped
        scheduled = output.num_scheduled_tokens
        cfg = self.qwen_policy
        weights: list[float] = []
        waits: list[float] = []
        overdue = slipped = cache_hits = prompt_tokens = 0
        queue = self.waiting
        if scheduled:
            n_reqs, tokens, _, prefill_ctx, decode_ctx = step_composition(self.requests, output)
            self._qwen_steps.append((now, features(n_reqs, tokens, prefill_ctx, decode_ctx)))
        else:
            self._qwen_steps.clear()  # nothing ran: no interval starting here is a step's duration
        for request, reason in popped.items():
            if request.status != RequestStatus.RUNNING or request.request_id not in scheduled:
                continue  # skipped (re-prepended) or handed to an async KV load
            cached = max(request.num_computed_tokens - scheduled[request.request_id], 0)
            expected = expected_output_tokens(request.max_tokens, _extra_args(request), cfg)
            weights.append(queue.weigh(request.num_tokens - cached, cached, expected - request.num_output_tokens))
            overdue += reason == "max_wait"
            slipped += reason == "slip"
            if request.num_preemptions == 0:
                waits.append(max(now - request.arrival_time, 0.0))
                cache_hits += cached
                prompt_tokens += request.num_prompt_tokens
        self.qwen_stats.record_step(weights, waits, overdue, cache_hits, prompt_tokens, slipped)
        queue.record_admitted(now, sum(weights))
        queue.begin_step()

    def qwen_status(self) -> dict[str, Any]:
        """What the health route can show: the class, the policy and the stats snapshot."""
        queue = self.waiting
        costs = queue.costs
        output_weight = costs.output_weight(0, queue.batch) if costs is not None else None
        gate = queue.gate
        if gate is not None and queue.exact:
            ordering = "arrival: vLLM's own order (not overloaded)"
        elif queue.await_costs and costs is None:
            ordering = "arrival (waiting for the cost fit)"
        else:
            ordering = "token-weighted"
        return {
            "scheduler": type(self).__name__,
            "mode": "auto" if gate is not None else "true",
            "policy": dataclasses.asdict(self.qwen_policy),
            "gate": None if gate is None else {"overloaded": gate.overloaded, "switches": gate.switches,
                                               "backlog_steps": round(gate.backlog_steps, 3),
                                               "prefill_share": None if gate.prefill_share is None
                                               else round(gate.prefill_share, 4)},
            "stats": {**self.qwen_stats.snapshot(), "load_factor": queue.load,
                      "overloaded": None if gate is None else int(gate.overloaded),
                      "backlog_steps": None if gate is None else gate.backlog_steps,
                      "gate_switches": None if gate is None else gate.switches,
                      "admitted_weight": queue.work, **queue.half_life_stat(),
                      "cost_steps_fitted": self.qwen_costs.samples, "output_token_weight": output_weight},
            "costs": {"model": dataclasses.asdict(costs) if costs is not None else None, "batch": queue.batch,
                      "ordering": ordering},
        }


class TokenWeightedScheduler(TokenWeightedMixin, Scheduler):
    """Token-weighted ``Scheduler``; constructs a :class:`TokenWeightedAsyncScheduler` when the config has
    async scheduling on, so one ``--scheduler-cls`` path serves CPU (sync) and GPU (async) engines."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is TokenWeightedScheduler:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if vllm_config is not None:
                cls = pick_scheduler_cls(vllm_config.scheduler_config)
        return super().__new__(cls)


class TokenWeightedAsyncScheduler(TokenWeightedScheduler, AsyncScheduler):
    """Token-weighted ``AsyncScheduler`` (MRO: mixin, then AsyncScheduler, then Scheduler)."""


def step_composition(requests: dict[str, Request], output: Any) -> tuple[int, int, int, float, float]:
    """(requests, tokens, prefill tokens, prefill context, decode context) of a step, read right after
    ``schedule()`` (which has already advanced ``num_computed_tokens``); ``requests``: the scheduler's by id. The
    regressors of the step-cost model (:func:`~.costs.features`) are all but the prefill tokens."""
    n_tok = pre_tok = 0
    pre_ctx = dec_ctx = 0.0
    for rid, n_sched in output.num_scheduled_tokens.items():
        n_tok += n_sched
        req = requests.get(rid)
        if req is None:
            continue
        before = req.num_computed_tokens - n_sched
        if before < req.num_prompt_tokens:
            pre_tok += n_sched
            pre_ctx += n_sched * (before + n_sched / 2)
        else:
            dec_ctx += before + n_sched
    return len(output.num_scheduled_tokens), n_tok, pre_tok, pre_ctx, dec_ctx


def pick_scheduler_cls(scheduler_config: Any) -> type[TokenWeightedScheduler]:
    """The token-weighted class matching vLLM's ``SchedulerConfig``: async when async scheduling is on."""
    if getattr(scheduler_config, "async_scheduling", False):
        return TokenWeightedAsyncScheduler
    return TokenWeightedScheduler


# ---- monkeypatch mode and stats publishing -----------------------------------------------------------
_MARK = "_qwen_vllm_ext_token_weighted"

# Compatibility guard (qwen_vllm_ext.integration.guard): what install() and the classes above replace or
# wrap -> fingerprint per vLLM version.
PATCH_TARGETS = {
    "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls": {"0.32.0": "bd54dad32b43bf04", "0.33.0": "bd54dad32b43bf04"},
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": {"0.32.0": "0afd4b561401cafb", "0.33.0": "8976aeb2f6ca1604"},
    "vllm.v1.core.sched.request_queue:RequestQueue": {"0.32.0": "c69f67068c484470", "0.33.0": "c69f67068c484470"},
}
PUBLISH_EVERY_S = 1.0
COST_FORGET = 0.999
"""The online cost fit forgets old steps by this factor per step (a memory of about a thousand steps)."""
COST_MIN_STEPS = 200
"""Busy steps the fit needs before the scheduler weighs by it (before that: arrival order with ``measured_costs``)."""
COST_REFIT_STEPS = 50
"""The fit is re-solved (and every waiting request re-weighed) every this many steps."""
COST_MAX_GAP_S = 2.0
"""An interval between two ``schedule()`` calls longer than this is idle time, not a step."""
BATCH_EWMA = 0.01
"""Weight of the newest step in the requests-per-step average."""


def install(settings) -> bool:
    """Monkeypatch mode: engines whose ``--scheduler-cls`` is unset get the token-weighted scheduler.

    Wraps ``SchedulerConfig.get_scheduler_cls`` (``vllm/config/scheduler.py``), which the engine core calls to
    pick its scheduler; an explicit ``--scheduler-cls`` still wins. Idempotent. (The general plugin binds the
    ``sched_*`` settings in every engine core, :func:`bind_policy`, whether or not this patch is on.)
    """
    bind_policy(settings.scheduler, settings.token_weighted_scheduler)
    if settings.token_weighted_scheduler == "false":
        return False
    from vllm.config.scheduler import SchedulerConfig

    if getattr(SchedulerConfig, _MARK, False):
        return True
    original = SchedulerConfig.get_scheduler_cls

    def get_scheduler_cls(self):
        if self.scheduler_cls is None:
            return pick_scheduler_cls(self)
        return original(self)

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    setattr(SchedulerConfig, _MARK, True)
    return True


def _publish(scheduler: TokenWeightedMixin, now: float, idle: bool = False) -> None:
    """Write ``qwen_status()`` for the API server's health route and /metrics: at most once per
    ``PUBLISH_EVERY_S`` while the engine is busy (a file write per step was a third of the scheduler's own cost
    per step), and at once when it goes idle with unpublished admissions (``idle``: it then stops calling
    schedule(), so the last admissions must not wait for a timer)."""
    admitted = scheduler.qwen_stats.admitted
    changed = admitted != getattr(scheduler, "_qwen_published_admitted", -1)
    if not (idle and changed) and now - getattr(scheduler, "_qwen_published", -math.inf) < PUBLISH_EVERY_S:
        return
    scheduler._qwen_published, scheduler._qwen_published_admitted = now, admitted
    from ..observability import status

    status.write_json(f"scheduler-{os.getpid()}.json", {"pid": os.getpid(), **scheduler.qwen_status()})
