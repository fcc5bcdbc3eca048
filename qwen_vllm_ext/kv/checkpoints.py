"""Pure logic of turn checkpoints on hybrid models (Gated DeltaNet + attention; no vLLM import).

A Gated DeltaNet (linear-attention) layer keeps no per-token cache: a prefix can be reused only where vLLM kept the
layer's recurrent state (a *checkpoint*), and the attention layers' hit is cut to that checkpoint. In vLLM's
``align`` mode the engine keeps a state at the prompt's tail (``prompt - 1`` floored to the match unit) and, at
best, at a shared-prefix junction. A chat turn's next request does not share that tail: the official Qwen3.5/3.6
template re-renders the earlier answer as ``<|im_start|>assistant\\n{content}`` without the ``<think>`` block the
generation prompt opened, so the next prompt diverges right after the last ``<|im_start|>assistant\\n``. When the
tail checkpoint lies past that point (it does whenever the generation prompt's few tokens cross a match-unit
boundary), stock vLLM falls back to an older checkpoint, often a whole turn back.

* :func:`turn_boundary` — where the next turn will diverge, floored to the match unit: the state the extension has
  vLLM keep for each chat request (``kv/hybrid_checkpoints.py`` does it in the engine).
* :func:`state_bytes` — what one kept state costs, from a model's ``config.json`` (Qwen3-Next / Qwen3.5 / Qwen3.6
  linear-attention layers), before and after vLLM pads it to the attention page size.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

# After the generation prompt's opener ``<|im_start|>assistant\n`` the official templates add at most
# ``<think>\n`` (thinking on) or ``<think>\n\n</think>\n\n`` (thinking off): 2 or 4 tokens. A prompt whose last
# opener is followed by more than this is not a chat generation prompt (a prefilled assistant message, a raw
# completion): no boundary is placed, as the next request's shape is unknown.
MAX_GENERATION_TAIL = 8


def turn_boundary(prompt: Sequence[int], opener: Sequence[int], unit: int,
                  max_tail: int = MAX_GENERATION_TAIL) -> int:
    """Token position where the next turn's prompt is expected to diverge from ``prompt``, floored to ``unit``:
    just after the last ``opener`` (the ids of ``<|im_start|>assistant\\n``) when it starts the generation prompt
    (at most ``max_tail`` tokens follow it). 0: no such opener, or the floor is 0."""
    n, k = len(prompt), len(opener)
    if k == 0 or unit <= 0 or n < k:
        return 0
    first = opener[0]
    # scan only the tail window: the opener must end within max_tail tokens of the prompt's end
    lo = max(0, n - k - max_tail)
    for start in range(n - k, lo - 1, -1):
        if prompt[start] == first and list(prompt[start:start + k]) == list(opener):
            return (start + k) // unit * unit
    return 0


def _dtype_bytes(name: str | None) -> int:
    return {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}.get(str(name), 2)


def state_bytes(config: dict, tp: int = 1, block_align: int = 16) -> dict:
    """Bytes of one recurrent-state checkpoint of a hybrid Qwen model (all of its Gated DeltaNet layers), from the
    model's ``config.json`` dict (``text_config`` is read for the multimodal Qwen3.5/3.6 checkpoints).

    Per GDN layer vLLM keeps a conv state ``(conv_kernel - 1) x (2 * key_dim + value_dim)`` in the model dtype and a
    recurrent state ``num_v_heads x head_v_dim x head_k_dim`` in ``mamba_ssm_dtype`` (float32 when the config does
    not say: what vLLM 0.32 allocates for the demo), both sharded by ``tp``; ``key_dim = num_k_heads * head_k_dim``,
    ``value_dim = num_v_heads * head_v_dim``. vLLM stores one layer's state per page, and all pages have one size:
    the attention block is raised to the smallest multiple of ``block_align`` (the attention kernel's block
    alignment: 16 on GPU backends, 128 on vLLM's CPU backend, whose default block size is 128) whose page (K and V
    of the layer's KV heads) holds the state, and the state is padded to that page.
    Returns ``layers``/``attention_layers``, ``raw`` and ``padded`` bytes per checkpoint (all GDN layers), and
    ``block_size`` (the raised attention block)."""
    cfg = config.get("text_config") or config
    model_b = _dtype_bytes(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    ssm_b = _dtype_bytes(cfg.get("mamba_ssm_dtype") or "float32")
    n_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types:
        n_linear = sum(1 for t in layer_types[:n_layers] if t == "linear_attention")
    else:  # every full_attention_interval-th layer attends
        n_linear = n_layers - n_layers // int(cfg.get("full_attention_interval", 4))
    kh, kd = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    vh, vd = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
    conv = (int(cfg.get("linear_conv_kernel_dim", 4)) - 1) * ((2 * kh * kd + vh * vd) // tp) * model_b
    ssm = (vh // tp) * vd * kd * ssm_b
    per_layer = conv + ssm
    kv_heads = max(1, int(cfg["num_key_value_heads"]) // tp)  # vLLM replicates KV heads when tp exceeds them
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    attn_per_token = 2 * kv_heads * head_dim * model_b
    block_size = block_align * math.ceil(per_layer / (block_align * attn_per_token))
    return {"layers": n_linear, "attention_layers": n_layers - n_linear, "raw": per_layer * n_linear,
            "padded": block_size * attn_per_token * n_linear, "block_size": block_size,
            "attention_bytes_per_token": attn_per_token * (n_layers - n_linear)}
