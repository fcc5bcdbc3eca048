"""TokenStorm: a token-aware load generator that also checks accounting and rate-limit header honesty.

``python -m qwen_vllm_ext.bench.token_storm --base-url URL --model NAME ...`` (console script ``token-storm``).
Pure parts: :mod:`.workload` (length distributions, arrivals), :mod:`.prompts` (exact-length prompts),
:mod:`.analysis` (latency metrics, accounting and header checks); :mod:`.report` prints/writes/plots;
:mod:`.token_storm` runs the load with :mod:`qwen_vllm_ext.client`.

Also what the repository's benchmarks (``benchmarks/``, never in the wheel) share: :mod:`.paired` (paired A/B ratios
with intervals), :mod:`.scheduler_traces` (the scheduler benchmark's traces, engine settings and per-run metrics,
used by the real-engine benchmark and the simulator alike) and :mod:`.server` (server processes).
"""
