"""The mixin that makes a vLLM V1 ``Scheduler`` token-weighted, with the engine's own costs
(:class:`TokenWeightedMixin`; the scheduler classes built on it are in :mod:`.vllm_scheduler`).

It puts :class:`~.request_queue.TokenWeightedRequestQueue` in place of ``self.waiting``, fits the engine's step
costs online (:class:`~.costs.CostFit`: the time between two ``schedule()`` calls against the step's composition,
:func:`step_composition`) and gives the queue the fitted model to weigh requests by, records what each step admitted
(:class:`~.policy.AdmissionStats`, the work clock) and publishes its status for the health route and /metrics.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request, RequestStatus

from .costs import CostFit, features
from .policy import AdmissionStats, PolicyConfig, expected_output_tokens
from .request_queue import TokenWeightedRequestQueue, extra_args

__all__ = ["TokenWeightedMixin", "step_composition"]

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


class TokenWeightedMixin:
    """Mixin for a vLLM V1 ``Scheduler`` subclass: token-weighted, cache-aware admission.

    Replaces ``self.waiting`` after ``Scheduler.__init__`` and, at the start of each ``schedule()``,
    refreshes the cached-prefix estimates of the first K candidates and re-sorts the scored lane. The policy
    is the one :func:`~.patching.bind_policy` bound (the ``sched_*`` settings; the defaults when none was bound),
    behind the overload gate with ``token_weighted_scheduler=auto``; :meth:`qwen_configure` swaps the policy, the
    gate or the clock (``time.time``, the clock of ``Request.arrival_time``), e.g. in tests.
    """

    qwen_stats: AdmissionStats
    waiting: TokenWeightedRequestQueue
    qwen_bound: tuple[PolicyConfig | None, bool] = (None, False)
    """The policy every scheduler built in this process starts with (None: the defaults) and whether it sits behind
    the overload gate (``token_weighted_scheduler=auto``): set by :func:`~.patching.bind_policy`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qwen_clock: Callable[[], float] = time.time
        self.qwen_stats = AdmissionStats()
        bound, auto = self.qwen_bound
        self.qwen_policy = bound or PolicyConfig()
        self.qwen_auto = auto
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
            expected = expected_output_tokens(request.max_tokens, extra_args(request), cfg)
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
