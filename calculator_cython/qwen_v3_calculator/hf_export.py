"""Write HuggingFace-format Qwen tokenizer files from the bundled vocabulary.

``write_tokenizer_files`` produces ``vocab.json``, ``merges.txt``, ``tokenizer.json`` and
``tokenizer_config.json`` for Qwen3, Qwen2.5 or Qwen3.5/3.6 (flavor ``qwen3.6``). For Qwen2/2.5/3 the first three
are byte-identical to the official files (vocab.json and merges.txt are shared by Qwen2/2.5/3; tokenizer.json is
checked against Qwen3's). The merge list is not stored: each token's merge is re-derived from the rank order
(``derive_merges``, the rule that rebuilds the official merges of both vocabularies byte for byte: for Qwen3.5/3.6
``merges.txt`` is the official file too, sha256-checked in the tests); a token the rule gives no merge (201 of the
Qwen3.5/3.6 ranks) is never produced by BPE, here as in the calculator.

CLI: ``python -m qwen_v3_calculator.hf_export --flavor qwen3 --output DIR --chat-template FILE``.
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from .tokenizer import QWEN2_PATTERN as SPLIT_PATTERN, SPLIT_RULES  # SPLIT_PATTERN: Qwen2/2.5/3's regex
from .vocab import ADDED_TOKENS, FLAVOR_VOCABULARY, VOCABULARIES, vocabulary_ranks


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character mapping used by byte-level BPE files."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):  # the other 68 bytes map to U+0100 onwards
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _to_unicode(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def vocab_from_ranks(ranks: dict[bytes, int]) -> dict[str, int]:
    """``{byte-level token string: id}`` in id order (the ``vocab.json`` / tokenizer.json vocab)."""
    return {_to_unicode(tok): r for tok, r in sorted(ranks.items(), key=lambda kv: kv[1])}


def _merge_path(token: bytes, ranks: dict[bytes, int]) -> tuple[list[bytes], tuple[bytes, bytes] | None]:
    """Byte-pair merging of ``token`` with no rank cap (tiktoken's ``_byte_pair_merge``: repeatedly merge the adjacent
    pair whose merged bytes have the lowest rank in the whole vocabulary, until nothing merges): the final parts and
    the pair joined at the last step (None when nothing merged)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    last = None
    while len(parts) > 1:
        best, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, best_i = r, i
        if best_i < 0:
            break
        last = (parts[best_i], parts[best_i + 1])
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts, last


def derive_merges(ranks: dict[bytes, int], unmerged: list | None = None) -> list[tuple[str, str]]:
    """The official merge list, in rank order: for every token of >= 2 bytes, byte-pair merging of its bytes with no
    rank cap (:func:`_merge_path`); when that ends in the token itself, the pair joined at the last step is its merge,
    else it has none (appended to ``unmerged`` as ``(rank, token bytes)`` when a list is given; BPE never produces it).

    This rebuilds both official files byte for byte (Qwen2/2.5/3: 151,387 merges; Qwen3.5/3.6: 247,587, 201 tokens
    without a merge). Capping the ranks below the token, the obvious derivation, gives the same Qwen3 file but misses
    31 Qwen3.5/3.6 merges whose pieces rank above the result (common words: 人力资源, является, المصري, ...).
    """
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts, last = _merge_path(tok, ranks)
        if len(parts) != 1 or last is None:
            if unmerged is not None:
                unmerged.append((rank, tok))
            continue
        merges.append((_to_unicode(last[0]), _to_unicode(last[1])))
    return merges


def merges_text(merges: list[tuple[str, str]], header: bool) -> str:
    """``merges.txt`` as the official files are: ``left right`` lines, a newline after the last; Qwen2/2.5/3's file
    starts with ``#version: 0.2``, Qwen3.5/3.6's has no header."""
    return ("#version: 0.2\n" if header else "") + "".join(f"{a} {b}\n" for a, b in merges)


def _added_tokens(flavor: str) -> list[tuple[int, str, bool]]:
    if flavor not in ADDED_TOKENS:
        raise ValueError(f"unknown flavor {flavor!r}; expected one of {sorted(ADDED_TOKENS)}")
    base = VOCABULARIES[FLAVOR_VOCABULARY[flavor]].num_base
    return [(base + i, c, s) for i, (c, s) in enumerate(ADDED_TOKENS[flavor])]


def _tokenizer_json(vocab, merges, added, pattern: str = SPLIT_PATTERN, normalizer: str | None = "NFC") -> dict:
    """The ``tokenizers`` save format (keys in its serialization order)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, c, s in added],
        "normalizer": {"type": normalizer} if normalizer else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]},
    }


def _tokenizer_config(added, chat_template: str, model_max_length: int, tokenizer_class: str) -> dict:
    """``tokenizer_config.json`` as transformers saves it for the official models."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": s} for i, c, s in added},
        "additional_special_tokens": [c for _, c, s in added if s and c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }


def write_tokenizer_files(out_dir, flavor: str, chat_template: str) -> list[Path]:
    """Write vocab.json, merges.txt, tokenizer.json, tokenizer_config.json into ``out_dir``.

    ``chat_template``: the Jinja text stored in tokenizer_config.json (this package ships no official
    template; pass the model's own). Returns the written paths.
    """
    if not isinstance(chat_template, str):
        raise TypeError("chat_template must be the Jinja template text")
    added = _added_tokens(flavor)
    vocabulary = VOCABULARIES[FLAVOR_VOCABULARY[flavor]]
    ranks = vocabulary_ranks(vocabulary.name)
    vocab, merges = vocab_from_ranks(ranks), derive_merges(ranks)
    tokenizer = _tokenizer_json(vocab, merges, added, SPLIT_RULES[vocabulary.split_rule], vocabulary.normalizer)
    contents = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False, separators=(",", ":")),
        "merges.txt": merges_text(merges, header=vocabulary.name == "qwen3"),
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False, indent=2),
        "tokenizer_config.json": json.dumps(_tokenizer_config(added, chat_template, vocabulary.model_max_length,
                                                              vocabulary.tokenizer_class),
                                            ensure_ascii=False, indent=2, sort_keys=True) + "\n",
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in contents.items():
        path = out / name
        path.write_bytes(text.encode("utf-8"))
        paths.append(path)
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m qwen_v3_calculator.hf_export", description=__doc__.split("\n")[0])
    ap.add_argument("--flavor", choices=sorted(ADDED_TOKENS), default="qwen3")
    ap.add_argument("--output", required=True, help="directory to write the tokenizer files into")
    ap.add_argument("--chat-template", required=True, help="Jinja chat template file (the model's own)")
    args = ap.parse_args(argv)
    template = Path(args.chat_template).read_text(encoding="utf-8")
    for path in write_tokenizer_files(args.output, args.flavor, template):
        print(path)


if __name__ == "__main__":
    main()
