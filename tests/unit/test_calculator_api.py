"""The public calculator API: calculate_tokens / count_* / Calculator / CLI, bad input."""
import json
from decimal import Decimal
import subprocess
import sys

import pytest

import qwen_v3_calculator as qc
from qwen_v3_calculator import Calculator, calculate_tokens, count_chat, count_tokens, count_tokens_batch, encode
from qwen_v3_calculator.hf_export import write_tokenizer_files

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "请分析这份财报的净利润趋势"}]


def test_counts_and_billing_of_text():
    r = calculate_tokens(input_text="hello world", output_text="你好，世界")
    assert r["prompt_tokens"] == 2 == len(encode("hello world"))
    assert r["completion_tokens"] == count_tokens("你好，世界") and r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"]
    assert str(r["billing"]["total_units"]) == str(2 + r["completion_tokens"] * qc.BillingPolicy().output_weight)
    assert count_tokens_batch(["hello world", "", "a"]) == [2, 0, 1]


def test_billing_sanitizes_but_encode_does_not():
    assert calculate_tokens(input_text="hello\u200b world")["prompt_tokens"] == 2
    assert calculate_tokens(input_text="hello\u200b world")["sanitized_chars"] == 1
    assert len(encode("hello\u200b world")) > 2


def test_messages_use_the_exact_chat_count():
    r = calculate_tokens(messages=CHAT, output_text="ok")
    assert r["prompt_tokens"] == count_chat(CHAT)
    assert count_chat([{"role": "user", "content": "hi"}]) == 9  # what vLLM reports on the demo server


def test_system_exclusion_and_field_report_preset():
    calc = Calculator(policy=qc.BillingPolicy(exclude_system=True))
    r = calc.calculate_tokens(messages=CHAT)
    assert r["billing"]["billed_prompt_tokens"] == count_chat(CHAT[1:]) < r["prompt_tokens"]
    report = Calculator(policy="field-report").calculate_tokens(messages=CHAT)
    assert report["prompt_tokens"] == count_tokens("user: 请分析这份财报的净利润趋势\n")


