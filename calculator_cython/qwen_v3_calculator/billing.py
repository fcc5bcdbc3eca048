"""Billing rules of an OpenRouter-style gateway, in exact decimal arithmetic (no float drift).

Billed units = tokens x weight. Input tokens above a context threshold are multiplied by a context penalty
(default: above 32,768 prompt tokens, ``1 + 0.00015 x (tokens - 32768)``). Cached input tokens
are billed at their own weight. Optional: system messages not billed (preset ``field-report``), and a
surcharge (+5%) on a side (input or output) that contains a fenced code block. All weights are Decimals;
token counts are ints; results are exact Decimals (serialize them as strings).
"""
from __future__ import annotations

import dataclasses
from decimal import ROUND_HALF_EVEN, Decimal

CODE_FENCE = "```"


def _dec(value) -> Decimal:
    if isinstance(value, float):
        value = repr(value)  # 1.35 -> Decimal("1.35"), not its binary approximation
    return Decimal(value)


@dataclasses.dataclass(frozen=True)
class BillingPolicy:
    """How token counts become billed units. Defaults: input 1.0, output 1.35, report's context penalty."""

    name: str = "default"
    input_weight: Decimal = Decimal("1.0")
    output_weight: Decimal = Decimal("1.35")
    cached_input_weight: Decimal = Decimal("1.0")
    context_threshold: int = 32768
    context_penalty_per_token: Decimal = Decimal("0.00015")
    truncate_penalized_tokens: bool = False
    """Round billed input units down to an integer, as the report's plugin did (``int(tokens * (1 + p))``)."""
    exclude_system: bool = False
    code_block_surcharge: Decimal = Decimal("0")
    """Extra fraction (e.g. 0.05) on a side whose text contains a fenced code block."""
    sanitize: bool = True
    """Remove invisible characters (hygiene.sanitize) before counting."""
    message_counting: str = "chat_template"
    """How ``messages`` are counted: ``chat_template`` (exactly what the model sees) or ``role_colon_text``
    (the report's plugin: ``f"{role}: {content}\n"`` per message, concatenated, no template)."""

    def __post_init__(self):
        for field in ("input_weight", "output_weight", "cached_input_weight", "context_penalty_per_token",
                      "code_block_surcharge"):
            value = _dec(getattr(self, field))
            if value < 0:
                raise ValueError(f"BillingPolicy.{field} must be >= 0, got {value}")
            object.__setattr__(self, field, value)
        if self.context_threshold < 0:
            raise ValueError("BillingPolicy.context_threshold must be >= 0")
        if self.message_counting not in ("chat_template", "role_colon_text"):
            raise ValueError("BillingPolicy.message_counting must be 'chat_template' or 'role_colon_text'")

    def context_factor(self, prompt_tokens: int) -> Decimal:
        over = prompt_tokens - self.context_threshold
        return Decimal(1) + self.context_penalty_per_token * over if over > 0 else Decimal(1)

    def bill(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             excluded_prompt_tokens: int = 0, input_has_code: bool = False, output_has_code: bool = False) -> dict:
        """Billed figures for one request. ``cached_tokens`` are part of ``prompt_tokens``."""
        for name, value in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens),
                            ("cached_tokens", cached_tokens), ("excluded_prompt_tokens", excluded_prompt_tokens)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if cached_tokens > prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        billable = max(prompt_tokens - (excluded_prompt_tokens if self.exclude_system else 0), 0)
        cached = min(cached_tokens, billable)
        factor = self.context_factor(billable)
        # the penalty scales every input token; cached ones are billed at their own weight
        prompt_units = factor * ((billable - cached) * self.input_weight + cached * self.cached_input_weight)
        if self.truncate_penalized_tokens:
            prompt_units = Decimal(int(prompt_units))
        completion_units = completion_tokens * self.output_weight
        if input_has_code:
            prompt_units *= 1 + self.code_block_surcharge
        if output_has_code:
            completion_units *= 1 + self.code_block_surcharge
        return {
            "policy": self.name,
            "billed_prompt_tokens": billable,
            "context_penalty_factor": factor,
            "prompt_units": prompt_units,
            "completion_units": completion_units,
            "total_units": prompt_units + completion_units,
        }


PRESETS = {
    "default": BillingPolicy(),
    # An OpenRouter-style gateway plugin's rules (the name is kept: users select it): messages counted as
    # "role: content" lines without the chat template, system messages not billed, penalized input truncated to
    # int; weights 1.0 / 1.35.
    "field-report": BillingPolicy(name="field-report", exclude_system=True, truncate_penalized_tokens=True,
                                  message_counting="role_colon_text"),
    "code-surcharge": BillingPolicy(name="code-surcharge", code_block_surcharge=Decimal("0.05")),
}


def to_micro(units) -> int:
    """Billed units (Decimal) as integer micro-units, rounded half-even (how the ledger and budgets store them)."""
    return int((units * 1_000_000).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))


def get_policy(policy: "BillingPolicy | str | None") -> BillingPolicy:
    if policy is None:
        return PRESETS["default"]
    if isinstance(policy, BillingPolicy):
        return policy
    if policy in PRESETS:
        return PRESETS[policy]
    raise ValueError(f"unknown billing policy {policy!r}; presets: {', '.join(PRESETS)}")


def has_code_block(text: str) -> bool:
    return CODE_FENCE in text
