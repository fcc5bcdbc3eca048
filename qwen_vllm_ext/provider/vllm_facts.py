"""vLLM glue: what the running engine is, for the listing (the provider capability's only read of vLLM's state).

Reads, once at start-up in each API-server process: ``engine_client.model_config`` (``max_model_len``,
``quantization``, ``dtype``, ``hf_config``, ``model``), the served model names and the parser flags in the server's
``args``. Wraps nothing, so it has no fingerprinted targets; a vLLM upgrade that renames one of these attributes
fails here with an AttributeError at start-up.
"""
from __future__ import annotations

import os
import time

from .listing import ListingError, ModelFacts, check_policy, context_length, features, max_output, quantization


def _created(model: str) -> int:
    """The model's config file's modification time (a local checkpoint), else the server's start."""
    path = os.path.join(os.path.expanduser(model), "config.json")
    try:
        return int(os.path.getmtime(path))
    except OSError:
        return int(time.time())


def _hf_id(model: str, wanted: str) -> str:
    if wanted:
        return wanted
    local = model.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(model))
    return "" if local else model


def _tokenizer(hf_config) -> str:
    vocab = getattr(hf_config, "vocab_size", 0) or getattr(getattr(hf_config, "text_config", None), "vocab_size", 0)
    return "Qwen3.5" if vocab >= 200_000 else "Qwen3"  # the Qwen3.5/3.6 vocabulary has ~248k ids, Qwen3's ~152k


def model_facts(engine_client, args, settings, policy) -> list[ModelFacts]:
    """One :class:`ModelFacts` per served model name; raises :class:`ListingError` (naming the setting) when the
    listing the settings ask for would not describe this engine."""
    config = engine_client.model_config
    ctx = context_length(int(config.max_model_len), settings.listing_context_length)
    out_len = max_output(ctx, settings.listing_max_output)
    check_policy(policy, ctx)
    quant_config = getattr(config.hf_config, "quantization_config", None) or {}
    bits = quant_config.get("bits") if isinstance(quant_config, dict) else getattr(quant_config, "bits", None)
    quant = quantization(config.quantization, str(config.dtype), bits, settings.listing_quantization)
    structured = True  # vLLM's structured-output backend ("auto") serves json_object / json_schema on every platform
    feats = features(tool_parser=bool(getattr(args, "enable_auto_tool_choice", False)
                                      and getattr(args, "tool_call_parser", None)),
                     reasoning_parser=bool(getattr(args, "reasoning_parser", None)),
                     structured_outputs=structured)
    names = getattr(args, "served_model_name", None) or [config.model]
    names = [names] if isinstance(names, str) else list(names)
    created, hf_id, tok = _created(config.model), _hf_id(args.model, settings.listing_hugging_face_id), \
        _tokenizer(config.hf_config)
    return [ModelFacts(id=name, name=settings.listing_name or name, created=created, context_length=ctx,
                       max_output_length=out_len, quantization=quant, hugging_face_id=hf_id, tokenizer=tok,
                       features=feats) for name in names]


__all__ = ["model_facts", "ListingError"]
