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


def answer_repeated(prompt: Sequence[int], opener: Sequence[int], think: tuple | None,
                    max_tail: int = MAX_GENERATION_TAIL) -> bool:
    """Will the next turn's prompt repeat what this request generates, under the reuse template's default
    (``preserve_thinking: "answers"``)? ``think``: (``<think>`` id, ``</think>`` id, the ids between them in an empty
    block); None: no think tokens, always yes. Yes when the generation prompt after the last ``opener`` already
    closes the think block (thinking off: the answer comes back as generated), or when an earlier turn of the prompt
    kept a non-empty think block (the client sends ``preserve_thinking: true``: the reasoning comes back too). No for
    a thinking-on generation otherwise: the template drops its reasoning, so the next prompt diverges at the turn
    boundary and a state kept inside the generation is never reused. Not a chat generation prompt (no opener in the
    tail): yes, as before."""
    if think is None:
        return True
    open_id, close_id, empty = think
    n, k = len(prompt), len(opener)
    start = -1
    if k and n >= k:
        first = opener[0]
        for i in range(n - k, max(0, n - k - max_tail) - 1, -1):
            if prompt[i] == first and list(prompt[i:i + k]) == list(opener):
                start = i
                break
    if start < 0 or close_id in prompt[start + k:]:
        return True
    history = list(prompt[:start])
    empty = list(empty)
    i = 0
    while True:
        try:
            i = history.index(open_id, i)
            j = history.index(close_id, i + 1)
        except ValueError:
            return False
        if history[i + 1:j] != empty:
            return True
        i = j + 1


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


def weight_params(config: dict) -> int:
    """Parameters of a hybrid Qwen model's language model (Qwen3-Next / Qwen3.5 / Qwen3.6 ``config.json``; a
    multimodal checkpoint's vision encoder is not counted: ``--language-model-only`` does not load it). Exact for the
    tensors vLLM loads: embeddings and ``lm_head`` (unless tied), per Gated DeltaNet layer ``in_proj_qkvz``,
    ``in_proj_ba``, the conv, ``A_log``/``dt_bias``, the gated norm and ``out_proj``; per attention layer the gated
    ``q_proj`` (query and gate), ``k_proj``/``v_proj``, ``o_proj`` and the q/k norms; per layer the MLP (dense, or
    the experts, router, shared expert and its gate) and two norms."""
    cfg = config.get("text_config") or config
    hidden, vocab, n_layers = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(n_layers)]
    kh, kd = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    vh, vd = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
    kernel = int(cfg.get("linear_conv_kernel_dim", 4))
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    linear = (hidden * (2 * kh * kd + 2 * vh * vd) + hidden * 2 * vh + (2 * kh * kd + vh * vd) * kernel
              + 2 * vh + vd + vh * vd * hidden)
    attention = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden \
        + 2 * head_dim
    experts = int(cfg.get("num_experts") or 0)
    if experts:
        mlp = experts * 3 * hidden * int(cfg["moe_intermediate_size"]) + hidden * experts
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        mlp += 3 * hidden * shared + (hidden if shared else 0)
    else:
        mlp = 3 * hidden * int(cfg["intermediate_size"])
    layers = sum(linear if t == "linear_attention" else attention for t in layer_types[:n_layers])
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2)
    return embeddings + layers + n_layers * (mlp + 2 * hidden) + hidden


