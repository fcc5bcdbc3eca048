"""vLLM V1 scheduler classes for token-weighted, cache-aware admission (written against vLLM 0.32/0.33
``vllm/v1/core/sched``).

Use ``--scheduler-cls qwen_vllm_ext.scheduling.vllm_scheduler.TokenWeightedScheduler``: constructing it
yields :class:`TokenWeightedAsyncScheduler` (an ``AsyncScheduler``) when the config has async scheduling on
(the GPU default), else the plain-``Scheduler`` variant (CPU), the way upstream pairs
``DiffusionScheduler`` / ``DiffusionAsyncScheduler``. :func:`pick_scheduler_cls` makes the same choice.

What changes against upstream: only ``self.waiting``, a :class:`~.request_queue.TokenWeightedRequestQueue`
(:mod:`.request_queue`: the front lane, the scored lane, the cache lookups), installed and fed with the engine's
measured step costs by :class:`~.engine_costs.TokenWeightedMixin` (:mod:`.engine_costs`). These three modules are
the only ones touching vLLM's scheduler internals; the queue, the mixin and :func:`~.engine_costs.step_composition`
are importable from here too. Monkeypatch mode and the policy bound in the process: :mod:`.patching`.
"""
from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .engine_costs import TokenWeightedMixin, step_composition
from .request_queue import TokenWeightedRequestQueue

__all__ = [
    "TokenWeightedRequestQueue",
    "TokenWeightedMixin",
    "TokenWeightedScheduler",
    "TokenWeightedAsyncScheduler",
    "pick_scheduler_cls",
    "step_composition",
]


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


def pick_scheduler_cls(scheduler_config: Any) -> type[TokenWeightedScheduler]:
    """The token-weighted class matching vLLM's ``SchedulerConfig``: async when async scheduling is on."""
    if getattr(scheduler_config, "async_scheduling", False):
        return TokenWeightedAsyncScheduler
    return TokenWeightedScheduler
