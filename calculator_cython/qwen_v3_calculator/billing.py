"""Billing rules of an OpenRouter-style gateway, in exact decimal arithmetic (no float drift).

Billed units = tokens x weight. Input tokens above a context threshold are multiplied by a context penalty
(default: above 32,768 prompt tokens, ``1 + 0.00015 x (tokens - 32768)``). Cached input tokens
are billed at their own weight. Optional: system messages not billed (preset ``field-report``), and a
surcharge (+5%) on a side (input or output) that contains a fenced code block. All weights are Decimals;
token counts are ints; results are exact Decimals (serialize them as strings).

Money is separate from units: :class:`Prices` holds a provider's USD prices per token of each class (prompt,
completion, cache read) and per request, as an aggregator's listing publishes them. Every price is a whole number
of pico-dollars (10^-12 USD) per token, so the cost of a request under a flat policy is an exact integer number of
pico-dollars (:meth:`Prices.cost_pico`); rounding happens only when a total is shown in dollars (:func:`usd`).
"""
from __future__ import annotations

import dataclasses
import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

CODE_FENCE = "```"
PICO = 10**12  # pico-dollars per dollar: the ledger's money unit
PER_MILLION = 10**6
_PLAIN_DECIMAL = re.compile(r"^\d+(\.\d+)?$")  # how prices are written (the aggregator's format): no sign, no exponent


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

    def flat_problem(self, context_length: int) -> str | None:
        """Why this policy's billed amount is not ``tokens x a price per class`` for prompts up to ``context_length``
        (what an aggregator's listing can express), or None when it is."""
        if self.context_penalty_per_token > 0 and context_length > self.context_threshold:
            return (f"policy {self.name!r} adds a context penalty above {self.context_threshold} prompt tokens and the "
                    f"server accepts {context_length}: a per-token price list cannot express it")
        if self.code_block_surcharge > 0:
            return f"policy {self.name!r} adds a code-block surcharge: a per-token price list cannot express it"
        if self.exclude_system:
            return f"policy {self.name!r} does not bill system messages, which usage counts as prompt tokens"
        if self.truncate_penalized_tokens:
            return f"policy {self.name!r} truncates billed input to whole units"
        if self.message_counting != "chat_template":
            return f"policy {self.name!r} counts messages without the chat template, unlike usage"
        return None

    def max_request_units(self, context_length: int) -> Decimal:
        """The most billed units one request can cost when prompt + completion fit in ``context_length`` tokens
        (a code block on both sides): the bill is convex in the prompt's share, so the most is at an end -- the
        whole context as prompt, or one prompt token and the rest output."""
        if not isinstance(context_length, int) or context_length < 1:
            raise ValueError(f"context_length must be a positive int, got {context_length!r}")
        ends = ((context_length, 0), (1, context_length - 1))
        return max(self.bill(p, c, input_has_code=True, output_has_code=True)["total_units"] for p, c in ends)

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


def parse_price(text, name: str = "price") -> Decimal:
    """A price written as a plain decimal string (``"0.15"``): no sign, exponent or float artefact. ``ValueError``
    naming ``name`` otherwise."""
    text = str(text).strip()
    if not _PLAIN_DECIMAL.match(text):
        raise ValueError(f"{name} must be a plain non-negative decimal such as '0.15', got {text!r}")
    try:
        return Decimal(text)
    except InvalidOperation:  # pragma: no cover - the pattern admits only valid decimals
        raise ValueError(f"{name} is not a decimal: {text!r}") from None


def _whole_pico(value: Decimal, name: str) -> Decimal:
    if not value.is_finite() or value < 0:
        raise ValueError(f"{name} must be a finite price >= 0, got {value}")
    if value * PICO != (value * PICO).to_integral_value():
        raise ValueError(f"{name}: {plain(value)} USD per token is not a whole number of pico-dollars (10^-12 USD), "
                         "so the ledger could not bill it exactly; use at most 6 decimals per million tokens")
    return value


