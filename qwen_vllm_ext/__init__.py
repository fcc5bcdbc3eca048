"""qwen-vllm-ext: a vLLM extension for serving Qwen models.

Importing this package never imports vLLM; the pieces that need vLLM import it lazily through
:func:`qwen_vllm_ext._vllm.require_vllm`, which says what to install when it is missing.
"""
__version__ = "0.1.0"
