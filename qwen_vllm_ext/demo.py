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
GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}


def build_demo_model(output: str | os.PathLike, seed: int = 0) -> Path:
    """Write the demo model directory to ``output`` (created; existing files overwritten)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qwen_v3_calculator.hf_export import write_tokenizer_files

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json in transformers' own layout; pin ours for reproducibility.
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_tokenizer_files(out, flavor="qwen3")
    return out


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the cached demo model, building it once (atomically) if needed."""
    root = Path(cache_dir) if cache_dir else cache_home() / "models"
    final = root / f"{DEMO_NAME}-r{DEMO_REVISION}"
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        build_demo_model(tmp)
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
    args = parser.parse_args(argv)
    path = build_demo_model(args.output, args.seed) if args.output else ensure_demo_model()
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
