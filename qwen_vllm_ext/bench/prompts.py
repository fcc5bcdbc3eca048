"""Prompts of exact token lengths, cut from a small bundled corpus of mixed real text (Chinese, English, code,
some Japanese/Korean, numbers) with the ``qwen_v3_calculator`` tokenizer.

Cutting a token sequence and decoding it does not always give a text that re-encodes to the same number of
tokens (a cut inside a multi-byte character, or pieces that merge differently once they are neighbours), so
every candidate is re-counted and the cut moved until the count is exact.
"""
from __future__ import annotations

import functools
import random
from importlib import resources

CORPUS_FILE = "corpus.txt"


@functools.lru_cache(maxsize=1)
def corpus_paragraphs() -> tuple[str, ...]:
    text = resources.files("qwen_vllm_ext.bench").joinpath("data").joinpath(CORPUS_FILE).read_text(encoding="utf-8")
    return tuple(p.strip("\n") for p in text.split("\n\n") if p.strip())


@functools.lru_cache(maxsize=None)
def _id_to_bytes(vocabulary: str = "qwen3") -> dict[int, bytes]:
    from qwen_v3_calculator.vocab import vocabulary_ranks

    return {rank: tok for tok, rank in vocabulary_ranks(vocabulary).items()}


class PromptFactory:
    """``text(n)``: a text of exactly ``n`` tokens; ``chat(n)``: one user message whose chat prompt
    (Qwen3 template, generation prompt) is exactly ``n`` tokens, as vLLM counts ``prompt_tokens``. ``model``: the
    bundled vocabulary (``qwen3``; ``qwen3.6`` for Qwen3.5/3.6 models, with ``template="qwen3.5"``)."""

    def __init__(self, seed: int = 0, tokenizer=None, template: str = "qwen3",
                 paragraphs: tuple[str, ...] | None = None, model: str = "qwen3"):
        from qwen_v3_calculator import Calculator
        from qwen_v3_calculator.vocab import FLAVOR_VOCABULARY, flavor_of

        self.calc = Calculator(tokenizer=tokenizer) if tokenizer else Calculator(model=model)
        self.vocabulary = FLAVOR_VOCABULARY[flavor_of(model)]
        self.template = template
        self.rng = random.Random(seed)
        self.paragraphs = paragraphs or corpus_paragraphs()
        self.chat_overhead = self.count_chat([{"role": "user", "content": "x"}]) - self.count("x")

    def count(self, text: str) -> int:
        return self.calc.count_tokens(text)

    def count_chat(self, messages: list, **kwargs) -> int:
        """Chat prompt tokens; ``kwargs``: calculator chat options (``tools``, ``enable_thinking``, ...)."""
        return self.calc.count_chat(messages, template=self.template, **kwargs)

    def decode(self, ids) -> str:
        table = _id_to_bytes(self.vocabulary)
        return b"".join(table[i] for i in ids).decode("utf-8", errors="ignore")

    def _source(self, n: int) -> list[int]:
        """Token ids of shuffled corpus paragraphs, at least ``n + 64`` of them."""
        order = list(self.paragraphs)
        self.rng.shuffle(order)
        parts: list[str] = []
        i = 0
        while True:
            while sum(self.count(p) for p in parts) < n + 64 + len(parts):
                if i and i % len(order) == 0:
                    self.rng.shuffle(order)
                parts.append(order[i % len(order)])
                i += 1
            ids = self.calc.encode("\n\n".join(parts))
            if len(ids) >= n + 64:
                return ids
            parts.append(order[i % len(order)])
            i += 1

    def text(self, n: int) -> str:
        """A text of exactly ``n`` tokens (``n >= 1``)."""
        if n < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {n}")
        for _ in range(8):
            ids = self._source(n)
            for k in (n, n + 1, n - 1, n + 2, n - 2, n + 3, n - 3):
                if k < 1:
                    continue
                cand = self.decode(ids[:k])
                if self.count(cand) == n:
                    return cand
        raise RuntimeError(f"could not cut a text of exactly {n} tokens from the corpus")  # pragma: no cover

    def chat(self, n: int) -> list[dict]:
        """Messages (one user turn) whose chat prompt is exactly ``n`` tokens."""
        if n < self.chat_overhead + 1:
            raise ValueError(f"a chat prompt needs at least {self.chat_overhead + 1} tokens, got {n}")
        target = n - self.chat_overhead
        for _ in range(16):
            msgs = [{"role": "user", "content": self.text(target)}]
            got = self.count_chat(msgs)
            if got == n:
                return msgs
            target = max(1, target + (n - got))
        raise RuntimeError(f"could not build a chat prompt of exactly {n} tokens")  # pragma: no cover
