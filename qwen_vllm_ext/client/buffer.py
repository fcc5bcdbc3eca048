"""An adaptive streaming buffer: collect streamed text and hand it on in readable pieces.

A piece is flushed when the buffer reaches ``clamp(expected_tokens / divisor, min_chars, max_chars)`` characters
(defaults 16, 256, 4096), or at sentence punctuation / a newline (the text up to and including the last such
character), and at the end of the stream. Everything is configurable; ``flush_chars=""`` flushes on size only.
"""
from __future__ import annotations

DEFAULT_FLUSH_CHARS = ".!?。！？；;\n…"


def flush_threshold(expected_tokens: int | None, divisor: int = 16, min_chars: int = 256,
                    max_chars: int = 4096) -> int:
    if divisor <= 0 or min_chars <= 0 or max_chars < min_chars:
        raise ValueError("need divisor > 0 and 0 < min_chars <= max_chars")
    expected = max(0, int(expected_tokens or 0))
    return max(min_chars, min(max_chars, expected // divisor))


class AdaptiveBuffer:
    def __init__(self, expected_tokens: int | None = None, *, divisor: int = 16, min_chars: int = 256,
                 max_chars: int = 4096, flush_chars: str = DEFAULT_FLUSH_CHARS):
        self.threshold = flush_threshold(expected_tokens, divisor, min_chars, max_chars)
        self.flush_chars = frozenset(flush_chars)
        self._parts: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, text: str | None) -> list[str]:
        """Add streamed text; return the pieces that are ready (possibly none)."""
        if not text:
            return []
        self._parts.append(text)
        self._len += len(text)
        if self._len >= self.threshold:
            return [self.flush()]
        if self.flush_chars:
            for i in range(len(text) - 1, -1, -1):
                if text[i] in self.flush_chars:
                    whole = "".join(self._parts)
                    cut = len(whole) - (len(text) - 1 - i)
                    rest = whole[cut:]
                    self._parts, self._len = ([rest] if rest else []), len(rest)
                    return [whole[:cut]]
        return []

    def flush(self) -> str:
        """Everything buffered (call at the end of the stream)."""
        whole = "".join(self._parts)
        self._parts, self._len = [], 0
        return whole
