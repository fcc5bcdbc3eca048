"""qwen_v3_calculator.tokenizer: ids identical to the reference (HF ``tokenizers``), zero tolerance.

The reference is HF ``tokenizers`` loading the generated (byte-identical official) Qwen3 tokenizer.json;
for the Qwen3.5 split rule, a copy of it with the Qwen3.5 pre-tokenizer regex; for the bundled Qwen3.5/3.6
vocabulary (``qwen36``), the tokenizer.json ``hf_export`` writes for it (its ranks, derived merges, split rule).
"""
import json
import random
import re
import unicodedata

import pytest

import tokenizers

from qwen_v3_calculator import hf_export
from qwen_v3_calculator.vocab import NUM_BASE_TOKENS
from qwen_v3_calculator.tokenizer import QWEN35_PATTERN, Tokenizer

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
SCALARS = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
# planes with assigned characters get the full context template; the others (unassigned / private use)
# a shorter one, so that every scalar value is checked and the file stays well under a minute
FULL_PLANES = {"qwen2": {0, 1, 2, 3, 14}, "qwen35": {0, 1, 14}, "qwen36": {0, 1, 14}}


def full_context(c: str) -> str:
    return f"a{c}b {c}x {c}{c} 1{c}2 '{c}\n{c} \n"


def short_context(c: str) -> str:
    return f"a{c}{c} {c}\n"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_exact")
    hf_export.write_tokenizer_files(out, "qwen3", chat_template="x")
    return out


@pytest.fixture(scope="module")
def qwen35_dir(qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen35_rule")
    spec = json.loads((qwen3_dir / "tokenizer.json").read_text(encoding="utf-8"))
    split = spec["pre_tokenizer"]["pretokenizers"][0]
    assert split["type"] == "Split"
    split["pattern"]["Regex"] = QWEN35_PATTERN
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def qwen35_raw_dir(qwen35_dir, tmp_path_factory):
    """Qwen3.5 rule without a normalizer (as Qwen3.5's own tokenizer.json: llama.cpp's vectors expect it)."""
    out = tmp_path_factory.mktemp("qwen35_raw")
    spec = json.loads((qwen35_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = None
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def qwen36_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen36")
    hf_export.write_tokenizer_files(out, "qwen3.6", chat_template="x")
    return out


@pytest.fixture(scope="module")
def pairs(qwen3_dir, qwen35_dir, qwen35_raw_dir, qwen36_dir):
    """rule -> (reference, ours) ; 'bundled' is Tokenizer.bundled() against the qwen3 reference."""
    def ref(d):
        return tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))

    ref2 = ref(qwen3_dir)
    return {
        "qwen2": (ref2, Tokenizer.from_file(qwen3_dir / "tokenizer.json")),
        "bundled": (ref2, Tokenizer.bundled("qwen3")),
        "qwen35": (ref(qwen35_dir), Tokenizer.from_file(qwen35_dir)),
        "qwen35-raw": (ref(qwen35_raw_dir), Tokenizer.from_file(qwen35_raw_dir)),
        "qwen36": (ref(qwen36_dir), Tokenizer.bundled("qwen3.6")),
    }


def _ref_ids(ref, texts):
    enc = getattr(ref, "encode_batch_fast", ref.encode_batch)
    return [e.ids for e in enc(texts, add_special_tokens=False)]


def assert_same(pair, texts):
    ref, ours = pair
    expected = _ref_ids(ref, texts)
    for text, exp in zip(texts, expected):
        got = ours.encode(text)
        if got != exp:
            k = next((i for i, (a, b) in enumerate(zip(got, exp)) if a != b), min(len(got), len(exp)))
            pytest.fail(f"mismatch on {text[:120]!r} (len {len(text)}) at token {k}: "
                        f"expected {exp[max(0, k - 3):k + 4]} got {got[max(0, k - 3):k + 4]}")
    # the batch calls, on this process's cores and in the calling thread, give the same (they share one engine)
    assert ours.count_batch(texts) == [len(e) for e in expected] == ours.count_batch(texts, threads=1)
    assert ours.encode_batch(texts) == expected


def chunks(cps, make, size=256):
    return ["".join(make(chr(c)) for c in cps[i:i + size]) for i in range(0, len(cps), size)]


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "qwen36"])
def test_every_scalar_value_in_context(pairs, rule):
    full = [c for c in SCALARS if c >> 16 in FULL_PLANES[rule]]
    short = [c for c in SCALARS if c >> 16 not in FULL_PLANES[rule]]
    assert_same(pairs[rule], chunks(full, full_context) + chunks(short, short_context, 1024))


def test_bundled_matches_reference_on_bmp(pairs):
    cps = [c for c in SCALARS if c < 0x10000]
    assert_same(pairs["bundled"], chunks(cps, full_context))


