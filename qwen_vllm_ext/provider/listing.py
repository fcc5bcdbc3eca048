"""The model listing an aggregator reads from a provider (pure: no vLLM import).

OpenRouter's provider integration guide (https://openrouter.ai/docs/guides/providers/integration) reads the
provider's ``/v1/models`` response, ``{"data": [entry, ...]}``. Two entry formats are built from the same facts:

* ``openrouter`` -- the current format (``schema_version`` "2.4"): modalities, each with its limits, pricing entries
  ``{type, unit, cost_usd}`` and, for text output, ``supported_parameters``;
* ``openrouter-legacy`` -- the flat format the guide keeps for existing integrations
  (https://openrouter.ai/docs/guides/providers/integration-legacy): ``context_length``, ``max_output_length``,
  ``pricing`` (USD per token as strings), ``supported_sampling_parameters``, ``supported_features``.

Prices are per token, written exactly (``qwen_v3_calculator.billing.plain``: no exponent, no float artefact).
"""
from __future__ import annotations

import dataclasses

from qwen_v3_calculator.billing import Prices, plain

from ..gateway.request_fields import CHAT_FIELDS, REJECT

SCHEMA_VERSION = "2.4"
FORMATS = ("openrouter", "openrouter-legacy")
QUANTIZATIONS = ("int4", "int8", "fp4", "mxfp4", "nvfp4", "fp6", "fp8", "mxfp8", "fp16", "bf16", "fp32")
"""The values the guide accepts for ``quantization``."""

# OpenRouter's sampling parameter names -> the descriptor the current format publishes; listed only when the
# gateway's request-field table accepts the same field (not REJECT), i.e. the server takes and counts it.
SAMPLING = {
    "temperature": {"type": "range", "min": 0, "max": 2},
    "top_p": {"type": "range", "min": 0, "max": 1},
    "top_k": {"type": "integer", "min": -1},
    "min_p": {"type": "range", "min": 0, "max": 1},
    "frequency_penalty": {"type": "range", "min": -2, "max": 2},
    "presence_penalty": {"type": "range", "min": -2, "max": 2},
    "repetition_penalty": {"type": "range", "min": 0, "max": 2},
    "stop": {"type": "array"},
    "seed": {"type": "integer"},
    "max_tokens": None,  # {"type": "integer", "min": 1, "max": <max output>}: filled per model
    "logit_bias": {"type": "object"},
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "min": 0, "max": 20},
}
FEATURES = ("tools", "json_mode", "structured_outputs", "reasoning")
"""Features this server can list; :func:`features` says which a given server has (each one has an e2e test)."""


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the listing says about one served model, read from the running engine (``vllm_facts``)."""

    id: str
    name: str
    created: int
    context_length: int
    max_output_length: int
    quantization: str
    hugging_face_id: str = ""
    tokenizer: str = "Qwen3"
    features: tuple[str, ...] = ()
    description: str = ""


def sampling_parameters() -> tuple[str, ...]:
    """OpenRouter's sampling parameters that the gateway's request-field table accepts for chat requests."""
    return tuple(name for name in SAMPLING if name in CHAT_FIELDS and CHAT_FIELDS[name] != REJECT)


def features(tool_parser: bool, reasoning_parser: bool, structured_outputs: bool) -> tuple[str, ...]:
    """The features a server offers: tools with a tool-call parser and auto tool choice, reasoning with a reasoning
    parser, JSON mode and structured outputs with vLLM's structured-output backend."""
    on = {"tools": tool_parser, "reasoning": reasoning_parser, "json_mode": structured_outputs,
          "structured_outputs": structured_outputs}
    return tuple(f for f in FEATURES if on[f])


def _parameters(facts: ModelFacts) -> dict:
    out = {}
    for name in sampling_parameters():
        out[name] = SAMPLING[name] or {"type": "integer", "min": 1, "max": facts.max_output_length, "unit": "token"}
    for feature in facts.features:
        if feature in ("tools", "structured_outputs", "reasoning"):
            out[feature] = {"type": "boolean"}
    if "json_mode" in facts.features:
        out["response_format"] = {"type": "enum", "values": ["text", "json_object", "json_schema"]}
    return out


def entry(facts: ModelFacts, prices: Prices) -> dict:
    """One model in the current format (schema_version 2.4)."""
    per = prices.per_token()
    prompt_pricing = [{"type": "prompt", "unit": "token", "cost_usd": per["prompt"]},
                      {"type": "cached_prompt", "unit": "token", "cost_usd": per["input_cache_read"]}]
    completion_pricing = [{"type": "completion", "unit": "token", "cost_usd": per["completion"]}]
    if "reasoning" in facts.features:  # reasoning tokens are generated tokens, billed at the completion price
        completion_pricing.append({"type": "internal_reasoning", "unit": "token", "cost_usd": per["completion"]})
    out = {
        "schema_version": SCHEMA_VERSION,
        "id": facts.id,
        "name": facts.name,
        "hugging_face_id": facts.hugging_face_id,
        "created": facts.created,
        "quantization": facts.quantization,
        "tokenizer": facts.tokenizer,
        "input_modalities": [{
            "type": "text",
            "supported_inputs": {"max_context_length": {"value": facts.context_length, "unit": "token"}},
            "pricing": prompt_pricing,
        }],
        "output_modalities": [{
            "type": "text",
            "max_length": {"value": facts.max_output_length, "unit": "token"},
            "streaming": True,
            "supported_parameters": _parameters(facts),
            "pricing": completion_pricing,
        }],
        "is_free": prices.free,
    }
    if prices.request:
        out["pricing"] = [{"type": "request", "unit": "request", "cost_usd": per["request"]}]
    if facts.description:
        out["description"] = facts.description
    return out


