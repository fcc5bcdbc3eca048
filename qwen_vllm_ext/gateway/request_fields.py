"""What the gateway does with every field of vLLM's generation request models (pure data, no vLLM import).

The gateway promises that admission counts exactly what the engine will compute. Every field of vLLM's
``ChatCompletionRequest`` and ``CompletionRequest`` (0.32; the 0.33 additions are listed too) is classified
here, once:

* ``PROMPT`` -- changes the rendered or tokenized prompt; :func:`qwen_vllm_ext.gateway.admission.count_prompts`
  applies it the way vLLM's request handling does (template kwargs merged as ``build_chat_params`` and
  ``ChatParams.with_defaults`` merge them, truncation as ``TokenizeParams`` applies it, ...).
* ``OUTPUT`` -- bounds what the engine may generate: read by the reservation (``max_tokens`` /
  ``max_completion_tokens``, ``n``) or bounded by it (``min_tokens`` <= the max).
* ``SCOPE`` -- ``model``: resolved to the model the engine will serve, then checked against the key's scope.
* ``NONE`` -- cannot change the prompt or the most the engine may generate (sampling, output formatting,
  routing, ids, ...).
* ``REJECT`` -- the gateway cannot count the request exactly when the field is set to anything but its
  default: it answers 400 ``unsupported_parameter`` naming the field and the reason (``REJECT_REASONS``).

A field of the installed vLLM's request model that is not in this table is refused with 400 when a request
sets it (:func:`unknown_fields`), and ``tests/integration/test_request_fields.py`` fails on it: a new vLLM
field is a failing test, not a silent gap.
"""
from __future__ import annotations

PROMPT, OUTPUT, SCOPE, NONE, REJECT = "prompt", "output", "scope", "none", "reject"

_COMMON_NONE = (
    "frequency_penalty", "logit_bias", "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature",
    "top_p", "user", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "response_format",
    "structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids", "return_token_ids",
    "routed_experts_prompt_start", "return_token_offsets", "mm_payload", "return_mm_kwargs", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget",
    "stream_interval", "echo",  # echo returns the prompt text in the output; usage counts are unchanged
)

_COMMON: dict[str, str] = {  # fields both request models have, handled alike
    **dict.fromkeys(_COMMON_NONE, NONE), "model": SCOPE,
    "add_special_tokens": PROMPT, "truncate_prompt_tokens": PROMPT, "truncation_side": PROMPT,
    "max_tokens": OUTPUT, "n": OUTPUT, "min_tokens": OUTPUT, "use_beam_search": REJECT, "logprobs": NONE,
}

CHAT_FIELDS: dict[str, str] = {
    **_COMMON,
    "messages": PROMPT, "tools": PROMPT, "tool_choice": PROMPT, "reasoning_effort": PROMPT,
    "chat_template_kwargs": PROMPT, "documents": PROMPT, "add_generation_prompt": PROMPT,
    "continue_final_message": PROMPT, "max_completion_tokens": OUTPUT, "chat_template": REJECT,
    # text-only prompts: media parts are refused by the count; these only configure media processing
    "media_io_kwargs": NONE, "mm_processor_kwargs": NONE,
    "top_logprobs": NONE, "include_reasoning": NONE, "parallel_tool_calls": NONE, "return_prompt_text": NONE,
}

COMPLETION_FIELDS: dict[str, str] = {
    **_COMMON,
    "prompt": PROMPT, "suffix": REJECT, "prompt_embeds": REJECT,
}

# /v1/messages (Anthropic): admission counts the chat request vLLM's own converter
# (AnthropicServingMessages.to_chat_completion_request) makes of the body, so every field the converter maps is
# counted through CHAT_FIELDS; this table says which Anthropic fields reach the prompt or the output bound.
MESSAGES_FIELDS: dict[str, str] = {
    "model": SCOPE,
    "messages": PROMPT, "system": PROMPT, "tools": PROMPT, "tool_choice": PROMPT, "thinking": PROMPT,
    "output_config": PROMPT,  # effort -> reasoning_effort (the prompt); format -> response_format (none)
    "chat_template_kwargs": PROMPT,
    "max_tokens": OUTPUT,
    **dict.fromkeys(("metadata", "stop_sequences", "stream", "temperature", "top_k", "top_p", "mm_payload",
                     "return_mm_kwargs", "cache_salt", "watermarking", "kv_transfer_params", "ec_transfer_params",
                     "vllm_xargs"), NONE),
}

