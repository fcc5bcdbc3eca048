"""A tiny random-weight Qwen3-architecture model with the real Qwen3 tokenizer, for demos and tests.

``python -m qwen_vllm_ext.demo --output DIR`` writes config.json, generation_config.json, seeded random
weights (model.safetensors), the Qwen3 tokenizer files (built from the bundled vocabulary) and the
official Qwen3 chat template. No network at build time beyond the reference files that setup already
cached. vLLM serves it on a CPU in well under a second per short request. The launcher uses
:func:`ensure_demo_model` (built once, cached) when no ``--model`` is given and no GPU is present.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from .assets import cache_home

DEMO_NAME = "qwen3-tiny-demo"
DEMO_REVISION = 2  # bump when the files below change: a new cache entry is built
SERVED_NAME = "qwen3-demo"

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,  # as in every Qwen3 checkpoint (padded past the 151,669 real tokens)
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,  # vLLM's CPU attention needs head_dim >= 32
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "use_cache": True,
    "torch_dtype": "float32",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
    # Written by real Qwen3 checkpoints; without it transformers 5 suspects a Mistral tokenizer and warns.
    "transformers_version": "4.51.0",
}
# Variants: config overrides on top of CONFIG. "prefill-bench" is for the scheduler benchmark: a small vocabulary
# (decode steps stay cheap, as the LM head is a small share of a real model's work) and a deeper, wider body, so
# that a long prefill costs tens of full-batch decode steps as on a GPU, where the demo model's 2,000-token
# prefill costs about one (benchmarks/bench_scheduler.py measures and prints the ratio). Same tokenizer (ids <
# 8192 are real Qwen tokens); not for chat.
VARIANTS: dict[str, dict] = {
    "demo": {},
    "prefill-bench": {"vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1152, "num_hidden_layers": 4,
                      "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64},
}
GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
"""Qwen3-8B's architecture (its published config.json): served with ``--load-format dummy`` by
benchmarks/gpu_check.py, so no weights are written or downloaded."""


def write_config_only(output: str | os.PathLike, overrides: dict | None = None) -> Path:
    """A model directory without weights (config, generation config, the Qwen3 tokenizer and chat template), for
    vLLM's ``--load-format dummy``: the architecture of ``CONFIG`` + ``overrides`` (e.g. :data:`QWEN3_8B`)."""
    from qwen_v3_calculator.hf_export import write_tokenizer_files

    from .assets import chat_template

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**CONFIG, **(overrides or {})}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_tokenizer_files(out, flavor="qwen3", chat_template=chat_template("qwen3"))
    return out


def build_demo_model(output: str | os.PathLike, seed: int = 0, variant: str = "demo") -> Path:
    """Write the demo model directory (or another ``VARIANTS`` entry) to ``output`` (existing files overwritten)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qwen_v3_calculator.hf_export import write_tokenizer_files

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **VARIANTS[variant]}
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json in transformers' own layout; pin ours for reproducibility.
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    from .assets import chat_template

    write_tokenizer_files(out, flavor="qwen3", chat_template=chat_template("qwen3"))
    return out


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, variant: str = "demo") -> Path:
    """Path of the cached demo model (or ``VARIANTS`` entry), building it once (atomically) if needed."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r}; known: {', '.join(VARIANTS)}")
    root = Path(cache_dir) if cache_dir else cache_home() / "models"
    name = DEMO_NAME if variant == "demo" else f"qwen3-{variant}"
    final = root / f"{name}-r{DEMO_REVISION}"
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        build_demo_model(tmp, variant=variant)
        (tmp / ".complete").write_text("ok\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen_vllm_ext.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="directory to write (default: the shared cache entry)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="demo")
    args = parser.parse_args(argv)
    path = (build_demo_model(args.output, args.seed, args.variant) if args.output
            else ensure_demo_model(variant=args.variant))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