NON_NFC = [
    "e\u0301", "E\u0301\u0323", "a\u0323\u0301", "a\u0301\u0323", "\u1e0b\u0323", "\u0071\u0307\u0323",
    "\u212b", "\u2126 ohm", "\u0344", "\u0958\u093c", "\u1100\u1161\u11a8", "\uac00\u11a8", "\u1100\u1161",
    "\u0b47\u0b3e", "\u0dd9\u0dcf\u0dca", "\u00c5\u0301", "A\u030a", "a\u1df6\u0301", "a\u0301\u1df6",
    "\U00011935\U00011930", "\U00011938", "\u0041\u0300\u0300\u0315\u0301", "\u05d0\u05b7\u05bc",
    "x" + "\u0301\u0316" * 40, "\u0301" * 50 + "abc", "Ω\u0313\u0342\u0345", "\u1f00\u0345",
    "\u0626\u0654", "\u30ab\u3099", "\u304b\u3099\u309a", "\uff76\uff9e", "\u2000\u2001", "\u0340\u0341",
    "\u0f73\u0f75\u0f81", "\u1026\u1031\u102e", "\u0cc6\u0cc2\u0cd5",
]


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen35-raw", "qwen36"])
def test_non_nfc_sequences(pairs, rule):
    texts = NON_NFC + [" " + t for t in NON_NFC] + ["x" + t + "y" for t in NON_NFC]
    texts += [unicodedata.normalize("NFD", t) for t in ("Crème brûlée à la façon de Zoë", "Ελληνικά ἄνθρωπος",
                                                        "한국어 텍스트입니다", "Tiếng Việt có dấu")]
    assert_same(pairs[rule], texts)


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen35-raw", "qwen36"])
def test_non_nfc_chunks_inside_long_text(pairs, rule):
    """Only the chunks around characters that are not NFC-safe are normalized, the text between them copied:
    several chunks per text, adjacent ones, one safe character apart, at the start and the end, after ASCII,
    Latin-1, CJK and emoji neighbours (the safe character before an unsafe run may combine with it)."""
    rng = random.Random(7)
    safe = ["Plain text ", "中文内容", "é", "x", " ", "🙂", "\n", "abc def ", "ü", "한", "\uac00", "\u30ab", "1"]
    texts = []
    for t in NON_NFC:
        for left in safe:
            texts += [left + t, left + t + left, t + left, left * 3 + t + t + left * 2, left + t + "x" + t]
    for _ in range(300):
        parts = [rng.choice(safe) * rng.randint(0, 40) if rng.random() < 0.6 else rng.choice(NON_NFC)
                 for _ in range(rng.randint(1, 12))]
        texts.append("".join(parts))
    texts.append("中文" * 5000 + "\uf997" + "文字" * 5000 + "e\u0301" + "end")
    assert_same(pairs[rule], texts)


# marks of every combining class that compose with nothing (NFC_QC=Yes): Thai tone marks and vowels, Devanagari
# nukta and virama, Arabic harakat, Hebrew points, Latin combining marks below and above, a supplementary one
ORDERED_MARKS = ["\u0e48", "\u0e49", "\u0e38", "\u0e39", "\u0e3a", "\u093c", "\u094d", "\u064b", "\u064e",
                 "\u0650", "\u0651", "\u0652", "\u05b0", "\u05b4", "\u05bc", "\u05c1", "\u0316", "\u0317",
                 "\u031b", "\u0334", "\u0346", "\u0359", "\u035c", "\u1dc0", "\U0001e8d0", "\U00011c3f"]
