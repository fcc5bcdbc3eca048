"""Usage accounting of qwen-vllm-ext: per-chunk usage, the durable usage ledger (:mod:`.ledger`) and its
operator CLI (``python -m qwen_vllm_ext.usage``)."""
