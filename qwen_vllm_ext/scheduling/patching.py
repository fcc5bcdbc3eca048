"""How the token-weighted scheduler reaches vLLM's engine core: the policy bound in this process and monkeypatch mode.

:func:`bind_policy` binds the policy every token-weighted scheduler built in this process starts with (the engine
core's ``sched_*`` settings and the ``token_weighted_scheduler`` mode: the general plugin binds them in every engine
core, the source-patch hook where vLLM is patched). :func:`install` is the runtime patch ``token_weighted_scheduler``
(:mod:`qwen_vllm_ext.integration.runtime_patches`): engines whose ``--scheduler-cls`` is unset get the token-weighted
scheduler; :data:`PATCH_TARGETS` lists the vLLM code it and the scheduler classes replace or wrap (the
compatibility guard's fingerprints).
"""
from __future__ import annotations

from .engine_costs import TokenWeightedMixin
from .policy import PolicyConfig
from .vllm_scheduler import pick_scheduler_cls

__all__ = ["PATCH_TARGETS", "bind_policy", "install"]

_MARK = "_qwen_vllm_ext_token_weighted"

# Compatibility guard (qwen_vllm_ext.integration.guard): what install() and the scheduler classes
# (vllm_scheduler, engine_costs, request_queue) replace or wrap -> fingerprint per vLLM version.
PATCH_TARGETS = {
    "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls": {"0.32.0": "bd54dad32b43bf04", "0.33.0": "bd54dad32b43bf04"},
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": {"0.32.0": "0afd4b561401cafb", "0.33.0": "8976aeb2f6ca1604"},
    "vllm.v1.core.sched.request_queue:RequestQueue": {"0.32.0": "c69f67068c484470", "0.33.0": "c69f67068c484470"},
}


def bind_policy(policy: PolicyConfig, mode: str = "true") -> None:
    """The policy every token-weighted scheduler built in this process starts with, and the
    ``token_weighted_scheduler`` mode (``auto``: behind the overload gate; ``true``/``false``: not gated — an
    explicit ``--scheduler-cls`` with the setting false runs the policy always, as before the gate existed). Kept on
    the mixin (:attr:`~.engine_costs.TokenWeightedMixin.qwen_bound`), which every scheduler reads when it is built."""
    TokenWeightedMixin.qwen_bound = (policy, mode == "auto")


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
