"""qwen_v3_calculator: exact Qwen token counting, importable without vLLM, torch or transformers.

    from qwen_v3_calculator import calculate_tokens, count_tokens, count_chat
    calculate_tokens(input_text="请分析这份财报的净利润趋势", output_text="...")
    count_chat([{"role": "user", "content": "hi"}])            # 9: exactly vLLM's prompt_tokens

The module-level functions use a default :class:`Calculator` (bundled Qwen3 vocabulary, default billing
policy), created on first use. The native core (``_core``, compiled with Cython from ``calculator_cython/``)
holds the hot loops. The bundled vocabulary is the Qwen2/2.5/3 BPE rank file from Alibaba's Apache-2.0
``dashscope`` package (see ``data/NOTICE``).
"""
from __future__ import annotations

import functools
import os

try:
    from . import _core
except ImportError as exc:  # no silent pure-Python fallback
    raise ImportError(
        "qwen_v3_calculator's compiled core is missing: build it with `pip install .` (or `pip install -e .`) "
        "from a qwen-vllm-ext checkout, or run scripts/setup.sh; it needs a C compiler and Cython"
    ) from exc

__version__ = "0.1.0"

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
VOCAB_FILE = os.path.join(DATA_DIR, "qwen.tiktoken")
# Number of BPE ranks in the bundled file; ids >= this are added (special) tokens.
NUM_BASE_TOKENS = 151643


@functools.lru_cache(maxsize=1)
def bundled_ranks() -> dict:
    """``{token bytes: rank}`` of the bundled Qwen2/2.5/3 vocabulary (rank == token id)."""
    return _core.load_tiktoken_ranks(VOCAB_FILE)


@functools.lru_cache(maxsize=1)
def default_calculator():
    from .calculator import Calculator

    return Calculator()


def calculate_tokens(input_text: str = "", output_text: str = "", messages: list | None = None, **kwargs) -> dict:
    """Prompt/completion/total tokens and the billed figures of the default policy."""
    return default_calculator().calculate_tokens(input_text, output_text, messages, **kwargs)


def count_tokens(text: str) -> int:
    return default_calculator().count_tokens(text)


def encode(text: str) -> list[int]:
    return default_calculator().encode(text)


def count_tokens_batch(texts) -> list[int]:
    return default_calculator().count_tokens_batch(texts)


def count_chat(messages, tools=None, template: str = "qwen3", add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, **template_kwargs) -> int:
    return default_calculator().count_chat(messages, tools=tools, template=template,
                                           add_generation_prompt=add_generation_prompt,
                                           enable_thinking=enable_thinking, **template_kwargs)


def __getattr__(name):  # lazy: importing the package stays cheap
    if name == "Calculator":
        from .calculator import Calculator

        return Calculator
    if name in ("BillingPolicy", "PRESETS"):
        from . import billing

        return getattr(billing, name)
    if name == "Tokenizer":
        from .tokenizer import Tokenizer

        return Tokenizer
    if name == "sanitize":
        from .hygiene import sanitize

        return sanitize
    raise AttributeError(name)


__all__ = ["__version__", "calculate_tokens", "count_tokens", "encode", "count_tokens_batch", "count_chat",
           "Calculator", "BillingPolicy", "PRESETS", "Tokenizer", "sanitize", "bundled_ranks",
           "DATA_DIR", "VOCAB_FILE", "NUM_BASE_TOKENS"]