MARK_STARTERS = ["a", "\u00e9", "\u0e01", "\u0e2a", "\u0915", "\u0628", "\u05d0", "\uac00", "\u1100", "\u4e2d",
                 " ", "\U0001f642", "<|im_start|>", "<|endoftext|>"]


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen35-raw", "qwen36"])
def test_marks_in_and_out_of_canonical_order(pairs, rule):
    """A mark that is not NFC-safe only for its combining class (NFC_QC=Yes) is left alone when it follows a
    character of a class not above its own (UAX #15's quick check: such a text is already NFC), and normalized
    with what precedes it when it is out of order. Every pair of such marks in both orders after every kind of
    starter (Latin, precomposed, Thai, Devanagari, Arabic, Hebrew, Hangul syllable and jamo, CJK, space, emoji, an
    added token), runs of them before and after characters that do compose (QC=Maybe: U+0301, U+0323, U+3099, a
    Hangul vowel jamo) or decompose, in strings of one, two and four bytes per character: HF's ids."""
    rng = random.Random(5)
    texts = []
    for m1 in ORDERED_MARKS:
        for m2 in ORDERED_MARKS:
            texts.append(rng.choice(MARK_STARTERS) + m1 + m2 + rng.choice(ORDERED_MARKS))
    for st in MARK_STARTERS:
        for m in ORDERED_MARKS:
            texts += [st + m, st + m + "\u0301", st + "\u0301" + m, st + m + "\u0323" + m, "e\u0301" + m + st,
                      st + m * 3 + "\u0316\u0301", st + m + "\u1161", st + m + "\u3099", m + st + m, st + m + "\u212b"]
    pool = ORDERED_MARKS * 3 + MARK_STARTERS + NON_NFC + ["Plain ", "中文", "ก", "\u0e33", "\u0e31", "\u0e40"]
    for _ in range(600):
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 30))))
    texts += ["สวัสดี" + m + "ครับ" for m in ORDERED_MARKS] + ["\u0e01\u0e49\u0e38", "\u0e01\u0e38\u0e49"]
    assert_same(pairs[rule], texts)


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen36"])
def test_added_tokens_glued_to_marks_and_text(pairs, rule):
    toks = list(hf_export.ADDED_TOKENS["qwen3"])
    texts = []
    for content, _ in toks:
        texts += [content, "a" + content + "\u0301", "\u0301" + content, content + "\u0301b", "e" + content + "\u0301",
                  content + content, " " + content + " ", "\n" + content + "\n\n", content[:-1], content[1:],
                  "x" + content[:-1] + content, "\u00e9" + content + "'s", content + "'S"]
    texts += ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
              "<|im_start|<|im_end|>", "<<|endoftext|>>", "<tool_call><tool_call>", "</think></think>x"]
    assert_same(pairs[rule], texts)


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen36"])
def test_whitespace_digits_contractions(pairs, rule):
    ws = [" ", "  ", "\t", "\t ", " \t", "\u00a0", " \u00a0", "\u00a0 ", "\u3000", "\n", "\r\n", " \n ", "\u2028",
          "\u0085", "\x0b", "\x0c", "\u1680", "\u202f", "\u205f", "\u180e", "\u200b"]
    texts = []
    for w in ws:
        for w2 in ws[:8]:
            texts += [f"a{w}{w2}", f"a{w}{w2}b", f"{w}{w2}", f"x\t{w}{w2}", f"x\u00a0{w}{w2}", f"{w}\n{w2}x",
                      f"1{w}{w2}2", f"!{w}{w2}"]
    nums = "0123456789\u0660\u0661\u06f5\u0966\u09e7\u0e51\uff11\u2460\u00b2\u00bd\u216b\u3007\u4e00\U0001d7ce"
    for d in nums:
        texts += [f" {d}", f"  {d}", f"a {d}{d}{d}", f"{d} {d}", f"\t{d}", f"x{d}y", f" {d}x", f"'{d}"]
    for c in ("s", "t", "re", "ve", "m", "ll", "d"):
        for v in {c, c.upper(), c.capitalize(), c[0].upper() + c[1:]}:
            texts += [f"it'{v}", f"it'{v}x", f"'{v}", f" '{v}", f"x '{v} y", f"''{v}", f"'{v}'{v}", f"1'{v}"]
    texts += ["it\u2019s", "'\u017f", "'\u017ft", "I'M", "we'Ll", "'LL", "'lL", "'Re", "'rE", "'VE", "'D",
              "'\u212a", "'", "''", "' ", "'\n"]
    assert_same(pairs[rule], texts)


def test_ascii_letter_step_agrees_with_the_letter_class_for_every_byte():
    """The 8-byte step returns the run of [A-Za-z] at the start, or the last whole 8-byte window it checked."""
    from qwen_v3_calculator import _core

    for v in range(256):
        for k in range(18):
            for tail in (0, 1, 7, 8, 20):
                data = b"qZ" * 9
                data = data[:k] + bytes([v]) + b"mK" * tail
                run = len(re.match(rb"[A-Za-z]*", data).group())
                assert _core._ascii_letter_run(data) == min(run, len(data) - len(data) % 8), (v, k, tail)


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen36"])
def test_ascii_letter_runs_at_every_length_and_boundary(pairs, rule):
    """The scanner reads runs of ASCII letters eight bytes at a time: every run length around the 8-byte steps,
    ended by every ASCII byte (the range edges '@' '[' '`' '{' among them), by non-ASCII letters, marks and
    digits, at the end of the text, with and without a leading space; counting mode (count_batch in assert_same)
    also takes one-byte pieces without the piece queue."""
    enders = [chr(b) for b in range(128)] + ["\u00e9", "\u0301", "\u4e2d", "\u0660", "\u00a0", "\U0001f642", ""]
    texts = []
    for n in (1, 2, 7, 8, 9, 15, 16, 17, 24, 25):
        word = "".join("abcXYZqwertyMNOpz"[(i * 5) % 17] for i in range(n))
        # ended inside an 8-byte window (text follows) and at the end of the text
        texts += [f"{word}{e}" for e in enders] + [f" {word}{e}x{e}yz{e} and more" for e in enders]
    texts += ["a" * 33 + "\u00e9" + "b" * 9 + "1", "Zz" * 20 + "@[`{" * 3, "x\u00e9" * 40, "@" * 17 + "a" * 17]
    assert_same(pairs[rule], texts)


