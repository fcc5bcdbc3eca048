"""The token-weighted waiting queue: what the token-weighted scheduler (:mod:`.vllm_scheduler`) puts in place of
vLLM's ``RequestQueue`` (``vllm/v1/core/sched/request_queue.py``) as ``self.waiting``; written against vLLM 0.32/0.33.

The scheduler's admission loop peeks the head, pops it when admitted, ``break`` s on KV-allocation failure and
*prepends* preempted and skipped requests. :class:`TokenWeightedRequestQueue` keeps

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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from .costs import StepCostModel
from .policy import (AdmissionStats, Job, OverloadGate, PolicyConfig, RateMeter, SlipFloor, aging_clock,
                     expected_output_tokens, group_window, half_life, is_overdue, lane_key, load_factor,
                     prefill_tokens, rank_key, slip_deadline, weight)

__all__ = ["TokenWeightedRequestQueue", "extra_args"]


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
                   max_tokens=request.max_tokens, extra_args=extra_args(request), priority=request.priority,
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


def extra_args(request: Request) -> dict[str, Any] | None:
    """The request's ``SamplingParams.extra_args`` (the client's hints; None without sampling parameters)."""
    params = request.sampling_params
    return params.extra_args if params is not None else None
