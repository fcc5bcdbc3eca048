"""TokenStorm: a token-aware load generator that also checks accounting and rate-limit header honesty.

``python -m qwen_vllm_ext.bench.token_storm --base-url URL --model NAME ...`` (console script ``token-storm``).
Pure parts: :mod:`.workload` (length distributions, arrivals), :mod:`.prompts` (exact-length prompts),
:mod:`.analysis` (latency metrics, accounting and header checks); :mod:`.report` prints/writes/plots;
:mod:`.token_storm` runs the load with :mod:`qwen_vllm_ext.client`.
"""
