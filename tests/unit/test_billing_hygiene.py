"""Billing rules (exact decimals) and text hygiene: pure Python."""
from decimal import Decimal

import pytest

from qwen_v3_calculator.billing import PRESETS, BillingPolicy, get_policy
from qwen_v3_calculator.hygiene import sanitize


def test_default_weights_and_no_penalty_below_threshold():
    bill = BillingPolicy().bill(1000, 200)
    assert bill["prompt_units"] == Decimal("1000") and bill["completion_units"] == Decimal("270")
    assert bill["total_units"] == Decimal("1270") and bill["context_penalty_factor"] == 1
    assert BillingPolicy().bill(32768, 0)["context_penalty_factor"] == 1


def test_context_penalty_is_the_reports_rule_exactly():
    bill = BillingPolicy().bill(40000, 0)
    assert bill["context_penalty_factor"] == Decimal("1") + Decimal("0.00015") * 7232
    assert bill["prompt_units"] == Decimal(40000) * (1 + Decimal("0.00015") * 7232) == Decimal("83392")


def test_cached_input_weight_and_code_surcharge():
    policy = BillingPolicy(cached_input_weight="0.25", code_block_surcharge=0.05)
    bill = policy.bill(1000, 100, cached_tokens=800, input_has_code=True, output_has_code=False)
    assert bill["prompt_units"] == (200 + Decimal("0.25") * 800) * Decimal("1.05") == Decimal("420.00")
    assert bill["completion_units"] == Decimal("135.00")


def test_no_float_drift_over_a_million_requests():
    policy = BillingPolicy()
    total = sum((policy.bill(7, 3)["total_units"] for _ in range(1_000_000)), Decimal(0))
    assert total == Decimal("11050000")  # 1e6 x (7 + 3 x 1.35), exactly
    assert isinstance(total, Decimal)


def test_field_report_preset():
    p = get_policy("field-report")
    assert p.exclude_system and p.truncate_penalized_tokens and p.message_counting == "role_colon_text"
    bill = p.bill(40000, 10, excluded_prompt_tokens=12)
    assert bill["billed_prompt_tokens"] == 39988
    assert bill["prompt_units"] == Decimal(int(39988 * (1 + Decimal("0.00015") * (39988 - 32768))))
    assert set(PRESETS) >= {"default", "field-report", "code-surcharge"}


def test_bad_policy_and_counts_are_refused():
    with pytest.raises(ValueError, match="unknown billing policy 'cheap'; presets: default"):
        get_policy("cheap")
    with pytest.raises(ValueError, match="input_weight must be >= 0"):
        BillingPolicy(input_weight=-1)
    with pytest.raises(ValueError, match="prompt_tokens must be a non-negative int"):
        BillingPolicy().bill(-1, 0)
    with pytest.raises(ValueError, match="cached_tokens cannot exceed prompt_tokens"):
        BillingPolicy().bill(1, 0, cached_tokens=2)


@pytest.mark.parametrize("dirty,clean", [
    ("a\u200bb", "ab"), ("\ufeffhello\u2060", "hello"), ("soft\u00adhyphen", "softhyphen"),
    ("\u202eevil\u202c \u2066x\u2069", "evil x"), ("a\x00b\x07c\x1bd\x7fe\x85f\x9f", "abcdef"),
    ("keep\ttab\nnl\rcr", "keep\ttab\nnl\rcr"), ("👨\u200d👩\u200d👧 ZWNJ\u200c", "👨\u200d👩\u200d👧 ZWNJ\u200c"),
    ("flag \U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F!",
     "flag \U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F!"),
    ("stray\U000E0041tag\U000E007F", "straytag"), ("\U0001F3F4\U000E007F", "\U0001F3F4"),
])
def test_sanitize(dirty, clean):
    assert sanitize(dirty) == clean


def test_sanitize_type_error():
    with pytest.raises(TypeError, match="text must be str, not bytes"):
        sanitize(b"x")
