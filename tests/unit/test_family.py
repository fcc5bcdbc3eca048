"""qwen_vllm_ext.common.family (which Qwen family a model is, what serving it needs) and the exact reasoning counter."""
import json

import pytest

from qwen_vllm_ext.common import family
from qwen_vllm_ext.demo import HYBRID_CONFIG
from qwen_vllm_ext.usage.accounting import ReasoningCounter, reasoning_tokens


def model_dir(tmp_path, config, im_end=None, think=True):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if im_end is not None:
        added = {str(im_end): {"content": "<|im_end|>"}}
        if think:
            added[str(im_end + 22)] = {"content": "<think>"}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    return str(tmp_path)


@pytest.mark.parametrize("config,im_end,want", [
    ({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}, 248046, "qwen3.6"),
    ({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]}, None, "qwen3.6"),
    ({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"model_type": "qwen3_5_text"}}, None,
     "qwen3.6"),
    (HYBRID_CONFIG, 248046, "qwen3.6"),           # the demo: Qwen3-Next class, Qwen3.5/3.6 tokenizer
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}, 151645, "qwen3-next"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, 151645, "qwen3"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, 151645, "qwen2.5"),
    ({"model_type": "llama"}, None, "unknown"),
])
def test_detect_from_a_model_directory(tmp_path, config, im_end, want):
    fam = family.detect(model_dir(tmp_path, config, im_end), device="cpu")
    assert fam.name == want
    assert fam.hybrid is (want in ("qwen3.6", "qwen3-next"))
    assert fam.dtype == ("bfloat16" if fam.hybrid else None)
    assert family.detect(model_dir(tmp_path, config, im_end), device="cuda").dtype is None
    if want == "qwen3.6":
        assert (fam.vocabulary, fam.reasoning_parser, fam.tool_parser) == ("qwen3.6", "qwen3", "qwen3_coder")


def test_detect_from_hub_ids():
    assert family.detect("Qwen/Qwen3.6-27B").name == "qwen3.6"
    assert family.detect("Qwen/Qwen3.5-397B-A17B").vocabulary == "qwen3.6"
    assert family.detect("Qwen/Qwen3-Next-80B-A3B-Instruct").name == "qwen3-next"
    assert family.detect("Qwen/Qwen3-8B").name == "qwen3"


def test_flags_leave_what_the_user_set():
    fam = family.detect("Qwen/Qwen3.6-27B")
    assert family.parser_flags(fam, set()) == ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder",
                                               "--enable-auto-tool-choice"]
    assert family.parser_flags(fam, {"reasoning_parser", "tool_call_parser"}) == []
    assert family.hybrid_flags(fam, set(), prefix_caching=True) == ["--prefix-match-unit", "16"]
    assert family.hybrid_flags(fam, set(), prefix_caching=False) == []
    assert family.hybrid_flags(fam, {"prefix_match_unit"}, prefix_caching=True) == []
    assert family.hybrid_flags(fam, set(), True, block_size=32) == ["--prefix-match-unit", "16"]
    assert family.hybrid_flags(fam, set(), True, block_size=8) == []  # vLLM would refuse to start
    dense = family.detect("Qwen/Qwen3-8B")
    assert family.parser_flags(dense, set()) == [] and family.hybrid_flags(dense, set(), True) == []


def test_reasoning_counter():
    think, end = 10, 11
    assert reasoning_tokens([1, 2, think], [5, 6, end, 7], think, end) == 2          # prompt opened the block
    assert reasoning_tokens([1, think, end], [5, 6], think, end) == 0                # thinking off: closed block
    assert reasoning_tokens([1], [think, 5, 6, 7, end, 8], think, end) == 3          # the model opens it
    assert reasoning_tokens([think], [5], None, None) == 0                           # no markers in the vocabulary
    # markers before the prompt's last 64 ids: the whole prompt is searched
    assert reasoning_tokens([think] + [1] * 200, [5, end, 6], think, end) == 1
    assert reasoning_tokens([end] + [1] * 200 + [think], [5, 6], think, end) == 2
    assert reasoning_tokens([think] + [1] * 200 + [end], [5, 6], think, end) == 0
    assert reasoning_tokens((1, think), [5, 6], think, end) == 2  # a tuple prompt
    c = ReasoningCounter(think, end, [think], keep_history=True)
    c.feed([5, 6])
    c.feed([end, 7])
    assert (c.count, c.at(0), c.at(1), c.at(2), c.at(4), c.at(99)) == (2, 0, 1, 2, 2, 2)
    with pytest.raises(ValueError):
        ReasoningCounter(think, end).at(1)


def test_mtp_layers_and_the_speculative_config_flag(tmp_path):
    """Issue 49: MTP layers as vLLM's speculative config reads them; the launcher's flag, the user's own
    --speculative-config winning, and a clear refusal for a checkpoint that cannot draft."""
    assert family.mtp_layers({"num_nextn_predict_layers": 1}) == 1  # Qwen3-Next, the MTP demo
    assert family.mtp_layers({"text_config": {"mtp_num_hidden_layers": 1}}) == 1  # Qwen3.5/3.6 checkpoints
    assert family.mtp_layers({"mtp_num_hidden_layers": 2}) == 2
    for none in ({}, {"num_nextn_predict_layers": 0}, {"num_nextn_predict_layers": True},
                 {"num_nextn_predict_layers": "1"}, {"text_config": "x"}):
        assert family.mtp_layers(none) == 0
    mtp = family.detect(model_dir(tmp_path, {**HYBRID_CONFIG, "num_nextn_predict_layers": 1}, 248046), "cpu")
    assert mtp.mtp_layers == 1
    assert family.mtp_flags(mtp, 2, set()) == [
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    assert family.mtp_flags(mtp, 0, set()) == [] and family.mtp_flags(mtp, 3, {"speculative_config"}) == []
    plain = family.detect(model_dir(tmp_path, HYBRID_CONFIG, 248046), "cpu")
    assert plain.mtp_layers == 0 and family.mtp_flags(plain, 0, set()) == []
    with pytest.raises(ValueError, match="declares no MTP layers"):
        family.mtp_flags(plain, 2, set())
    with pytest.raises(ValueError, match="needs a checkpoint with MTP"):
        family.mtp_flags(family.detect("Qwen/Qwen3-8B"), 1, set())
    with pytest.raises(ValueError, match="declares none"):
        family.check_speculative_config(plain, {"method": "mtp", "num_speculative_tokens": 1})
    family.check_speculative_config(mtp, {"method": "mtp", "num_speculative_tokens": 1})  # has MTP layers
    family.check_speculative_config(plain, {"method": "ngram", "num_speculative_tokens": 1})  # not MTP
    family.check_speculative_config(plain, {"method": "mtp", "model": "/other/ckpt"})  # weights from elsewhere
    family.check_speculative_config(plain, None)
    hub = family.detect("Qwen/Qwen3.6-27B")  # a hub id: unknown, vLLM checks when it loads the config
    assert hub.mtp_layers is None and family.mtp_flags(hub, 1, set())[0] == "--speculative-config"
