"""Exact in every language users send: the benchmark's language slices and every reachable merge, both vocabularies.

The reference is HF ``tokenizers`` loading the files ``hf_export.write_tokenizer_files`` writes for ``qwen3`` and
``qwen3.6`` (official vocab.json/merges.txt, byte for byte); ours is ``Tokenizer.bundled`` of the same vocabulary.

* the generated language slices (Russian, Arabic, Thai, Hindi, Japanese, Korean, Indonesian, Greek, Vietnamese,
  Hebrew, mixed-language chat; benchmarks/calculator_bench/languages.py) at both benchmark sizes: ids and counts of
  every document identical, 0 documents miscounted;
* merge coverage: every merge line of both merges files whose result token some input can produce is produced by
  HF on some input here, and ours gives the same ids on every one of those inputs. The inputs: each token's own
  text (where its bytes are UTF-8), every scalar value of planes 0-3 alone and after a space, completions of the
  partial-character tokens (their bytes with a leading/trailing character completed), and the language slices. A
  merge whose result never appears must fall into one of the named reasons below, with the recorded counts.
"""
import json
import random
import unicodedata
from collections import Counter

import pytest

import tokenizers

from qwen_v3_calculator import hf_export
from qwen_v3_calculator.tokenizer import Tokenizer

from benchmarks.calculator_bench.common import LANG_SLICES, SEED
from benchmarks.calculator_bench.languages import language_slices

FLAVORS = ("qwen3", "qwen3.6")
# the two sizes the benchmark builds: --quick (0.3 MB, 1500 chat) and the default (4 MB, 10000 chat)
SIZES = {"quick": (40_000, 300), "full": (100_000, 1000)}
# merges whose result token no input here produces, by reason (measured with tokenizers 0.22's tables):
# * not NFC -- the token's text is not NFC (e.g. "ê" + U+0301), and the normalizer runs before BPE;
# * split: ... -- the pre-tokenizer cuts the token's text, so no piece holds it: full-width digit pairs ("１０",
#   "２０": \p{N} one at a time), a letter followed by a combining mark (Thai, Devanagari, ..., CJK + variation
#   selector: the Qwen2 rule of the qwen3 vocabulary keeps \p{M} out of letter runs; the Qwen3.5 rule does not),
#   punctuation before letters ("<unk>", "<s>", "</s", "</s>");
# * partial character -- bytes that are not UTF-8 and that no completion (the token's bytes with the first/last
#   character completed, alone and after a space) produces: prefixes of "珊"+VS17 (a token the Qwen2 rule splits),
#   lead-byte pairs of U+F900-U+F9FF (compatibility ideographs: NFC maps every one away), "ê"/"â"/" cu" + the first
#   byte of a combining mark (NFC composes most; the rest merge elsewhere) and the emoji prefix F0 9F 8D (all
#   32,768 pairs of U+1F300-1F3FF with U+1F340-1F37F merge elsewhere).
# Besides merges: tokens of >= 2 bytes with no merge line (the official merges file has none for them), which
# BPE therefore never produces: 0 in qwen3, 201 in qwen3.6 (the test checks none appears in any output).
REASONS = ("not NFC", "split: digits", "split: combining mark after a letter (Qwen2 rule)",
           "split: punctuation and letters", "partial character")
