"""Constants of the calculator benchmark: paths, targets, the slices and implementations compared."""
from __future__ import annotations

import os
import re


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
SCRIPT = os.path.join(HERE, "bench_calculator.py")  # the command; its --_worker mode runs the measurements
ROOT = os.path.dirname(HERE)
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
