"""Exact Qwen tokenizer: HF ``tokenizers`` results, computed by the compiled C core.

Pipeline (the semantics of HF ``tokenizers`` with a Qwen ``tokenizer.json``):

1. split the raw text on the added tokens (leftmost-longest; special or not, before normalization);
2. NFC each remaining segment, with the reference's (older) Unicode normalization tables;
3. split each segment with the Qwen pre-tokenizer regex (``qwen2`` rule, or the ``qwen35`` rule that
   keeps combining marks with letters) -- a hand-written scanner with class tables probed from the
   reference's Oniguruma engine;
4. byte-level BPE of every piece with the vocabulary's merge ranks.

All tables live in ``data/`` and are produced by ``calculator_cython/tools/gen_unicode_tables.py``.
"""
from __future__ import annotations

import array
import json
import os
from pathlib import Path

try:
    from . import _core
    _core.Engine  # noqa: B018  (an old build without the engine must not pass silently)
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "qwen_v3_calculator's compiled core (_core) is missing or outdated; build it with "
        "`pip install -e .` in the repository (or run scripts/setup.sh). There is no pure-Python fallback."
    ) from exc

from .vocab import ADDED_TOKENS, DATA_DIR, FLAVOR_VOCABULARY, VOCABULARIES, flavor_of

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_RULES = {"qwen2": QWEN2_PATTERN, "qwen35": QWEN35_PATTERN}
_RULE_CODE = {"qwen2": 0, "qwen35": 1}
UNICODE_TABLES = os.path.join(DATA_DIR, "unicode_tables.json")


def _init_tables() -> None:
    with open(UNICODE_TABLES, encoding="utf-8") as fh:
        _core.init_unicode_tables(json.load(fh))


_init_tables()


def _byte_decoder() -> dict[str, int]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _rule_from_pretokenizer(pre) -> str:
    """The split rule named by a tokenizer.json ``pre_tokenizer`` (Split regex + byte-level)."""
    splits = []

    def walk(node):
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind == "Sequence":
            for child in node.get("pretokenizers", []):
                walk(child)
        elif kind == "Split":
            splits.append(node)
        elif kind == "ByteLevel":
            if node.get("use_regex", True) or node.get("add_prefix_space", False):
                raise ValueError("unsupported ByteLevel pre-tokenizer options (use_regex/add_prefix_space)")
        else:
            raise ValueError(f"unsupported pre_tokenizer type {kind!r}")

    walk(pre)
    if len(splits) != 1:
        raise ValueError("expected exactly one Split pre-tokenizer with the Qwen regex")
    node = splits[0]
    pattern = node.get("pattern", {}).get("Regex")
    if node.get("behavior") != "Isolated" or node.get("invert"):
        raise ValueError("unsupported Split behaviour (expected Isolated, not inverted)")
    for name, pat in SPLIT_RULES.items():
        if pattern == pat:
            return name
    raise ValueError(f"unknown pre-tokenizer split regex {pattern!r}; supported: Qwen2 and Qwen3.5 rules")