FIELDS = {"chat": CHAT_FIELDS, "completion": COMPLETION_FIELDS, "messages": MESSAGES_FIELDS}

_OPENAI_IGNORED = ("store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")
_OPENROUTER_IGNORED = ("provider", "transforms", "route", "models", "usage")
_ROUTER_IGNORED = ("no_stop_trim", "return_hidden_states", "separate_reasoning", "stream_reasoning", "session_params",
                   "lora_path")  # vllm-router 0.1.17 adds its request struct's defaults to every request it forwards
IGNORED: dict[str, frozenset] = {
    "chat": frozenset(_OPENAI_IGNORED + _OPENROUTER_IGNORED + _ROUTER_IGNORED),
    "completion": frozenset(_OPENAI_IGNORED + _OPENROUTER_IGNORED + _ROUTER_IGNORED),
    "messages": frozenset(("service_tier",)),
}
"""Fields a request may carry that neither vLLM nor the gateway reads, accepted and ignored (docs/gateway.md):
OpenAI's bookkeeping fields (``store``, ``metadata``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``:
the OpenAI SDK sends them), an aggregator's routing fields (OpenRouter's ``provider``, ``transforms``, ``route``,
``models``, ``usage``: usage is on every response anyway) and the fields vllm-router adds to every request it
forwards (``no_stop_trim``, ``return_hidden_states``, ``separate_reasoning``, ``stream_reasoning``,
``session_params``, ``lora_path``: SGLang's, which vLLM does not read; found by the fleet e2e tests). **The rule**: with the gateway on, any other field that is
not in the request tables above is refused with 400 ``unknown_parameter`` naming it -- a misspelt ``max_token`` or a
field another server reads (``reasoning``, ``functions``) never passes silently."""

REJECT_REASONS = {
    "use_beam_search": "beam search runs a variable number of engine sequences whose tokens usage does not "
                       "report, so no exact reservation exists; use n (parallel sampling) instead",
    "chat_template": "a per-request chat template renders a prompt the gateway cannot count; the server's "
                     "template is used when the field is left out",
    "suffix": "fill-in-the-middle prompts are not rendered by the Qwen text models the gateway counts",
    "prompt_embeds": "prompt embeddings carry no tokens the gateway can count; send text or token ids",
}
_DEFAULTS = {"use_beam_search": (None, False), "chat_template": (None,), "suffix": (None,),
             "prompt_embeds": (None,)}

# chat_template_kwargs keys whose effect the count reproduces (the Qwen templates read enable_thinking, the
# package's reuse template also preserve_thinking; the rest are vLLM's own render arguments). Any other key
# may reach transformers' apply_chat_template or the template itself and is refused.
TEMPLATE_KWARGS = frozenset({"enable_thinking", "preserve_thinking", "add_generation_prompt",
                             "continue_final_message", "documents", "reasoning_effort"})


def rejected_field(body: dict, kind: str) -> tuple[str, str] | None:
    """(field, reason) of the first REJECT field the body sets to a non-default value, else None."""
    for name, handling in FIELDS[kind].items():
        if handling == REJECT and name in body and body[name] not in _DEFAULTS.get(name, (None,)):
            return name, REJECT_REASONS[name]
    return None


def unknown_fields(body: dict, kind: str, engine_fields: frozenset | None) -> tuple[list[str], list[str]]:
    """(fields the installed vLLM reads but this table does not classify, fields nobody here reads and
    :data:`IGNORED` does not list): both refused."""
    table, ignored, engine = FIELDS[kind], IGNORED[kind], engine_fields or frozenset()
    unclassified = sorted(k for k in body if k in engine and k not in table)
    unknown = sorted(k for k in body if k not in table and k not in ignored and k not in engine)
    return unclassified, unknown
