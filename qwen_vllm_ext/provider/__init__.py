"""Serving as an aggregator's (OpenRouter's) provider: the model listing, SSE keep-alives (pure cores and ASGI layers;
the only vLLM reads are in :mod:`.vllm_facts`). Prices live in ``qwen_v3_calculator.billing.Prices``; capacity 429s
are the gateway's (:mod:`qwen_vllm_ext.gateway.capacity`)."""
