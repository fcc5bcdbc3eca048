"""Usage on every streamed chunk (runtime patch of vLLM's OpenAI serving layer).

With the ``per_chunk_usage`` setting on (default):

* vLLM's ``should_include_usage`` is forced to (include_usage, continuous_usage) = (True, True) in the chat and
  completion serving modules: every chunk carries cumulative ``usage`` and the final ``choices: []`` usage chunk
  is always sent, whether or not the client asked (``stream_options``);
* every usage object also gets ``prompt_tokens_details.cached_tokens`` (vLLM puts it on the final usage only)
  and ``billing``: the billed figures of the calculator's billing policy (exact decimal strings);
* where vLLM reports ``completion_tokens_details.reasoning_tokens`` (a reasoning parser is on), chat chunks carry
  the exact count of the tokens generated so far inside the reasoning block (``accounting.ReasoningCounter`` over
  the engine's ids); vLLM's own streaming count lags by the tokens its detokenizer holds back;
* non-streamed responses get the same complete usage (:func:`complete_usage`): ``prompt_tokens_details.cached_tokens``
  (vLLM reports it only with ``--enable-prompt-tokens-details``), the exact reasoning count where vLLM reports one,
  ``billing`` and, with prices, ``cost`` -- the figures the ledger records for the request.

Touches vLLM only through the two serving classes' stream generators, the chat full generator, the completion
response builder and their ``should_include_usage`` name (``vllm/entrypoints/openai/{chat_completion,completion}/
serving.py``).
"""
from __future__ import annotations

import functools
import json

from .accounting import ReasoningCounter, reasoning_tokens
from .engine_hooks import think_markers

_MARK = "_qwen_vllm_ext_stream_usage"

# Compatibility guard (qwen_vllm_ext.integration.guard): what install() wraps -> fingerprint per vLLM version.
PATCH_TARGETS = {
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator": {"0.32.0": "aff6652969097f9c", "0.33.0": "ae89ab49f58f544b"},
    "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.completion_stream_generator": {"0.32.0": "09ad938f288e54d4", "0.33.0": "ad393d90bf444436"},
    "vllm.entrypoints.serve.utils.api_utils:should_include_usage": {"0.32.0": "257382ff14c5facc", "0.33.0": "257382ff14c5facc"},
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator": {"0.32.0": "6414f713dd70c371", "0.33.0": "82154a8702e14aac"},
    "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.request_output_to_completion_response": {"0.32.0": "f1e8fce4adbb59c1", "0.33.0": "cede0912591495e4"},
}


def billing_fields(policy, usage: dict, prices=None) -> dict:
    """The ``usage.billing`` object for a (cumulative) usage dict; with prices, also ``cost_usd`` (exact string)."""
    from qwen_v3_calculator.billing import plain
    from qwen_v3_calculator.calculator import to_jsonable

    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    bill = to_jsonable(policy.bill(prompt, completion, cached_tokens=cached))
    if prices is not None:
        bill["cost_usd"] = plain(prices.cost(prompt, completion, cached, policy=policy))
    return bill


def add_cost(usage: dict, policy, prices) -> None:
    """``usage.billing`` and, with prices, ``usage.cost``: USD as a JSON number, as OpenRouter reports it to its
    clients (a decimal of at most 17 significant digits, so its shortest float text is the exact amount)."""
    usage["billing"] = billing_fields(policy, usage, prices)
    if prices is not None:
        usage["cost"] = float(usage["billing"]["cost_usd"])


def complete_usage(usage, cached_tokens, reasoning, policy, prices=None, details_cls=None) -> None:
    """Complete a non-streamed response's usage object (vLLM's ``UsageInfo``) in place, as the streamed chunks are.

    ``cached_tokens`` (int or None: leave as is) becomes ``prompt_tokens_details.cached_tokens`` (never more than the
    prompt; ``details_cls()`` builds the details object where vLLM left it None); ``reasoning`` (int or None)
    replaces vLLM's count where it reports one (a reasoning parser is on); with a policy, ``billing`` and, with
    prices, ``cost``.
    """
    prompt = usage.prompt_tokens or 0
    if cached_tokens is not None:
        details = usage.prompt_tokens_details
        if details is None:
            details = usage.prompt_tokens_details = details_cls()
        details.cached_tokens = min(cached_tokens, prompt)
    if reasoning is not None and usage.completion_tokens_details is not None:
        usage.completion_tokens_details.reasoning_tokens = reasoning
    if policy is not None:
        details = usage.prompt_tokens_details
        figures = {"prompt_tokens": prompt, "completion_tokens": usage.completion_tokens or 0,
                   "prompt_tokens_details": {"cached_tokens": getattr(details, "cached_tokens", None)}}
        add_cost(figures, policy, prices)
        usage.billing = figures["billing"]
        if "cost" in figures:
            usage.cost = figures["cost"]