def test_calculator_from_tokenizer_files(tmp_path):
    write_tokenizer_files(tmp_path, "qwen3", chat_template="x")
    calc = Calculator(tokenizer=tmp_path)
    assert calc.template == "qwen3" and calc.encode("hello world") == [14990, 1879]
    assert Calculator(tokenizer=tmp_path / "tokenizer.json").count_tokens("hello world") == 2


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="input_text must be str, not int"):
        calculate_tokens(input_text=5)
    with pytest.raises(TypeError, match="text must be str, not NoneType"):
        count_tokens(None)
    with pytest.raises(TypeError, match=r"texts\[1\] must be str, not int"):
        count_tokens_batch(["a", 3])
    with pytest.raises(ValueError, match="messages"):
        calculate_tokens(messages="hi")
    with pytest.raises(ValueError, match=r"1.*role"):
        count_chat([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match=r"0.*content"):
        count_chat([{"role": "user", "content": 5}])
    with pytest.raises(ValueError, match=r"0.*role"):
        count_chat([{"role": "wizard", "content": "x"}])


def cli(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", "qwen_v3_calculator", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_cli(tmp_path):
    assert cli("count", stdin="hello world").stdout.strip() == "2"
    out = json.loads(cli("count", "--json", stdin="hello world").stdout)
    assert out["prompt_tokens"] == 2 and Decimal(out["billing"]["total_units"]) == 2
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert cli("chat", str(chat)).stdout.strip() == "9"
    chat.write_text("{not json")
    bad = cli("chat", str(chat))
    assert bad.returncode == 2 and "error" in bad.stderr
    missing = cli("count", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and "nope.txt" in missing.stderr


def test_missing_compiled_core_says_how_to_build():
    code = "import sys; sys.modules['qwen_v3_calculator._core'] = None\nimport qwen_v3_calculator"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "compiled core is missing" in proc.stderr and "pip install" in proc.stderr


def test_the_piece_cache_costs_memory_only_as_pieces_arrive():
    """The 16 MiB piece cache is an anonymous mapping: loading the bundled tokenizer (a template engine plus the
    tokenizer's clone, one cache each) adds few of its pages to the resident set, and counting a text adds the
    pages its pieces land on. Loading (import included, and the pages the first text's pieces land on) measured
    21-23 MB here; with both caches written at allocation it would be 32 MB more."""
    code = (
        "import os\n"
        "page = os.sysconf('SC_PAGE_SIZE')\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * page / 1e6\n"
        "a = rss()\n"
        "from qwen_v3_calculator.tokenizer import Tokenizer\n"
        "t = Tokenizer.bundled(); t.count('warm up')\n"
        "b = rss()\n"
        "t.count(' '.join(f'w{i}x{i * 7919 % 10007}' for i in range(60000)))\n"
        "print(b - a, rss() - b)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    load_mb, counting_mb = map(float, proc.stdout.split())
    assert load_mb < 26, load_mb
    assert counting_mb > 1, counting_mb  # the cache's pages arrive with the pieces


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tmp_path_factory):
    """The Qwen3 tokenizer.json cut to its first 3,000 ids (a merge's parts rank below its result, so the cut is
    whole); each case below writes a broken copy of it."""
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, "qwen3", chat_template="x")
    spec = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec["model"]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i < 3000}
    model["merges"] = [m for m in model["merges"] if "".join(m.split(" ") if isinstance(m, str) else m)
                       in model["vocab"]]
    spec["added_tokens"] = []
    return spec


@pytest.mark.parametrize("merges, message", [
    (None, r"unknown BPE merges format \(no merges\)"),
    ({"Ġ t": 0}, r"unknown BPE merges format \(merges of type dict\)"),
    (["Ġ t", "Ġt he x"], r"merges\[1\] = 'Ġt he x'"),
    (["Ġ t", "Ġthe"], r"merges\[1\] = 'Ġthe'"),
    ([["Ġ", "t"], ["Ġ", 5]], r"merges\[1\] = \['Ġ', 5\]"),
    ([["Ġ", "t", "h"]], r"merges\[0\]"),
    (["Ġ t", "zz\u2603 q"], r"token 'zz☃' is not in the vocabulary"),
])
def test_a_tokenizer_json_with_unknown_merges_is_refused_naming_the_file(tmp_path, tiny_tokenizer_json, merges,
                                                                        message):
    """Never a silent miscount: merges the engine cannot read are an error that names the file (and the entry)."""
    spec = json.loads(json.dumps(tiny_tokenizer_json))
    if merges is None:
        del spec["model"]["merges"]
    else:
        spec["model"]["merges"] = merges
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        Calculator(tokenizer=tmp_path)
    assert str(path) in str(err.value)


def test_both_merges_formats_count_the_same(tmp_path, tiny_tokenizer_json):
    """HF tokenizers writes merges as "left right" strings (before 0.20) or [left, right] pairs: both read alike."""
    pairs = json.loads(json.dumps(tiny_tokenizer_json))
    strings = json.loads(json.dumps(tiny_tokenizer_json))
    strings["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in pairs["model"]["merges"]]
    pairs["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in pairs["model"]["merges"]]
    import tokenizers

    text = "Это является важным вопросом; the tokenizer counts 人力资源"
    ids = []
    for name, spec in (("pairs", pairs), ("strings", strings)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
        ids.append(Calculator(tokenizer=tmp_path / name).encode(text))
        ids.append(tokenizers.Tokenizer.from_file(str(tmp_path / name / "tokenizer.json")).encode(text).ids)
    assert ids[0] == ids[1] == ids[2] == ids[3] and len(ids[0]) > 20  # the cut vocabulary: more, shorter tokens


def test_tokens_that_are_no_valid_utf8_load_and_count_like_hf(tmp_path, tiny_tokenizer_json):
    """A vocabulary may hold byte sequences no valid text has, e.g. past U+10FFFF (lead bytes F5-F7) or a code point
    over it (F4 90..): the junction table built at load (_core Engine._build_junctions, which indexes per code point)
    treats them as partial characters; loading does not fail and valid text counts as HF counts it."""
    from qwen_v3_calculator.hf_export import bytes_to_unicode

    import tokenizers

    u = bytes_to_unicode()
    spec = json.loads(json.dumps(tiny_tokenizer_json))
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]

    def add(left: bytes, right: bytes):
        whole = "".join(u[b] for b in left + right)
        if whole not in vocab:
            vocab[whole] = len(vocab)
            merges.append(["".join(u[b] for b in left), "".join(u[b] for b in right)])

    for chain in (b"\xf7\xbf\xbf\xbfab", b"ab\xf4\x90\x80\x80", b"\xf5\x80\x80\x80\xf6\x80\x80\x80"):
        for k in range(2, len(chain) + 1):
            add(chain[:k - 1], chain[k - 1:k])
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    text = "ab" * 40 + " Это является важным вопросом; 人力资源" * 5 + " 𝔘𝔫𝔦𝔠𝔬𝔡𝔢" * 20
    ref = tokenizers.Tokenizer.from_file(str(path))
    assert Calculator(tokenizer=tmp_path).encode(text) == ref.encode(text).ids