ASCII_EDGE = (list("aAsStTmMdDrReEvVlLqz") + list("0179") + [" "] * 6 + ["\t", "\n", "\r", "\x0b", "\x0c"]
              + list("'.,!-_(\"#@[`{") + ["\x00", "\x1c", "\x7f"])
ASCII_WORDS = ["it's", "we'll", "they're", "I'M", "'s", " 's", "''s", "x'Ve", "'LL", "'lL", "'d", "'r", "'v", "'l",
               "  \n\n ", "\t\t", "...", " ...", "abc", "12", " \n", "\r\n", ".\n\n", " .\n", ". \n", "\n .x",
               "  x", " \t.", "\t'", " '", "x.y", "x..y", " .y", "   ", "\n", "word"]


def _ascii_edge_texts(seed: int, count: int) -> list[str]:
    """ASCII texts dense in what splits them (contractions, lone and runs of punctuation, whitespace of every
    kind before letters, digits and punctuation), of lengths around the 64-byte window of the ASCII splitter,
    some cut by a non-ASCII character, some ASCII stretches of 1 to 39 bytes between non-ASCII words."""
    rng = random.Random(seed)
    lengths = (1, 2, 3, 8, 31, 62, 63, 64, 65, 66, 127, 128, 129, 200)
    out = []
    for k in range(count):
        n = lengths[k % len(lengths)]
        if k % 3 == 0:
            t = ""
            while len(t) < n:
                t += rng.choice(ASCII_WORDS + [" ", "a", "7", "'"])
            t = t[:n]
        else:
            t = "".join(rng.choice(ASCII_EDGE) for _ in range(n))
        if k % 7 == 6:      # ASCII stretches of every length between non-ASCII words: where the window starts again
            t = "".join(rng.choice(["\u0441\u043b\u043e\u0432\u043e", " \u4e2d\u6587", "\u00e9t\u00e9", "\U0001f642"])
                        + t[:rng.randrange(1, 40)] for _ in range(4))
        elif k % 5 == 4:
            at = rng.randrange(len(t) + 1)
            t = t[:at] + rng.choice(["\u00e9", "\u4e2d", "\U0001f642", "\u00a0", "\u0301", "\u2028"]) + t[at:]
        out.append(t)
    return out


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen36"])
def test_ascii_window_against_the_reference(pairs, rule):
    """ASCII text is split 64 bytes at a time from bit masks (qv3_ascii_pieces): every rule of the pattern at
    and around the window's edges, against the reference."""
    assert pairs[rule][1]._engine.fast_ascii
    assert_same(pairs[rule], _ascii_edge_texts(46, 3000))


