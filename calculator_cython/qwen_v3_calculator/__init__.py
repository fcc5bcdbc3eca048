"""qwen_v3_calculator: exact Qwen token counting, importable without vLLM, torch or transformers.

    from qwen_v3_calculator import calculate_tokens, count_tokens, count_chat
    calculate_tokens(input_text="请分析这份财报的净利润趋势", output_text="...")
    count_chat([{"role": "user", "content": "hi"}])            # 9: exactly vLLM's prompt_tokens

The public surface: ``count_tokens``, ``count_tokens_batch``, ``count_chat``, ``encode``, ``encode_batch``,
``calculate_tokens``
(a default :class:`Calculator`: bundled Qwen3 vocabulary, default billing policy, created on first use),
``Calculator`` and ``BillingPolicy``. Behind them: ``tokenizer`` (the exact tokenizer over the compiled engine
in ``_core``), ``chat`` (vLLM's chat rendering), ``billing``, ``hygiene``, ``vocab`` (the bundled Qwen2/2.5/3
vocabulary from Alibaba's Apache-2.0 ``dashscope`` package, see ``data/NOTICE``) and ``hf_export``.
"""
from __future__ import annotations

import functools

try:
    from . import _core
except ImportError as exc:  # no silent pure-Python fallback
    raise ImportError(
        "qwen_v3_calculator's compiled core is missing: build it with `pip install .` (or `pip install -e .`) "
        "from a qwen-vllm-ext checkout, or run scripts/setup.sh; it needs a C compiler and Cython"
    ) from exc

from ._version import __version__  # noqa: E402,F401  (the release version: one source for the whole distribution)

from .billing import BillingPolicy  # noqa: E402  (after the core check: a clear error comes first)
from .calculator import Calculator  # noqa: E402


@functools.lru_cache(maxsize=1)
def default_calculator() -> Calculator:
    """The calculator behind the module-level functions (bundled Qwen3 vocabulary, default billing policy)."""
    return Calculator()


def calculate_tokens(input_text: str = "", output_text: str = "", messages: list | None = None, **kwargs) -> dict:
    """Prompt/completion/total tokens and the billed figures of the default policy."""
    return default_calculator().calculate_tokens(input_text, output_text, messages, **kwargs)


def _load_and_count(text):
    """First call: build the default calculator, then count through its engine directly from now on."""
    global _count
    _count = default_calculator().tokenizer._engine.count
    return _count(text)


_count = _load_and_count


def count_tokens(text: str) -> int:
    """Exact number of Qwen3 tokens of ``text`` (bundled vocabulary; TypeError for anything but str)."""
    return _count(text)  # one Python frame, then the compiled engine: this is the per-message hot path


def encode(text: str) -> list[int]:
    return default_calculator().encode(text)


def count_tokens_batch(texts, threads: int | None = None) -> list[int]:
    """Counts of a sequence of str, in order, on ``threads`` threads (default: the cores this process may use)."""
    return default_calculator().count_tokens_batch(texts, threads)


def encode_batch(texts, threads: int | None = None) -> list[list[int]]:
    """Ids of a sequence of str, in order (``threads`` as for count_tokens_batch)."""
    return default_calculator().encode_batch(texts, threads)


def count_chat(messages, tools=None, template: str = "qwen3", add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, **template_kwargs) -> int:
    return default_calculator().count_chat(messages, tools=tools, template=template,
                                           add_generation_prompt=add_generation_prompt,
                                           enable_thinking=enable_thinking, **template_kwargs)


__all__ = ["count_tokens", "count_tokens_batch", "count_chat", "encode", "encode_batch", "calculate_tokens",
           "Calculator", "BillingPolicy"]
