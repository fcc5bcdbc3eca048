"""qwen-vllm-ext: a vLLM extension for serving Qwen models.

Importing this package never imports vLLM; the pieces that need vLLM import it lazily through
:func:`qwen_vllm_ext.integration.vllm_version.require_vllm`, which says what to install when it is missing.
"""
from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _dist_version

try:  # the installed distribution's version, which pyproject.toml takes from qwen_v3_calculator/_version.py
    __version__ = _dist_version("qwen-vllm-ext")
except _NotInstalled:  # a source tree that was never installed
    __version__ = "0+unknown"
