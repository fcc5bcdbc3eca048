"""The release version of the qwen-vllm-ext distribution (the one source: pyproject.toml reads it, qwen_vllm_ext
re-exports it)."""
__version__ = "0.2.0"
