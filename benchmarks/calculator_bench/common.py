"""Constants of the calculator benchmark: paths, targets, the slices and implementations compared."""
from __future__ import annotations

import os
import re


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
ROOT = os.path.dirname(HERE)
MODULE = "benchmarks.bench_calculator"  # the command (python -m, ROOT on PYTHONPATH); its --_worker mode measures
RESULTS = os.path.join(HERE, "results")
SEED = 20250611
BASE_SLICES = ("mixed", "zh", "en", "code", "chat")  # from package data; corpus_sha256 covers these
# generated text in the languages users send (languages.py), timed after the base slices; own sha256
LANG_SLICES = ("ru", "ar", "th", "hi", "ja", "ko", "id", "el", "vi", "he", "mixchat")
SLICES = BASE_SLICES + LANG_SLICES
TEXT_SLICES = ("zh", "en", "code")
HEADLINE = "ours.count_tokens"
IMPLS = ("ours.count_tokens", "ours.Tokenizer.count", "ours.count_batch", "ours.encode",
         "tiktoken", "hf.encode", "hf.encode_batch", "bpe-qwen")
REFERENCE = "hf.encode"
TARGETS = {"vs_tiktoken": 5.0, "vs_hf_mixed": 15.0, "load_s": 0.3, "batch_speedup": 1.8}
BATCH_DOCS = 16     # the batch section's long documents: the mixed corpus cut into this many
BATCH_ROUNDS = 25   # paired rounds (one thread / all cores, alternating which goes first) per batch measurement
CJK_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3000-\u303f\uff00-\uffef]")

# --peers: every peer tokenizer side by side with ours (bench_calculator.py --peers; docs/benchmarks.md)
PEERS_REQUIREMENTS = os.path.join(HERE, "requirements-peers.txt")  # the pins; --peers installs the missing ones
MULTITURN = "multiturn"  # the warm workload: requests of multi-turn conversations (corpus.multiturn_workload)
PEER_SLICES = SLICES + (MULTITURN,)
PEER_PASSES = 4  # per slice and process: the first (cold) and 3 more (warm: the best of them)
# name -> (distribution on PyPI, how it is loaded, its call timed one text at a time, its all-cores call)
PEERS = {
    "ours.count_tokens": (None, "qwen_v3_calculator (this project), bundled vocabulary",
                          "qwen_v3_calculator.count_tokens(text, model=...)", "count_tokens_batch(texts)"),
    "ours.encode_fn": (None, "qwen_v3_calculator (this project), bundled vocabulary",
                       "qwen_v3_calculator.encode(text, model=...)", "encode_batch(texts)"),
    "tiktoken": ("tiktoken", "the bundled .tiktoken ranks, the split regex and added tokens of tokenizer.json; "
                 "added tokens split out and NFC per segment in Python", "encode_ordinary per segment",
                 "Encoding.encode_batch(num_threads=cores)"),
    "hf.encode": ("tokenizers", "tokenizers.Tokenizer.from_file(tokenizer.json)", "Tokenizer.encode",
                  "Tokenizer.encode_batch"),
    "fastokens": ("fastokens", "fastokens.Tokenizer.from_file(tokenizer.json)", "Tokenizer.encode",
                  "Tokenizer.encode_batch"),
    "gigatoken": ("gigatoken", "gigatoken.Tokenizer(tokenizer.json)", "Tokenizer.encode (numpy array)",
                  "Tokenizer.encode_batch (awkward array)"),
    "riptoken": ("riptoken", "riptoken.CoreBPE(the bundled .tiktoken ranks, tokenizer.json's added tokens and split "
                 "regex); NFC per segment in Python", "CoreBPE.encode_ordinary per segment",
                 "CoreBPE.encode_batch(allowed_special=added tokens)"),
    "tokie": ("tokie", "tokie.Tokenizer.from_json(tokenizer.json)", "Tokenizer.encode", "Tokenizer.encode_batch"),
    "bpe-qwen": ("bpe-qwen", "bpe_qwen.QwenTokenizer(dir): vocab.json, merges.txt, tokenizer_config.json's added "
                 "tokens; its pre-tokenizer is built in (it reads no split regex and no normalizer)",
                 "QwenTokenizer.encode", "QwenTokenizer.encode_batch_parallel(num_workers=cores)"),
    "runtoken": ("runtoken", "runtoken.Tokenizer(encoding_name, vocab_path): the split regex is chosen by the "
                 "encoding name (cl100k_base, o200k_base, p50k_base)", "Tokenizer.encode", None),
}
PEER_REFERENCE = "hf.encode"  # ids are verified per document against it
PEER_BASELINE = "tiktoken"    # the "x tiktoken" column
