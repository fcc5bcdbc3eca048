#!/usr/bin/env python
"""What one kept recurrent state (a prefix-cache checkpoint) costs on hybrid Qwen models, from their configs.

    .venv/bin/python benchmarks/hybrid_state_bytes.py [--tp 1] [--config path/to/config.json ...]

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
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwen_vllm_ext.demo import HYBRID_CONFIG  # noqa: E402
from qwen_vllm_ext.kv.checkpoints import state_bytes  # noqa: E402

# text_config fields of the published checkpoints (Qwen/Qwen3.6-27B, Qwen/Qwen3.6-35B-A3B): 3 Gated DeltaNet layers
# to 1 gated-attention layer, a float32 recurrent state (mamba_ssm_dtype), bf16 weights
PUBLISHED = {
    "Qwen3.6-27B": {"num_hidden_layers": 64, "full_attention_interval": 4, "hidden_size": 5120,
                    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
                    "dtype": "bfloat16"},
    "Qwen3.6-35B-A3B": {"num_hidden_layers": 40, "full_attention_interval": 4, "hidden_size": 2048,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
                        "dtype": "bfloat16"},
}
CONVERSATION_TOKENS = 10_000


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism for the published models")
    ap.add_argument("--config", action="append", default=[], help="another model's config.json")
    args = ap.parse_args(argv)
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
