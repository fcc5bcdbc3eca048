"""Token-weighted, cache-aware admission scheduling.

:mod:`.policy` is the pure-Python policy (weights, aging, max wait, grouping, stats; no vLLM import);
:mod:`.vllm_scheduler` holds the vLLM V1 scheduler classes (``--scheduler-cls
qwen_vllm_ext.scheduling.vllm_scheduler.TokenWeightedScheduler``) and is the only module touching vLLM's
scheduler internals.
"""
