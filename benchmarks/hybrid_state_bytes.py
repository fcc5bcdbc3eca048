#!/usr/bin/env python
"""What one kept recurrent state (a prefix-cache checkpoint) costs on hybrid Qwen models, from their configs.

    .venv/bin/python -m benchmarks.hybrid_state_bytes [--tp 1] [--config path/to/config.json ...]
    .venv/bin/python -m benchmarks.hybrid_state_bytes --plan [--context 8192] [--reserve-gib 4]

``--plan``: the GPU memory plan (issue 48) of Qwen3.6-27B and Qwen3.6-35B-A3B at tensor-parallel 1 on the GPU
profiles' cards, bf16 and FP8 weights (``qwen_vllm_ext.kv.checkpoints.memory_plan``: the pool, blocks, states that
fit, what the policy keeps at 64 and 256 conversations in flight, and the answer checkpoints' copy traffic per decode
step). Arithmetic from the configs, not a measurement: the reserve for activations and CUDA graphs is an assumption
(vLLM's "Available KV cache memory" log line is the measured pool), the bandwidth is the spec sheet's.

Rows: the hybrid demo (``qwen_vllm_ext.demo.HYBRID_CONFIG``, CPU alignment 128: what vLLM allocated here), and the
text configs of Qwen3.6-27B and Qwen3.6-35B-A3B (the fields below, as published in their ``config.json``; the 3.5
releases of both sizes have the same architecture), GPU alignment 16; plus any ``--config`` file given.
Per row: raw bytes of one checkpoint (all Gated DeltaNet layers), the attention block vLLM raises to hold a state,
the padded bytes (what the engine actually spends per kept state), and the most dense retention
(``--prefix-cache-retention-interval None``) can hold for a 10,000-token conversation: one state per block (it keeps
the states the engine writes at block boundaries -- prefill chunk ends and generated blocks -- so fewer when a
prompt is prefilled in one chunk).
"""
from __future__ import annotations

import argparse
import json
import math
import os

from qwen_vllm_ext.demo import HYBRID_CONFIG
from qwen_vllm_ext.kv.checkpoints import memory_plan, state_bytes

# text_config fields of the published checkpoints (Qwen/Qwen3.6-27B, Qwen/Qwen3.6-35B-A3B): 3 Gated DeltaNet layers
# to 1 gated-attention layer, a float32 recurrent state (mamba_ssm_dtype), bf16 weights
PUBLISHED = {
    "Qwen3.6-27B": {"num_hidden_layers": 64, "full_attention_interval": 4, "hidden_size": 5120,
                    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
                    "dtype": "bfloat16", "intermediate_size": 17408, "vocab_size": 248320,
                    "tie_word_embeddings": False},
    "Qwen3.6-35B-A3B": {"num_hidden_layers": 40, "full_attention_interval": 4, "hidden_size": 2048,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
                        "dtype": "bfloat16", "num_experts": 256, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "vocab_size": 248320,
                        "tie_word_embeddings": False},
}
CONVERSATION_TOKENS = 10_000
# the GPU profiles' cards: memory as nvidia-smi reports it (qwen_vllm_ext/profiles/*.toml) and HBM bandwidth from the
# spec sheets (SXM parts)
GPUS = {"A100 80GB": (81920, 2.039e12), "H100 80GB": (81559, 3.35e12), "H200 141GB": (143771, 4.8e12)}


def rows(tp: int, configs: list[str]) -> list[dict]:
    out = []
    items = [("qwen36-demo (CPU)", HYBRID_CONFIG, 128)] + [(k, v, 16) for k, v in PUBLISHED.items()]
    for path in configs:
        with open(path, encoding="utf-8") as f:
            items.append((os.path.basename(os.path.dirname(os.path.abspath(path))) or path, json.load(f), 16))
    for name, cfg, align in items:
        s = state_bytes(cfg, tp=1 if "demo" in name else tp, block_align=align)
        dense_states = math.ceil(CONVERSATION_TOKENS / s["block_size"])
        out.append({"model": name, **s, "dense_states_10k": dense_states,
                    "dense_bytes_10k": dense_states * s["padded"],
                    "attention_bytes_10k": CONVERSATION_TOKENS * s["attention_bytes_per_token"]})
    return out


def plan(args) -> None:
    gib, mib = 1 << 30, 1 << 20
    print(f"GPU memory plan: tensor-parallel 1, vLLM's default gpu_memory_utilization 0.92, {args.reserve_gib:g} GiB "
          f"reserved for activations and CUDA graphs (assumed), conversations of {args.context:,} tokens, "
          f"16-token match unit; one kept state = the padded bytes below\n")
    print("| model | GPU | weights | KV pool | blocks (tokens each) | one state, padded | states if the pool held only "
          "states | in flight | running / waiting | answer-state blocks | idle conversations kept (without answer "
          "checkpoints) | copy traffic per decode step | share of the step's traffic | at spec bandwidth |")
    print("|---" * 14 + "|")
    for name, cfg in PUBLISHED.items():
        for weight_bytes, dtype in ((2.0, "bf16"), (1.0, "fp8")):
            for gpu, (gpu_mib, bandwidth) in GPUS.items():
                p = memory_plan(cfg, gpu_mib * mib, reserve_bytes=int(args.reserve_gib * gib),
                                weight_bytes_per_param=weight_bytes, context_tokens=args.context,
                                concurrency=(64, 256), hbm_bytes_per_s=bandwidth)
                for r in p["rows"]:
                    head = (f"| {name} | {gpu} | {dtype} {p['weight_bytes'] / gib:.1f} GiB | "
                            f"{max(p['pool_bytes'], 0) / gib:.1f} GiB | {p['blocks']:,} ({p['block_tokens']}) | "
                            f"{p['state_padded'] / mib:.0f} MiB | {p['states_max']:,}")
                    print(f"{head} | {r['concurrency']} | {r['running']} / {r['waiting']} | {r['answer_blocks']} | "
                          f"{r['idle_kept']} ({r['idle_kept_without_answers']}) | "
                          f"{r['copy_bytes_per_step'] / gib:.2f} GiB | {100 * r['copy_share']:.1f}% | "
                          f"{r['copy_ms_per_step']:.2f} ms |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism for the published models")
    ap.add_argument("--config", action="append", default=[], help="another model's config.json")
    ap.add_argument("--plan", action="store_true", help="the GPU memory plan instead (issue 48)")
    ap.add_argument("--context", type=int, default=8192, help="--plan: tokens per conversation")
    ap.add_argument("--reserve-gib", type=float, default=4.0,
                    help="--plan: GPU memory for activations and CUDA graphs (vLLM's own profile decides it)")
    args = ap.parse_args(argv)
    if args.plan:
        plan(args)
        return 0
    mib = 1024 * 1024
    print(f"| model | GDN layers | one state, raw | attention block (tokens) | one state, padded | "
          f"dense retention at most, {CONVERSATION_TOKENS:,}-token conversation | its attention KV |")
    print("|---|---|---|---|---|---|---|")
    for r in rows(args.tp, args.config):
        print(f"| {r['model']} | {r['layers']} | {r['raw'] / mib:.2f} MiB | {r['block_size']} | "
              f"{r['padded'] / mib:.2f} MiB | {r['dense_states_10k']} states = {r['dense_bytes_10k'] / mib:.0f} MiB | "
              f"{r['attention_bytes_10k'] / mib:.0f} MiB |")
    print(f"\n(tensor parallelism {args.tp} for the published models: per-GPU bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
