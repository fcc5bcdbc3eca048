"""The benchmarks (never in the wheel): run from the repository root as ``python -m benchmarks.<name>``; the tests
import them as ``benchmarks.<name>``. Shared code they need lives in the package (``qwen_vllm_ext.bench``)."""