def copy_reserve(num_blocks: int, running: int, groups: int) -> int:
    """Free blocks an answer-state copy must leave in a pool of ``num_blocks``: a copy takes a block outside the
    scheduler's allocation, so it never may leave a running request short. Each of the ``running`` requests can need
    a new block in each of the ``groups`` KV-cache groups at its next step (a block boundary), so the copy is skipped
    while free blocks are at or below that, and at least max(2, blocks / 32) stay free."""
    return max(2, num_blocks // 32, running * groups)


# States a running request holds at most in vLLM's ``align`` mode without speculative decoding (the running one and
# the one being written at a block boundary): MambaSpec.max_memory_usage_bytes, what vLLM's "Maximum concurrency"
# log line counts
RUNNING_STATES = 2


def memory_plan(config: dict, gpu_bytes: int, *, utilization: float = 0.92, reserve_bytes: int = 4 << 30,
                weight_bytes_per_param: float = 2.0, tp: int = 1, block_align: int = 16, context_tokens: int = 8192,
                concurrency: Sequence[int] = (64, 256), unit: int = 16, hbm_bytes_per_s: float | None = None) -> dict:
    """Where a hybrid model's KV pool goes on one GPU, and what keeping states costs there.

    vLLM gives the engine ``utilization`` of the GPU; the weights and ``reserve_bytes`` (activations at the largest
    batch, CUDA graphs: an assumption; vLLM's log line "Available KV cache memory" is the measured pool) come off
    it and the rest is the pool. vLLM cuts the pool into blocks of one page per layer of a KV-cache group; a group
    has as many layers as the model has attention layers, so a block holds ``block_tokens`` tokens of every
    attention layer, or the states of that many Gated DeltaNet layers, and one state of all of them takes
    ``state_blocks`` blocks (3 on Qwen3.5/3.6). A running request holds its attention blocks and up to
    :data:`RUNNING_STATES` states (vLLM's own count for its concurrency line in ``align`` mode).

    Per ``concurrency`` C (conversations with a request in flight, ``context_tokens`` each): how many run at once
    (the rest wait in vLLM's queue), the blocks answer checkpoints take beside them (one kept state per running
    request at most, evictable, and none once free blocks fall to the copy guard :func:`copy_reserve`), how
    many idle conversations' prefixes (attention blocks and one live state each) the rest of the pool keeps, with
    and without answer checkpoints, and the copy traffic: a running request copies its state once per ``unit``
    generated tokens, so a decode step moves ``running / unit`` states (read and written), against what the step
    moves anyway: the weights (every weight of a dense model; of a mixture of experts, the experts the running
    tokens route to, expected under a uniform router), the attention KV it reads and the states it reads and
    writes."""
    s = state_bytes(config, tp=tp, block_align=block_align)
    cfg = config.get("text_config") or config
    params = weight_params(config)
    weights = int(params * weight_bytes_per_param / tp)
    pool = int(gpu_bytes * utilization) - weights - reserve_bytes
    block_bytes = s["padded"] // s["layers"] * s["attention_layers"]
    state_blocks = math.ceil(s["layers"] / s["attention_layers"])
    blocks = max(pool // block_bytes, 0)
    attention_blocks = math.ceil(context_tokens / s["block_size"])
    per_running = attention_blocks + RUNNING_STATES * state_blocks
    kept = attention_blocks + state_blocks  # an idle conversation's prefix and its one live state
    experts, top_k = int(cfg.get("num_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    rows = []
    for c in concurrency:
        running = min(c, blocks // per_running)
        free = blocks - running * per_running
        guard = copy_reserve(blocks, running, 1 + state_blocks)  # one attention group and the state groups
        answers = min(running, max(free - guard, 0) // state_blocks) * state_blocks  # whole states
        read = params * weight_bytes_per_param / tp
        if experts and running:
            per_layer = experts * 3 * int(cfg["hidden_size"]) * int(cfg["moe_intermediate_size"])
            touched = 1 - (1 - top_k / experts) ** running  # expected share of the experts the tokens route to
            read -= int(cfg["num_hidden_layers"]) * per_layer * (1 - touched) * weight_bytes_per_param / tp
        step = read + running * (context_tokens * s["attention_bytes_per_token"] + 2 * s["raw"])
        copy = running / unit * 2 * s["raw"]
        rows.append({"concurrency": c, "running": running, "waiting": c - running, "copy_guard": guard,
                     "answer_blocks": answers,
                     "idle_kept": (free - answers) // kept, "idle_kept_without_answers": free // kept,
                     "copy_bytes_per_step": copy, "step_bytes": step, "copy_share": copy / (step + copy),
                     "copy_ms_per_step": 1000 * copy / hbm_bytes_per_s if hbm_bytes_per_s else None})
    return {"params": params, "weight_bytes": weights, "pool_bytes": pool, "block_bytes": block_bytes,
            "block_tokens": s["block_size"], "state_blocks": state_blocks, "blocks": blocks,
            "state_raw": s["raw"], "state_padded": s["padded"], "states_max": blocks // state_blocks,
            "attention_blocks": attention_blocks, "rows": rows}
