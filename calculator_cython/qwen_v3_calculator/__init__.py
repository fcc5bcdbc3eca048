"""qwen_v3_calculator: exact Qwen token counting, importable without vLLM, torch or transformers.

The native core (``_core``, compiled with Cython from ``calculator_cython/``) holds the hot loops.
The bundled vocabulary is the Qwen2/2.5/3 BPE rank file from Alibaba's Apache-2.0 ``dashscope``
package (see ``data/NOTICE``).
"""
from __future__ import annotations

import functools
import os

from . import _core

__version__ = "0.1.0"

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
VOCAB_FILE = os.path.join(DATA_DIR, "qwen.tiktoken")
# Number of BPE ranks in the bundled file; ids >= this are added (special) tokens.
NUM_BASE_TOKENS = 151643


@functools.lru_cache(maxsize=1)
def bundled_ranks() -> dict:
    """``{token bytes: rank}`` of the bundled Qwen2/2.5/3 vocabulary (rank == token id)."""
    return _core.load_tiktoken_ranks(VOCAB_FILE)


__all__ = ["__version__", "DATA_DIR", "VOCAB_FILE", "NUM_BASE_TOKENS", "bundled_ranks"]
