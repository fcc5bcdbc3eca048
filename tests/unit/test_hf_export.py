"""qwen_v3_calculator.hf_export: generated HF tokenizer files are the official ones and tokenize alike."""
import hashlib
import json
import sys

import pytest

from qwen_v3_calculator import hf_export
from qwen_v3_calculator.vocab import NUM_BASE_TOKENS, bundled_ranks

OFFICIAL_SHA256 = {
    "vocab.json": "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910",
    "merges.txt": "8831e4f1a044471340f7c0a83d7bd71306a5b867e95fd870f74d0c5308a904d5",
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",  # Qwen3
}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
SAMPLE = ("Hello, world! 你好，世界。 def f(x):\n    return x**2  # 12345\n\n"
          "🤖👍🏽 naïve café   ’quotes’ it's WE'LL\r\n\tтекст 日本語のテキスト <think>ok</think>\n")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_tok")
    hf_export.write_tokenizer_files(out, "qwen3", chat_template=TEMPLATE)
    return out


@pytest.mark.parametrize("name", sorted(OFFICIAL_SHA256))
def test_files_match_official(qwen3_dir, name):
    assert hashlib.sha256((qwen3_dir / name).read_bytes()).hexdigest() == OFFICIAL_SHA256[name]


def test_qwen25_added_tokens_and_official_template(tmp_path):
    from qwen_vllm_ext.common import assets
    paths = hf_export.write_tokenizer_files(tmp_path, "qwen2.5", assets.chat_template("qwen2.5"))
    assert sorted(p.name for p in paths) == ["merges.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    added = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert [t["id"] for t in added] == list(range(151643, 151665))
    assert added[-1]["content"] == "<|file_sep|>"
    assert len(hf_export.ADDED_TOKENS["qwen2.5"]) == 22 and len(hf_export.ADDED_TOKENS["qwen3"]) == 26
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == assets.chat_template("qwen2.5")
    assert len(config["added_tokens_decoder"]) == 22


def test_chat_template_in_config(qwen3_dir):
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == TEMPLATE
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["added_tokens_decoder"]["151668"] == {
        "content": "</think>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": False}


def test_same_encoding_as_transformers_and_tiktoken(qwen3_dir):
    import tokenizers
    import transformers
    import tiktoken
    hf_ids = tokenizers.Tokenizer.from_file(str(qwen3_dir / "tokenizer.json")).encode(SAMPLE).ids
    auto = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    assert auto.encode(SAMPLE, add_special_tokens=True) == hf_ids
    assert auto.chat_template == TEMPLATE and auto.eos_token_id == 151645
    special = {c: NUM_BASE_TOKENS + i for i, (c, _) in enumerate(hf_export.ADDED_TOKENS["qwen3"])}
    enc = tiktoken.Encoding("qwen3", pat_str=hf_export.SPLIT_PATTERN, mergeable_ranks=bundled_ranks(),
                            special_tokens=special)
    assert enc.encode(SAMPLE, allowed_special="all") == hf_ids
    assert 151667 in hf_ids and len(hf_ids) > 40


def test_chatml_encoding(qwen3_dir):
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids == [151644, 872, 198, 6023, 151645]


def test_derive_merges_pure():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"abc": 4, b"bc": 5}
    assert hf_export.derive_merges(ranks) == [("a", "b"), ("ab", "c"), ("b", "c")]
    # no rank cap: "abc" (rank 3) is reached through "ab" (rank 4), which ranks above it -- the official rule
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"abc": 3, b"ab": 4, b"cd": 5, b"d": 6}
    unmerged = []
    assert hf_export.derive_merges(ranks, unmerged) == [("ab", "c"), ("a", "b"), ("c", "d")]
    assert unmerged == []
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5, b"x": 6, b"xbc": 7}
    unmerged = []
    merges = hf_export.derive_merges(ranks, unmerged)  # "xbc": x + bc would do, but b+c -> "bc" then x+"bc"
    assert ("x", "bc") in merges and unmerged == []
    assert hf_export.merges_text([("a", "b")], header=True) == "#version: 0.2\na b\n"
    assert hf_export.merges_text([("a", "b")], header=False) == "a b\n"
    assert hf_export.vocab_from_ranks({b" ": 1, b"\n": 0}) == {"Ċ": 0, "Ġ": 1}


def test_the_chat_template_is_an_argument_and_the_calculator_needs_no_application(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_vllm_ext", None)  # any import of the application fails
    with pytest.raises(TypeError, match="chat_template"):
        hf_export.write_tokenizer_files(tmp_path, "qwen3", None)
    hf_export.write_tokenizer_files(tmp_path, "qwen3", TEMPLATE)
    with pytest.raises(ValueError):
        hf_export.write_tokenizer_files(tmp_path, "qwen4", chat_template=TEMPLATE)