@pytest.mark.parametrize("portable", [False, True])
def test_ascii_window_splits_like_the_byte_scanner(pairs, portable):
    """The same texts, many more of them, through one engine with the ASCII window and a clone without it; also
    with the window's portable loops (what a CPU without SSE2 runs)."""
    from qwen_v3_calculator import _core

    fast = pairs["qwen36"][1]._engine
    slow = fast.clone()
    slow.fast_ascii = False
    assert fast.fast_ascii and fast.clone().fast_ascii
    old = _core._portable_ascii(portable)
    try:
        for text in _ascii_edge_texts(51 + portable, 30000):
            ids = slow.encode(text)
            assert fast.encode(text) == ids and fast.count(text) == len(ids), repr(text)
    finally:
        _core._portable_ascii(old)


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen36"])
def test_long_single_pretokens(pairs, rule):
    n = 200_000
    texts = ["a" * n, " " + "b" * n, "中" * (n // 3), "!" * n, " " * n, " " * n + "x", "\n" * n, "1" * (n // 10),
             "ab" * (n // 2), "\u00e9" * (n // 2), "e" + "\u0301" * (n // 2), "x" + "\u0316\u0301" * (n // 4),
             "🙂" * (n // 4), "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(n // 3))]
    assert_same(pairs[rule], texts)


def _random_mix(seed: int, count: int):
    rnd = random.Random(seed)
    words = ["the", "The", "tokenizer", "counts", "exactly", "naïve", "café", "Straße", "don't", "WE'LL", "it's",
             "привет", "мир", "γλώσσα", "שלום", "مرحبا", "हिन्दी", "ภาษาไทย", "한국어", "日本語の", "テキスト"]
    code = ["def f(x):\n    return x**2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
            "if __name__ == '__main__':\r\n    main()\r\n", "const s = `${a}+${b}`;  // ok\n",
            "<div class=\"x\">&nbsp;</div>", "SELECT * FROM t WHERE id=42;", "x = [1,2,3]\n\n\n"]
    emoji = ["🙂", "👍🏽", "👨‍👩‍👧‍👦", "🇨🇳", "🏳️‍🌈", "❤️", "✈︎", "🤖", "1️⃣", "\U0001f3f4\U000e0067\U000e0062\U000e0073"
             "\U000e0063\U000e0074\U000e007f"]
    ws = [" ", "  ", "\t", "\n", "\r\n", "\n\n", " \n", "\u00a0", "\u3000", "   \n\t "]
    added = [c for c, _ in hf_export.ADDED_TOKENS["qwen3"]]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rnd.randint(1, 60)):
            kind = rnd.random()
            if kind < 0.25:
                parts.append("".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(rnd.randint(1, 12))))
            elif kind < 0.5:
                parts.append(rnd.choice(words))
            elif kind < 0.6:
                parts.append(rnd.choice(code))
            elif kind < 0.7:
                parts.append(rnd.choice(emoji))
            elif kind < 0.85:
                parts.append(rnd.choice(ws))
            elif kind < 0.9:
                parts.append(str(rnd.randint(0, 10 ** rnd.randint(1, 8))))
            elif kind < 0.93:
                parts.append(rnd.choice(added))
            elif kind < 0.96:
                parts.append(rnd.choice("，。！？、：；“”‘’（）《》…—-_=+*/\\|@#$%^&~`'\""))
            else:
                parts.append(chr(rnd.choice([rnd.randint(0x20, 0x2FF), rnd.randint(0x300, 0x36F),
                                             rnd.randint(0x1100, 0x11FF), rnd.randint(0xAC00, 0xD7A3)])))
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen35-raw", "qwen36"])
def test_seeded_random_mix(pairs, rule):
    assert_same(pairs[rule], _random_mix(20240611, 1500))


def _llama_vectors(name):
    from qwen_vllm_ext.common import assets

    inp, out = assets.test_vector_paths(name)  # fetched by scripts/setup.sh; a failure here is a setup bug
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    ids = [[int(x) for x in line.split()] for line in out.read_text(encoding="utf-8").split("\n")]
    ids = ids[:len(texts)]
    assert len(texts) == len(ids) and len(texts) > 20
    return texts, ids


@pytest.mark.parametrize("name,rule", [("qwen2", "qwen2"), ("qwen2", "bundled"), ("qwen35", "qwen35-raw")])
def test_llama_cpp_vectors(pairs, name, rule):
    texts, ids = _llama_vectors(name)
    ours = pairs[rule][1]
    assert [ours.encode(t) for t in texts] == ids
    assert_same(pairs[rule], texts)


# ---------------------------------------------------------------------------------------------------
def test_interface(pairs, qwen3_dir):
    tok = Tokenizer.bundled()
    assert tok.split_rule == "qwen2" and pairs["qwen35"][1].split_rule == "qwen35"
    assert tok.vocab_size == NUM_BASE_TOKENS + 26 == pairs["qwen2"][1].vocab_size
    assert tok.added_tokens["<|im_end|>"] == 151645 and tok.added_tokens["</think>"] == 151668
    assert pairs["qwen2"][1].added_tokens == tok.added_tokens
    q25 = Tokenizer.bundled("qwen2.5")
    assert len(q25.added_tokens) == 22 and q25.encode("<think>") != [151667]
    assert tok.encode("<think>") == [151667]  # flavors share the vocabulary, not their added tokens
    assert pairs["qwen35-raw"][1].normalizer is None and tok.normalizer == "NFC"
    assert tok.encode("") == [] and tok.count("") == 0 and tok.count_batch([]) == []
    assert tok.count("hello world") == 2 == len(tok.encode("hello world"))
    assert tok.count_batch(["a", "", "<|im_end|>"]) == [1, 0, 1]
    with pytest.raises(ValueError):
        Tokenizer.bundled("qwen9")


def test_type_errors():
    tok = Tokenizer.bundled()
    for bad in (b"abc", None, 3, ["a"]):
        with pytest.raises(TypeError, match="text"):
            tok.encode(bad)
        with pytest.raises(TypeError, match="text"):
            tok.count(bad)
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        tok.count_batch(["ok", b"no"])
    with pytest.raises(TypeError, match="texts"):
        tok.count_batch("a string")


def test_lone_surrogates_raise_clear_value_error(pairs):
    tok = Tokenizer.bundled()
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("ab\ud800cd")
    with pytest.raises(ValueError, match="surrogate"):
        tok.count("\udfff")
    with pytest.raises(Exception):  # the reference rejects them too
        pairs["qwen2"][0].encode("ab\ud800cd")
    assert tok.encode("ok") == pairs["qwen2"][0].encode("ok").ids  # still usable afterwards


def test_unknown_split_regex_rejected(qwen3_dir, tmp_path):
    spec = json.loads((qwen3_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="regex"):
        Tokenizer.from_file(tmp_path)


def test_merged_tokens_encode_to_themselves(qwen3_dir, pairs):
    """The bundled engine derives its merges itself: every vocabulary token's text must round-trip."""
    ref, tok = pairs["bundled"]
    words = [ref.decode([i]) for i in range(256, NUM_BASE_TOKENS, 37)]
    assert_same((ref, tok), [w for w in words if w and "\ufffd" not in w])


# ---------------------------------------------------------------------------------------------------
# The engine's fast path: multi-byte characters may enter the merge loop as their own token (Engine
# premerge, proven safe per character and per neighbour at load time). Zero tolerance against the reference
# and against the plain byte-level merge loop of the same engine.
def _neighbours(kind, raw, pool):
    if kind == 0:
        return [raw.decode("utf-8")]
    if kind == 1:
        return [c for c, b in pool if b.endswith(raw) and len(b) > len(raw)]
    return [c for c, b in pool if b.startswith(raw) and len(b) > len(raw)]


def _premerge_texts(tok, seed, per_neighbour=2):
    """Every character that may start as its own token: alone, doubled, in letter runs, after a space, and
    next to (samples of) every neighbour its risk list names, as in a piece and across pieces."""
    rnd = random.Random(seed)
    table = tok._engine.premerge_table()
    pool = [(chr(c), chr(c).encode()) for c in range(0x80, 0x30000) if not 0xD800 <= c < 0xE000]
    chars = [chr(c) for c in table]
    memo = {}
    texts = []
    for cp, (_tok, left, right) in table.items():
        c = chr(cp)
        parts = [c, c + c, f"a{c}b", f" {c}", f"{c} ", f"x{c * 3}", rnd.choice(chars) + c + rnd.choice(chars)]
        for side, risks in (("L", left), ("R", right)):
            for kind, raw in risks:
                key = (kind, raw)
                if key not in memo:
                    memo[key] = _neighbours(kind, raw, pool)
                for x in rnd.sample(memo[key], min(per_neighbour, len(memo[key]))):
                    parts += [x + c, c + x, x + c + x, "中" + (x + c if side == "L" else c + x) + "文"]
        texts.append("|".join(parts))
    return texts, chars, memo


@pytest.mark.parametrize("rule", ["bundled", "qwen35", "qwen36"])
def test_premerged_characters_with_their_risky_neighbours(pairs, rule):
    tok = pairs[rule][1]
    stats = tok._engine.premerge_stats()
    assert stats[0] > (8_000 if rule == "qwen36" else 10_000)  # the fast path is in use for most CJK characters
    texts, _, _ = _premerge_texts(tok, 7)
    # joined in batches of 16 characters' texts, so that the reference sees a few thousand documents
    docs = ["\n".join(texts[i:i + 16]) for i in range(0, len(texts), 16)]
    assert_same(pairs[rule], docs)


def test_merge_loops_with_and_without_the_rank_to_token_table(pairs, qwen36_dir):
    """Where every merge's rank is the id of the token it makes (the bundled tiktoken vocabularies), BPE does not read
    the rank -> token table (Engine.mident); where it is not (a tokenizer.json whose merges are numbered apart from
    the ids, including the official Qwen3.5/3.6 merges), it does. Both give HF's ids on text that merges a lot
    (long Thai, Japanese and English words, a 5,000-character run the heap merge loop takes)."""
    texts = ["ภาษาไทยเป็นภาษาที่มีความซับซ้อน" * 3, "日本語のテキストを処理する", " internationalization",
             "supercalifragilisticexpialidocious", "x" * 41 + "ab" * 7, "ก" * 5000, "人力资源和社会保障部发布通知"]
    assert pairs["bundled"][1]._engine.mident and pairs["qwen36"][1]._engine.mident
    official = Tokenizer.from_file(qwen36_dir)
    assert not pairs["qwen2"][1]._engine.mident and not official._engine.mident
    for rule in ("bundled", "qwen36", "qwen2", "qwen35"):
        assert_same(pairs[rule], texts)
    assert_same((pairs["qwen36"][0], official), texts)


def test_premerge_equals_byte_level_merge_loop():
    fast, plain = Tokenizer.bundled(), Tokenizer.bundled()
    plain._engine.premerge = False
    texts, chars, memo = _premerge_texts(fast, 11, per_neighbour=4)
    rnd = random.Random(5)
    neighbours = [x for xs in memo.values() for x in xs[:40]]
    for _ in range(4000):   # runs of premerged characters and their risky neighbours, several lengths
        n = rnd.choice([2, 3, 5, 8, 11, 23, 33, 64, 300])
        texts.append("".join(rnd.choice(chars) if rnd.random() < 0.85 else rnd.choice(neighbours)
                             for _ in range(n)))
    for t in texts:
        assert fast.encode(t) == plain.encode(t), t
        assert fast.count(t) == plain.count(t)


@pytest.mark.parametrize("rule", ["bundled", "qwen35", "qwen36"])
def test_every_multibyte_char_in_runs(pairs, rule):
    """Every 2-, 3- and 4-byte scalar value (planes 0-2 and 14) in letter-like runs of several lengths:
    consecutive code points, so each meets its neighbours in the code chart."""
    cps = [c for c in SCALARS if c >= 0x80 and (c < 0x30000 or 0xE0000 <= c < 0xF0000)]
    texts = []
    for run in (2, 3, 7, 12, 40):
        group = [cps[i:i + run] for i in range(0, len(cps), run)]
        texts += [" ".join("".join(map(chr, g)) for g in group[i:i + 64]) for i in range(0, len(group), 64)]
    assert_same(pairs[rule], texts)


@pytest.mark.parametrize("rule", ["bundled", "qwen35", "qwen36"])
def test_cjk_heavy_random_text(pairs, rule):
    rnd = random.Random(20250611)
    table = pairs[rule][1]._engine.premerge_table()
    common = [chr(c) for c in table if 0x4E00 <= c <= 0x9FFF]
    rare = [chr(c) for c in range(0x3400, 0xA000) if chr(c) not in table]
    other = list("，。！？、：；“”（）《》 \n\t0123456789abcXYZ-_") + ["\u3000", "ー", "の", "한", "é", "😀"]
    docs = []
    for _ in range(600):
        parts = []
        for _ in range(rnd.randint(1, 40)):
            n = rnd.choice([1, 2, 3, 4, 6, 9, 16, 30, 48, 120])
            parts.append("".join(rnd.choice(common) if rnd.random() < 0.9 else rnd.choice(rare)
                                 for _ in range(n)))
            parts.append(rnd.choice(other) if rnd.random() < 0.8 else rnd.choice(other) * rnd.randint(2, 4))
        docs.append("".join(parts))
    assert_same(pairs[rule], docs)


def test_qwen36_on_the_llama_cpp_qwen35_vectors(pairs):
    """llama.cpp's qwen35 vectors carry Qwen2-vocabulary ids (they test the split rule, above); their texts are
    checked here against the reference with the Qwen3.5/3.6 vocabulary."""
    texts, _ = _llama_vectors("qwen35")
    assert_same(pairs["qwen36"], texts)


def test_qwen36_tokens_encode_to_themselves_except_the_unmerged(pairs):
    """Every Qwen3.5/3.6 token's text round-trips, but for the tokens no merge of two lower ranks makes: HF never
    produces those from text (its merges lack them), and neither does the calculator."""
    ref, tok = pairs["qwen36"]
    unmerged = []
    hf_export.derive_merges(hf_export.vocabulary_ranks("qwen3.6"), unmerged)
    assert tok._engine.unmerged == len(unmerged) > 0
    words = [ref.decode([i]) for i in range(256, 248044, 41)] + [ref.decode([r]) for r, _ in unmerged]
    words = [w for w in words if w and "\ufffd" not in w]
    assert_same((ref, tok), words)
    for rank, raw in unmerged:
        text = raw.decode("utf-8", errors="strict") if raw.decode("utf-8", "replace") == raw.decode("utf-8", "ignore") else None
        if text:
            assert tok.encode(text) != [rank] and len(tok.encode(text)) > 1


LONG_RUN_SCRIPTS = [(0x0E00, 0x0E7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0x0400, 0x04FF), (0x61, 0x7A)]


@pytest.fixture(scope="module")
def script_tokens(pairs):
    """vocabulary size -> per LONG_RUN_SCRIPTS range, the texts of (up to 3,000) tokens made only of its
    characters: what long runs of the script are built of."""
    inverse = {c: b for b, c in hf_export.bytes_to_unicode().items()}
    out = {}
    for ref, _ in pairs.values():
        vocab = ref.get_vocab()
        if len(vocab) in out:
            continue
        lists = [[] for _ in LONG_RUN_SCRIPTS]
        for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
            text = bytes(inverse[c] for c in tok if c in inverse).decode("utf-8", "replace")
            for (lo, hi), found in zip(LONG_RUN_SCRIPTS, lists):
                if text and len(found) < 3000 and all(lo <= ord(c) <= hi for c in text):
                    found.append(text)
        out[len(vocab)] = lists
    return out


@pytest.mark.parametrize("rule", ["qwen2", "qwen35", "bundled", "qwen36"])
def test_long_pieces_cut_where_no_token_spans(pairs, script_tokens, rule):
    """Pieces of more than 24 bytes are cut at character junctions no token of the vocabulary spans, and the parts
    go through the piece cache (_core Engine._long). Long runs of scripts written without spaces (Thai, Japanese,
    Chinese) and of Cyrillic and Latin letters, built from the vocabulary's own tokens and from random characters:
    HF's ids on every text, the engine cut some pieces, and the long-piece cache answered the repeats."""
    ref, ours = pairs[rule]
    rnd = random.Random(7)
    texts = []
    for (lo, hi), toks in zip(LONG_RUN_SCRIPTS, script_tokens[len(ref.get_vocab())]):
        for _ in range(60):
            texts.append(" " * rnd.randint(0, 1) + "".join(rnd.choice(toks) for _ in range(rnd.randint(4, 40))))
            texts.append("".join(chr(rnd.randint(lo, hi)) for _ in range(rnd.randint(9, 120))))
    texts.append("。".join(texts[:50]))
    engine = ours._engine
    splits, hits = engine.splits, engine.long_hits
    assert_same(pairs[rule], texts)         # encodes every text once, then counts and encodes them in batches
    assert engine.splits > splits
    assert engine.long_hits > hits


@pytest.mark.parametrize("rule", ["qwen2", "qwen36"])
def test_junction_memo_remembers_only_what_no_neighbour_changes(pairs, script_tokens, rule):
    """_cut keeps, per engine, its answer for a pair of characters x|y when nothing around them can change it (no
    token spans x|y, or "xy" is a token); where a token spans x|y only with a neighbour w or z beside them, every
    junction asks again. For tokens of 3+ characters of Thai, kana and CJK: each junction inside the token, first
    among random neighbours (where the engine may cut), then inside the token itself (where it must not), in one
    engine one after the other. An answer remembered from the first text would cut the second: HF's ids on both."""
    ref, ours = pairs[rule]
    rnd = random.Random(11)
    texts = []
    for (lo, hi), toks in list(zip(LONG_RUN_SCRIPTS, script_tokens[len(ref.get_vocab())]))[:3]:
        def filler():
            return "".join(chr(rnd.randint(lo, hi)) for _ in range(rnd.randint(6, 12)))
        long_toks = [t for t in toks if len(t) >= 3]
        for tok in rnd.sample(long_toks, min(150, len(long_toks))):
            k = rnd.randint(1, len(tok) - 1)
            texts.append(filler() + tok[k - 1:k + 1] + filler())
            texts.append(filler() + tok + filler())
    assert len(texts) > 600
    assert_same(pairs[rule], texts)


def test_long_piece_repeat_is_one_lookup_and_encode_never_takes_a_count(pairs, script_tokens):
    """A long piece the junctions cut is cached whole after its first pass: its repeat is one long-piece cache
    lookup, with no walk over its junctions (Engine.splits unchanged). count() caches the count alone, which
    encode() does not take. Each text counted twice, encoded twice, on one fresh engine: HF's counts and ids every
    time, and the repeats cut nothing."""
    ref, ours = pairs["qwen36"]
    rnd = random.Random(11)
    texts = ["".join(rnd.choice(toks) for _ in range(rnd.randint(10, 40)))
             for toks in script_tokens[len(ref.get_vocab())] for _ in range(8)]
    expected = _ref_ids(ref, texts)
    engine = ours._engine.clone()
    for text, ids in zip(texts, expected):
        first = engine.splits
        assert engine.count(text) == len(ids)
        splits, hits = engine.splits, engine.long_hits
        assert engine.count(text) == len(ids)
        assert engine.splits == splits, text    # the whole piece again: its record, not its junctions
        assert engine.long_hits > hits or splits == first   # (a text nothing was cut in may have no long piece)
        assert engine.encode(text) == ids, text  # its count-only record is not taken for ids
        splits = engine.splits
        assert engine.encode(text) == ids
        assert engine.splits == splits, text
    assert engine.splits > 0


def test_long_piece_cache_ring_wraps(pairs):
    """More distinct long pieces than the long-piece cache's 2 MiB ring holds (runs of one letter, which no junction
    cuts), with the first ones again after the ring has wrapped (their records overwritten) and again right after
    being recomputed: HF's ids every time, by count and by encode, on one engine."""
    ref, ours = pairs["qwen36"]
    pieces = [" " + c * k for k in range(25, 1100) for c in "abcd"]
    assert sum(len(p.encode()) for p in pieces) > 2 * 2 ** 20
    texts = pieces[:200] + ["".join(pieces[200:])] + pieces[:200] + pieces[:200]
    expected = _ref_ids(ref, texts)
    engine = ours._engine.clone()
    assert [engine.count(t) for t in texts] == [len(e) for e in expected]
    hits = engine.long_hits
    assert hits >= 200
    assert [engine.encode(t) for t in texts] == expected
    assert engine.long_hits > hits