def legacy_entry(facts: ModelFacts, prices: Prices) -> dict:
    """One model in the flat (legacy) format."""
    per = prices.per_token()
    return {
        "id": facts.id,
        "hugging_face_id": facts.hugging_face_id,
        "name": facts.name,
        "created": facts.created,
        "input_modalities": ["text"],
        "output_modalities": ["text"],
        "quantization": facts.quantization,
        "context_length": facts.context_length,
        "max_output_length": facts.max_output_length,
        "pricing": {"prompt": per["prompt"], "completion": per["completion"], "image": "0",
                    "request": per["request"], "input_cache_read": per["input_cache_read"]},
        "supported_sampling_parameters": list(sampling_parameters()),
        "supported_features": list(facts.features),
        **({"description": facts.description} if facts.description else {}),
    }


def listing(models: list[ModelFacts], prices: Prices, fmt: str) -> dict:
    """The ``/v1/models`` body for ``fmt`` (one of :data:`FORMATS`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown listing format {fmt!r}; one of {', '.join(FORMATS)}")
    build = entry if fmt == "openrouter" else legacy_entry
    return {"data": [build(m, prices) for m in models]}


def prices_of(legacy: dict) -> Prices:
    """The prices of one legacy-format entry (what a client of the listing bills with)."""
    from decimal import Decimal

    pricing = legacy["pricing"]
    return Prices(Decimal(pricing["prompt"]), Decimal(pricing["completion"]), Decimal(pricing["input_cache_read"]),
                  Decimal(pricing.get("request", "0")))


# ---- what the engine runs -> what the listing may say --------------------------------------------------------
_METHOD_QUANTIZATION = {  # vLLM quantization method -> the listing values it can be (bits decide among several)
    "fp8": ("fp8",), "fbgemm_fp8": ("fp8",), "ptpc_fp8": ("fp8",), "modelopt": ("fp8",), "modelopt_fp4": ("nvfp4",),
    "mxfp4": ("mxfp4",), "awq": ("int4",), "awq_marlin": ("int4",), "gptq": ("int4", "int8"),
    "gptq_marlin": ("int4", "int8"), "bitsandbytes": ("int4", "int8"), "experts_int8": ("int8",),
    "compressed-tensors": ("int4", "int8", "fp8", "fp4", "nvfp4"), "gguf": ("int4", "int8"),
}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


class ListingError(ValueError):
    """The listing would not describe what the server runs; the message names the setting."""


def quantization(method: str | None, dtype: str, bits: int | None, wanted: str = "") -> str:
    """The listing's ``quantization`` for an engine running ``method`` (vLLM's quantization method, None when the
    weights are not quantized) in ``dtype``; ``wanted`` (setting ``listing_quantization``) must be one of the values the
    engine can be running. Raises :class:`ListingError` when it cannot be reported."""
    if method is None:
        candidates = (_DTYPES.get(dtype.removeprefix("torch."), ""),)
    else:
        candidates = _METHOD_QUANTIZATION.get(method, ())
        if bits in (4, 8) and len(candidates) > 1:
            candidates = tuple(c for c in candidates if c.endswith(str(bits))) or candidates
    candidates = tuple(c for c in candidates if c)
    if wanted:
        if wanted not in QUANTIZATIONS:
            raise ListingError(f"setting 'listing_quantization': {wanted!r} is not a listing value "
                               f"({', '.join(QUANTIZATIONS)})")
        if wanted not in candidates:
            runs = f"quantization method {method!r}" if method else f"unquantized {dtype} weights"
            raise ListingError(f"setting 'listing_quantization': the engine runs {runs}, which is not {wanted!r}"
                               + (f" (it can be {', '.join(candidates)})" if candidates else ""))
        return wanted
    if len(candidates) != 1:
        runs = f"quantization method {method!r}" if method else f"dtype {dtype}"
        raise ListingError(f"setting 'listing_quantization': the listing cannot tell which quantization the engine's "
                           f"{runs} is{' (one of ' + ', '.join(candidates) + ')' if candidates else ''}; set it")
    return candidates[0]


def context_length(engine_max: int, wanted: int) -> int:
    if wanted > engine_max:
        raise ListingError(f"setting 'listing_context_length': {wanted} is more than the engine's max_model_len "
                           f"{engine_max}; requests that long would be refused")
    return wanted or engine_max


def max_output(context: int, wanted: int) -> int:
    if wanted > context:
        raise ListingError(f"setting 'listing_max_output': {wanted} is more than the listed context length {context}")
    return wanted or context


def check_policy(policy, context: int) -> None:
    """A billing policy the listing's per-token prices cannot express is refused (provider mode)."""
    problem = policy.flat_problem(context)
    if problem:
        raise ListingError(f"setting 'billing_policy' with openrouter=true: {problem}, so the aggregator's bill "
                           "and this server's ledger would differ; use a flat policy (e.g. 'default' with a context "
                           "length up to its threshold)")


__all__ = ["FORMATS", "ModelFacts", "ListingError", "listing", "entry", "legacy_entry", "plain"]