def name_reasoning(holder, field: str) -> bool:
    """Put a message's or delta's ``reasoning`` text under ``field`` (``reasoning``, ``reasoning_content`` or
    ``both``: the setting reasoning_field). True when ``holder`` changed."""
    if field == "reasoning" or not isinstance(holder, dict) or holder.get("reasoning") is None:
        return False
    holder["reasoning_content"] = holder["reasoning"]
    if field == "reasoning_content":
        del holder["reasoning"]
    return True


def rewrite_sse(event: str, cached_tokens, policy, reasoning=None, prices=None, reasoning_field="reasoning") -> str:
    """Add cached tokens and billing to the ``usage`` of one ``data: {...}\\n\\n`` event, and name its deltas'
    thinking as ``reasoning_field`` says (other events unchanged).

    ``cached_tokens``: an int, None (leave as is) or a callable ``chunk -> int | None`` for endpoints whose
    chunks carry per-prompt usage (completions with several prompts). Never more than the chunk's prompt.
    """
    if not event.startswith("data: {"):
        return event
    body = event[6:].rstrip("\n")
    try:
        chunk = json.loads(body)
    except ValueError:
        return event
    if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):  # an error event: the one error shape
        from ..common.errors import normalize

        code = chunk["error"].get("code")
        fixed = normalize(code if isinstance(code, int) and 400 <= code <= 599 else 500, chunk)
        return event if fixed is None else "data: " + json.dumps(fixed, ensure_ascii=False) + "\n\n"
    renamed = False
    for choice in (chunk.get("choices") or []) if isinstance(chunk, dict) else ():
        renamed |= name_reasoning(choice.get("delta") if isinstance(choice, dict) else None, reasoning_field)
    usage = chunk.get("usage") if isinstance(chunk, dict) else None
    if not isinstance(usage, dict):
        return "data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")) + "\n\n" if renamed else event
    if callable(cached_tokens):
        cached_tokens = cached_tokens(chunk)
    if cached_tokens is not None:
        details = usage.get("prompt_tokens_details") or {}
        details["cached_tokens"] = min(cached_tokens, usage.get("prompt_tokens", 0))
        usage["prompt_tokens_details"] = details
    details = usage.get("completion_tokens_details")
    if reasoning is not None and isinstance(details, dict):
        count = reasoning(chunk)
        if count is not None:
            details["reasoning_tokens"] = count
    if policy is not None:
        add_cost(usage, policy, prices)
    return "data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def install(settings) -> bool:
    """Apply the patch (idempotent); False when the setting is off."""
    if not settings.per_chunk_usage:
        return False
    from vllm.entrypoints.openai.chat_completion import serving as chat_serving
    from vllm.entrypoints.openai.completion import serving as completion_serving

    if getattr(chat_serving, _MARK, False):
        return True
    policy, prices = settings.billing.policy, settings.billing.prices  # the process's one billing object
    reasoning_field = settings.reasoning_field

    def force_usage(stream_options, enable_force_include_usage):
        return True, True

    for module in (chat_serving, completion_serving):
        module.should_include_usage = force_usage

    chat_cls = chat_serving.OpenAIServingChat
    original_chat = chat_cls.chat_completion_stream_generator

    @functools.wraps(original_chat)
    async def chat_stream(self, request, result_generator, *args, **kwargs):
        seen = {}
        tokenizer = kwargs.get("tokenizer", args[3] if len(args) > 3 else None)  # (request_id, model, conv, tokenizer)
        markers = think_markers(tokenizer) if tokenizer is not None else (None, None)
        counters: dict[int, ReasoningCounter] = {}

        async def tap():
            async for res in result_generator:
                seen.setdefault("cached", res.num_cached_tokens)
                for out in res.outputs:  # streamed: each output holds the new ids only
                    counter = counters.get(out.index)
                    if counter is None:
                        counter = counters[out.index] = ReasoningCounter(*markers, res.prompt_token_ids,
                                                                         keep_history=True)
                    counter.feed(out.token_ids)
                yield res

        def reasoning_for(chunk):
            # the chunk's own completion_tokens: the engine may already have produced more than were sent
            sent = (chunk.get("usage") or {}).get("completion_tokens")
            choices = chunk.get("choices") or []
            if not choices:  # the final usage chunk: every choice
                return sum(c.count for c in counters.values()) if counters else None
            counter = counters.get(choices[0].get("index", 0))
            if counter is None:
                return None
            return counter.at(sent) if isinstance(sent, int) else counter.count

        async for event in original_chat(self, request, tap(), *args, **kwargs):
            yield rewrite_sse(event, seen.get("cached"), policy, reasoning_for, prices, reasoning_field)

    completion_cls = completion_serving.OpenAIServingCompletion
    original_completion = completion_cls.completion_stream_generator

    @functools.wraps(original_completion)
    async def completion_stream(self, request, engine_inputs, result_generator, *args, **kwargs):
        cached_by_prompt: dict[int, int] = {}

        async def tap():
            async for prompt_idx, res in result_generator:
                cached_by_prompt.setdefault(prompt_idx, res.num_cached_tokens or 0)
                yield prompt_idx, res

        samples = request.n or 1

        def cached_for(chunk):
            # choice index = prompt index x n + sample; the final choices=[] chunk sums every prompt
            choices = chunk.get("choices") or []
            if not choices:
                return sum(cached_by_prompt.values()) if cached_by_prompt else None
            return cached_by_prompt.get(choices[0].get("index", 0) // samples)

        async for event in original_completion(self, request, engine_inputs, tap(), *args, **kwargs):
            yield rewrite_sse(event, cached_for, policy, prices=prices)

    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo

    original_chat_full = chat_cls.chat_completion_full_generator

    @functools.wraps(original_chat_full)
    async def chat_full(self, request, result_generator, *args, **kwargs):
        last = {}

        async def tap():
            async for res in result_generator:
                last["res"] = res
                yield res

        response = await original_chat_full(self, request, tap(), *args, **kwargs)
        usage, res = getattr(response, "usage", None), last.get("res")
        if usage is not None and res is not None:
            reasoning = None
            if usage.completion_tokens_details is not None:
                tokenizer = kwargs.get("tokenizer", args[3] if len(args) > 3 else None)
                markers = think_markers(tokenizer) if tokenizer is not None else (None, None)
                # non-streamed: each output holds every generated id (as the ledger's engine hook counts them)
                reasoning = sum(reasoning_tokens(res.prompt_token_ids or (), out.token_ids, *markers)
                                for out in res.outputs)
            complete_usage(usage, res.num_cached_tokens or 0, reasoning, policy, prices, PromptTokenUsageInfo)
        if reasoning_field != "reasoning":
            for choice in getattr(response, "choices", None) or ():
                message = getattr(choice, "message", None)
                if message is not None and getattr(message, "reasoning", None) is not None:
                    message.reasoning_content = message.reasoning  # an extra field (vLLM's models allow them)
                    if reasoning_field == "reasoning_content":
                        message.reasoning = None
        return response

    original_completion_full = completion_cls.request_output_to_completion_response

    @functools.wraps(original_completion_full)
    def completion_full(self, final_res_batch, *args, **kwargs):
        response = original_completion_full(self, final_res_batch, *args, **kwargs)
        usage = getattr(response, "usage", None)
        if usage is not None:  # every prompt's cache hits (vLLM's own field has the last prompt's only)
            cached = sum(res.num_cached_tokens or 0 for res in final_res_batch)
            complete_usage(usage, cached, None, policy, prices, PromptTokenUsageInfo)
        return response

    chat_cls.chat_completion_stream_generator = chat_stream
    completion_cls.completion_stream_generator = completion_stream
    chat_cls.chat_completion_full_generator = chat_full
    completion_cls.request_output_to_completion_response = completion_full
    setattr(chat_serving, _MARK, True)
    return True
