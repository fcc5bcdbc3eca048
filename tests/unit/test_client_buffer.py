"""The adaptive streaming buffer: clamp(expected_tokens / 16, 256, 4096) characters, or sentence ends."""
import pytest

from qwen_vllm_ext.client import AdaptiveBuffer, flush_threshold


def test_threshold_is_clamped():
    assert flush_threshold(None) == 256
    assert flush_threshold(1000) == 256
    assert flush_threshold(16 * 1000) == 1000
    assert flush_threshold(10 ** 9) == 4096
    assert flush_threshold(800, divisor=2, min_chars=10, max_chars=300) == 300
    with pytest.raises(ValueError):
        flush_threshold(10, min_chars=0)


def test_flushes_at_sentence_ends_and_newlines():
    b = AdaptiveBuffer(100)
    assert b.push("Hello wor") == []
    assert b.push("ld. Next") == ["Hello world."]
    assert len(b) == len(" Next")
    assert b.push(" one\nand") == [" Next one\n"]
    assert b.push("你好。再") == ["and你好。"]
    assert b.push("") == [] and b.push(None) == []
    assert b.flush() == "再" and b.flush() == ""


def test_flushes_on_size_and_is_configurable():
    b = AdaptiveBuffer(16 * 300, flush_chars="")  # threshold 300, size only
    pieces = []
    for _ in range(100):
        pieces += b.push("abc. ")
    assert [len(p) for p in pieces] == [300] * 1 + [300] * ((500 - 300) // 300)
    assert "".join(pieces) + b.flush() == "abc. " * 100
