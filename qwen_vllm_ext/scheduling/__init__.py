"""Token-weighted, cache-aware admission scheduling.

:mod:`.policy` is the pure-Python policy (weights, aging, max wait, grouping, stats; no vLLM import) and
:mod:`.costs` the step-cost model. The vLLM glue, the only modules touching vLLM's scheduler internals:
:mod:`.request_queue` (the waiting queue), :mod:`.engine_costs` (the mixin: the queue installed, the engine's costs
measured) and :mod:`.vllm_scheduler` (the scheduler classes: ``--scheduler-cls
qwen_vllm_ext.scheduling.vllm_scheduler.TokenWeightedScheduler``); :mod:`.patching` is monkeypatch mode and the
policy bound in the process.
"""
