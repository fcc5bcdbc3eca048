"""The bundled Qwen2/2.5/3 vocabulary and its data: the one module that loads vocabulary files.

``data/qwen.tiktoken`` holds 151,643 byte-level BPE ranks (``base64(token) rank`` per line; rank == token id of
the Qwen2/2.5/3 ``vocab.json``), from Alibaba's Apache-2.0 ``dashscope`` package (see ``data/NOTICE``). Added
tokens follow the base ranks: ``ADDED_TOKENS[flavor]`` lists them in id order from ``NUM_BASE_TOKENS``.
"""
from __future__ import annotations

import base64
import functools
import os

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
VOCAB_FILE = os.path.join(DATA_DIR, "qwen.tiktoken")
NUM_BASE_TOKENS = 151643
"""Number of BPE ranks in the bundled file; ids >= this are added (special) tokens."""

_QWEN25_ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)
# flavor -> ((content, special), ...) with ids NUM_BASE_TOKENS, NUM_BASE_TOKENS + 1, ...
ADDED_TOKENS = {
    "qwen2.5": _QWEN25_ADDED,
    "qwen3": _QWEN25_ADDED + (("<tool_response>", False), ("</tool_response>", False),
                              ("<think>", False), ("</think>", False)),
}


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken-format BPE file (``base64(token) rank`` per line) into ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def bundled_ranks() -> dict[bytes, int]:
    """``{token bytes: rank}`` of the bundled Qwen2/2.5/3 vocabulary (rank == token id)."""
    return load_ranks(VOCAB_FILE)