def plain(value: Decimal) -> str:
    """A Decimal as the aggregator writes prices: plain notation, no exponent, no trailing zeros (``"0.00000015"``)."""
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


@dataclasses.dataclass(frozen=True)
class Prices:
    """A provider's prices in USD: per token of each class, and per request. ``cache_read`` None = the prompt price
    (cached tokens billed like any prompt token, as the default policy's weights bill them)."""

    prompt: Decimal = Decimal(0)
    completion: Decimal = Decimal(0)
    cache_read: Decimal | None = None
    request: Decimal = Decimal(0)

    def __post_init__(self):
        for field in ("prompt", "completion", "cache_read", "request"):
            if getattr(self, field) is not None:
                object.__setattr__(self, field, _whole_pico(_dec(getattr(self, field)), f"Prices.{field}"))

    @classmethod
    def per_million(cls, prompt="0", completion="0", cache_read=None, request="0",
                    names=("prompt", "completion", "cache_read", "request")) -> "Prices":
        """From USD per million tokens (and USD per request) written as decimal strings, as providers quote them;
        ``names`` name the settings in errors. A price with more than 6 decimals per million tokens is refused: it is
        not a whole number of pico-dollars per token."""
        values = []
        for text, name, scale in zip((prompt, completion, cache_read, request), names, (PER_MILLION,) * 3 + (1,)):
            if text is None or (text == "" and name == names[2]):
                values.append(None)
                continue
            values.append(_whole_pico(parse_price(text or "0", name) / scale, name))
        return cls(values[0], values[1], values[2], values[3])

    @property
    def cache_read_price(self) -> Decimal:
        return self.prompt if self.cache_read is None else self.cache_read

    @property
    def free(self) -> bool:
        return not (self.prompt or self.completion or self.cache_read or self.request)

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             policy: "BillingPolicy | None" = None) -> Decimal:
        """USD for one request: uncached prompt tokens at ``prompt``, cached ones at ``cache_read``, generated ones at
        ``completion``, plus ``request`` when the engine did any work. With a policy whose context penalty applies, the
        prompt side is multiplied by its factor (the only policy rule a price can follow; see ``flat_problem``)."""
        cached = min(cached_tokens, prompt_tokens)
        prompt_side = (prompt_tokens - cached) * self.prompt + cached * self.cache_read_price
        if policy is not None:
            prompt_side *= policy.context_factor(prompt_tokens)
        worked = prompt_tokens > 0 or completion_tokens > 0
        return prompt_side + completion_tokens * self.completion + (self.request if worked else 0)

    def cost_pico(self, *args, **kwargs) -> int:
        """:meth:`cost` in integer pico-dollars: exact under a flat policy; a context-penalty factor's fraction of a
        pico-dollar is rounded half-even."""
        return int((self.cost(*args, **kwargs) * PICO).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))

    def per_token(self) -> dict[str, str]:
        """USD per token (and per request) as plain decimal strings: what the aggregator's listing publishes."""
        return {"prompt": plain(self.prompt), "completion": plain(self.completion),
                "input_cache_read": plain(self.cache_read_price), "request": plain(self.request)}


@dataclasses.dataclass(frozen=True)
class Billing:
    """A server's billing rules as one object: the policy (billed units) and the provider's prices (None: no price
    set, no cost). Built once per process from the settings and handed to whatever bills."""

    policy: BillingPolicy
    prices: Prices | None = None

    def cost_pico(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> int:
        """The request's cost in integer pico-dollars (0 without prices): :meth:`Prices.cost_pico` under the policy."""
        if self.prices is None:
            return 0
        return self.prices.cost_pico(prompt_tokens, completion_tokens, cached_tokens, policy=self.policy)


def usd(pico: int, places: int = 6) -> str:
    """Integer pico-dollars as a dollar amount rounded half-even to ``places`` decimals (the export rule)."""
    return str((Decimal(pico) / PICO).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_EVEN))


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