UNREACHED = {
    "qwen3": {"not NFC": 248, "split: digits": 2, "split: combining mark after a letter (Qwen2 rule)": 1655,
              "split: punctuation and letters": 4, "partial character": 11},
    "qwen3.6": {"split: digits": 2},
}
NO_MERGE = {"qwen3": 0, "qwen3.6": 201}


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    out = {}
    for flavor in FLAVORS:
        d = tmp_path_factory.mktemp(flavor.replace(".", "_"))
        hf_export.write_tokenizer_files(d, flavor, chat_template="x")
        out[flavor] = (d, tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")), Tokenizer.bundled(flavor))
    return out


@pytest.fixture(scope="module")
def slices():
    return {size: language_slices(per, SEED, n) for size, (per, n) in SIZES.items()}


def _ref_ids(ref, texts):
    return [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]


def _miscounted(ref, ours, texts):
    """(documents whose ids differ, documents whose count differs, first difference) -- all three must be 0/None."""
    exp = _ref_ids(ref, texts)
    got = ours.encode_batch(texts)
    counts = ours.count_batch(texts)
    bad = [i for i, (a, b) in enumerate(zip(exp, got)) if a != b]
    badc = [i for i, (a, c) in enumerate(zip(exp, counts)) if len(a) != c]
    first = None
    if bad:
        i = bad[0]
        k = next((j for j, (a, b) in enumerate(zip(got[i], exp[i])) if a != b), min(len(got[i]), len(exp[i])))
        first = (texts[i][:120], k, exp[i][max(0, k - 3):k + 4], got[i][max(0, k - 3):k + 4])
    return bad, badc, first


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("size", SIZES)
def test_language_slices_are_exact(setups, slices, flavor, size):
    _, ref, ours = setups[flavor]
    report = {}
    for name in LANG_SLICES:
        docs = slices[size][name]
        assert docs and all(d.strip() for d in docs), name
        bad, badc, first = _miscounted(ref, ours, docs)
        report[name] = (len(docs), len(bad), len(badc), first)
        # one document at a time, too (the single-text path, GIL held)
        assert [ours.count(d) for d in docs[:20]] == [len(e) for e in _ref_ids(ref, docs[:20])], name
    wrong = {k: v for k, v in report.items() if v[1] or v[2]}
    assert not wrong, f"{flavor}/{size}: documents miscounted (docs, ids differ, counts differ, first): {wrong}"


def test_the_old_capped_merges_words_are_in_the_slices(slices):
    text = "".join(d for name in LANG_SLICES for d in slices["full"][name])
    for w in ("являются", "элементов", "появляется", "المصري", "نسبة", "أخرى", "melanjutkan", "いっぱい", "人力资源"):
        assert w in text, w


# ---------------------------------------------------------------------------------------------------
def _is_digit(c: str) -> bool:
    return unicodedata.category(c).startswith("N")


def _completions(b: bytes, rng: random.Random, cap: int = 600) -> list[str]:
    """Texts containing b: its leading continuation bytes given a lead byte, its trailing partial character
    completed (all first continuation bytes, a seeded sample of the rest), the ones that are valid UTF-8."""
    lead = 0
    while lead < len(b) and 0x80 <= b[lead] < 0xC0:
        lead += 1
    tail = len(b)
    need = 0
    for j in range(len(b) - 1, max(-1, len(b) - 4), -1):
        if b[j] >= 0xC0:
            n = 2 if b[j] < 0xE0 else 3 if b[j] < 0xF0 else 4
            if len(b) - j < n:
                tail, need = j, n - (len(b) - j)
            break
    conts = range(0x80, 0xC0)
    if lead == 0:
        pres = [b""]
    elif lead == 1:
        pres = [bytes([x]) for x in range(0xC2, 0xE0)] + [bytes([x, y]) for x in range(0xE0, 0xF0) for y in conts]
    elif lead == 2:
        pres = [bytes([x]) for x in range(0xE0, 0xF0)] + [bytes([x, y]) for x in range(0xF0, 0xF5) for y in conts]
    else:
        pres = [bytes([x]) for x in range(0xF0, 0xF5)]
    if need == 0:
        sufs = [b""]
    else:
        sufs = [bytes([x] + [rng.randrange(0x80, 0xC0) for _ in range(need - 1)]) for x in conts for _ in range(4)]
    out = set()
    for p in pres:
        for s in sufs:
            try:
                out.add((p + b + s).decode("utf-8"))
            except UnicodeDecodeError:
                pass
    out = sorted(out)
    return out if len(out) <= cap else rng.sample(out, cap)


def _reason(b: bytes, ref) -> str:
    try:
        t = b.decode("utf-8")
    except UnicodeDecodeError:
        return "partial character"
    if ref.normalizer.normalize_str(t) != t:
        return "not NFC"
    pieces = [p for p, _ in ref.pre_tokenizer.pre_tokenize_str(t)]
    if len(pieces) > 1:
        if any(_is_digit(a) and _is_digit(c) for a, c in zip(t, t[1:])):
            return "split: digits"
        if any(unicodedata.category(c).startswith("M") for c in t):
            return "split: combining mark after a letter (Qwen2 rule)"
        return "split: punctuation and letters" if any(unicodedata.category(c).startswith("L") for c in t) \
            else "split: other"
    return "BPE of its own text ends elsewhere"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_reachable_merge_is_exercised(setups, slices, flavor):
    d, ref, ours = setups[flavor]
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    byte_of = {c: b for b, c in hf_export.bytes_to_unicode().items()}
    token_bytes = {i: bytes(byte_of[c] for c in s) for s, i in vocab.items()}
    lines = (d / "merges.txt").read_text(encoding="utf-8").split("\n")
    merges = [ln.split(" ") for ln in lines if ln and not ln.startswith("#version")]
    results = {vocab[a + b] for a, b in merges}
    assert len(results) == len(merges)
    added = set(ours.added_tokens.values())  # vocab.json holds none of them; kept out in case it ever does

    texts, partial = [], []
    for i, b in token_bytes.items():
        try:
            texts.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            partial.append(i)
    chars = [chr(c) for c in range(0x40000) if not 0xD800 <= c < 0xE000]
    texts += chars + [" " + c for c in chars]
    texts += [doc for name in LANG_SLICES for doc in slices["full"][name]]
    seen: set[int] = set()

    def run(batch):
        exp = _ref_ids(ref, batch)
        got = ours.encode_batch(batch)
        bad = [t for t, a, b in zip(batch, exp, got) if a != b]
        assert not bad, f"{flavor}: {len(bad)} of {len(batch)} inputs differ, e.g. {bad[:3]!r}"
        for ids in exp:
            seen.update(ids)

    run(texts)
    rng = random.Random(SEED)
    missing_partial = [i for i in partial if i in results and i not in seen]
    run([t for i in missing_partial for t in _completions(token_bytes[i], rng)])

    no_merge = [i for i, b in token_bytes.items() if len(b) >= 2 and i not in results and i not in added]
    assert len(no_merge) == NO_MERGE[flavor] and not set(no_merge) & seen, (flavor, len(no_merge))
    unreached = [r for r in sorted(results) if r not in seen]
    by_reason = Counter(_reason(token_bytes[r], ref) for r in unreached)
    examples = {}
    for r in unreached:
        examples.setdefault(_reason(token_bytes[r], ref), []).append(token_bytes[r])
    summary = {k: (by_reason[k], examples[k][:12]) for k in by_reason}
    print(f"\n{flavor}: {len(merges)} merges, {len(merges) - len(unreached)} exercised, unreached {summary}")
    assert set(by_reason) <= set(REASONS), f"{flavor}: unreached merges without a named reason: {summary}"
    assert dict(by_reason) == {k: v for k, v in UNREACHED[flavor].items() if v}, (
        f"{flavor}: unreached by reason {dict(by_reason)}; e.g. {summary}")