class Tokenizer:
    """Exact Qwen tokenizer (same ids as HF ``tokenizers`` with the model's ``tokenizer.json``)."""

    def __init__(self, engine, added_tokens: dict[str, int], split_rule: str, vocab_size: int,
                 normalizer: str | None = "NFC"):
        if split_rule not in _RULE_CODE:
            raise ValueError(f"unknown split rule {split_rule!r}; expected one of {sorted(_RULE_CODE)}")
        self._engine = engine
        self.split_rule = split_rule
        self.added_tokens = dict(added_tokens)
        self.vocab_size = vocab_size
        self.normalizer = normalizer
        engine.rule = _RULE_CODE[split_rule]
        engine.nfc = normalizer == "NFC"
        engine.set_added_tokens([(c.encode("utf-8"), i) for c, i in self.added_tokens.items()])

    # ------------------------------------------------------------------ constructors
    @classmethod
    def bundled(cls, flavor: str = "qwen3") -> "Tokenizer":
        """A bundled vocabulary with ``flavor``'s added tokens: ``qwen3`` (default), ``qwen2.5`` (both on the Qwen3
        ranks, Qwen2 split rule) or ``qwen3.6`` (Qwen3.5/3.6 ranks and split rule; a model name such as
        ``qwen3.5`` or ``Qwen/Qwen3.6-27B`` picks it too). A build without the Qwen3.6 ranks raises
        ``VocabularyMissing`` for it."""
        if flavor not in ADDED_TOKENS:
            try:
                flavor = flavor_of(flavor)
            except (TypeError, ValueError):
                raise ValueError(f"unknown flavor {flavor!r}; expected one of {sorted(ADDED_TOKENS)}") from None
        vocab = VOCABULARIES[FLAVOR_VOCABULARY[flavor]]
        engine = _bundled_engine(vocab.name).clone()
        added = {c: vocab.num_base + i for i, (c, _special) in enumerate(ADDED_TOKENS[flavor])}
        return cls(engine, added, vocab.split_rule, vocab.num_base + len(added), vocab.normalizer)

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        """From a ``tokenizer.json`` (or a model directory containing one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        with open(p, encoding="utf-8") as fh:
            spec = json.load(fh)
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"{p}: expected a BPE model, got {model.get('type')!r}")
        for key, ok in (("dropout", None), ("unk_token", None), ("continuing_subword_prefix", ""),
                        ("end_of_word_suffix", ""), ("byte_fallback", False), ("ignore_merges", False)):
            val = model.get(key, ok)
            if val != ok and not (key in ("continuing_subword_prefix", "end_of_word_suffix") and val is None):
                raise ValueError(f"{p}: unsupported BPE option {key}={val!r}")
        norm = spec.get("normalizer")
        if not (norm is None or norm.get("type") == "NFC"
                or (norm.get("type") == "Sequence" and [n.get("type") for n in norm["normalizers"]] == ["NFC"])):
            raise ValueError(f"{p}: unsupported normalizer {norm!r} (expected NFC)")
        rule = _rule_from_pretokenizer(spec.get("pre_tokenizer"))
        dec = _byte_decoder()
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
            raise ValueError(f"{p}: unknown BPE vocab format; expected an object of token -> non-negative id")
        size = max(vocab.values()) + 1 if vocab else 0
        tokens: list = [None] * size
        for tok, i in vocab.items():
            tokens[i] = bytes(dec[ch] for ch in tok)
        engine = _core.Engine.from_vocab(tokens, _merge_triples(p, model, vocab))
        added = {}
        for t in spec.get("added_tokens", []):
            if t.get("single_word") or t.get("lstrip") or t.get("rstrip"):
                raise ValueError(f"{p}: added token {t['content']!r} uses unsupported single_word/lstrip/rstrip")
            added[t["content"]] = t["id"]
        vocab_size = max([size, *(i + 1 for i in added.values())])
        return cls(engine, added, rule, vocab_size, None if norm is None else "NFC")

    # ------------------------------------------------------------------ counting
    def encode(self, text: str) -> list[int]:
        return self._engine.encode(text)

    def count(self, text: str) -> int:
        return self._engine.count(text)

    def count_batch(self, texts, threads: int | None = None) -> list[int]:
        """Counts of a sequence of str, in order, on ``threads`` threads (default: the cores this process may
        use); the same results as ``[count(t) for t in texts]``."""
        return self._engine.count_batch(texts, resolve_threads(threads))

    def encode_batch(self, texts, threads: int | None = None) -> list[list[int]]:
        """Ids of a sequence of str, in order (``threads`` as for count_batch)."""
        return self._engine.encode_batch(texts, resolve_threads(threads))

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, split_rule={self.split_rule!r}, "
                f"added_tokens={len(self.added_tokens)})")


def _merge_triples(path, model: dict, vocab: dict) -> array.array:
    """``model["merges"]`` of a tokenizer.json as flat (left id, right id, result id) triples. The two formats HF
    ``tokenizers`` writes are read: ``"left right"`` strings (before 0.20) and ``["left", "right"]`` pairs. Anything
    else is an error naming the file and the entry: a merges list the engine would misread counts wrong silently."""
    merges = model.get("merges")
    if not isinstance(merges, list):
        found = "no merges" if merges is None else f"merges of type {type(merges).__name__}"
        raise ValueError(f"{path}: unknown BPE merges format ({found}); expected a list of \"left right\" strings "
                         f"or [left, right] pairs")
    flat = array.array("i")
    for k, m in enumerate(merges):
        if isinstance(m, str):
            pair = m.split(" ")
        elif isinstance(m, list) and all(isinstance(x, str) for x in m):
            pair = m
        else:
            pair = None
        if pair is None or len(pair) != 2 or not all(pair):
            raise ValueError(f"{path}: unknown BPE merges format at merges[{k}] = {m!r}; expected a \"left right\" "
                             f"string or a [left, right] pair")
        a, b = pair
        for part in (a, b, a + b):
            if part not in vocab:
                raise ValueError(f"{path}: merges[{k}] = {m!r}: token {part!r} is not in the vocabulary")
        flat.extend((vocab[a], vocab[b], vocab[a + b]))
    return flat


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """The container's CPU quota in whole cores, rounded up (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or
    None without one: a pod limited to 2 CPUs on a 64-core node must not start 64 counting threads."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            with open(os.path.join(root, quota_file)) as fh:
                fields = fh.read().split()
            if period_file is not None:
                with open(os.path.join(root, period_file)) as fh:
                    fields = fields[:1] + fh.read().split()[:1]
            quota, period = fields[0], int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        if quota == "max" or int(quota) <= 0 or period <= 0:
            return None
        return max(1, -(-int(quota) // period))
    return None


def resolve_threads(threads: int | None) -> int:
    """``threads`` for the batch calls: None -> the CPU cores this process may run on (its CPU affinity, capped
    by the container's CPU quota)."""
    if threads is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - platforms without sched_getaffinity
            cores = os.cpu_count() or 1
        limit = cgroup_cpu_limit()
        return max(1, min(cores, limit) if limit else cores)
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int or None, not {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return threads


_BUNDLED: dict = {}


def _bundled_engine(name: str = "qwen3"):
    """One engine per bundled vocabulary per process (it is read-only once built).

    Note: an engine carries scratch buffers and a cache. ``count``/``encode`` hold the GIL throughout, so
    CPython threads may share an engine; the batch calls with threads > 1 release it, but run on the
    engine's helper clones (never on the engine itself; they share its piece cache, which is safe for
    concurrent readers and writers) and one batch at a time per engine.
    """
    engine = _BUNDLED.get(name)
    if engine is None:
        with open(VOCABULARIES[name].require(), "rb") as fh:
            engine = _BUNDLED[name] = _core.Engine.from_tiktoken(fh.read())
    return engine


__all__ = ["Tokenizer", "SPLIT_RULES", "QWEN2_PATTERN", "QWEN35_PATTERN"]
