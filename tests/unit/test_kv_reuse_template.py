"""The shipped prefix-stable Qwen3 template (data/qwen3-reuse.jinja) and its mirror in ``count_chat``.

* The Python renderer ``template="qwen3-reuse"`` equals the Jinja file rendered as transformers/vLLM render it,
  on every seeded conversation, with ``preserve_thinking`` unset / true / false.
* ``preserve_thinking=false`` renders exactly as the OFFICIAL Qwen3 template (stock behaviour one kwarg away).
* Reuse mode is a strict token prefix across turns: prompt(N) + what the model generated in turn N is a token
  prefix of prompt(N+1), thinking on and off; the official template breaks that (why the mode exists).
"""
from __future__ import annotations

import pytest

from qwen_v3_calculator.chat import REUSE_TEMPLATES, count_chat, render_chat, template_path
from qwen_vllm_ext.kv.reuse import common_prefix
from tests.unit.test_chat_count import CONVERSATIONS, HFAdapter, jinja_render


@pytest.fixture(scope="module")
def reuse_template_text():
    with open(template_path("qwen3-reuse"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def official_qwen3():
    from qwen_vllm_ext import assets

    return assets.chat_template("qwen3")


@pytest.fixture(scope="module")
def hf_tok(qwen3_tokenizer_dir):
    return HFAdapter(qwen3_tokenizer_dir / "tokenizer.json")


PRESERVE = {"unset": {}, "true": {"preserve_thinking": True}, "false": {"preserve_thinking": False}}


@pytest.mark.parametrize("preserve", list(PRESERVE))
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renderer_equals_shipped_jinja(reuse_template_text, preserve, name):
    messages, tools, kwargs = CONVERSATIONS[name]
    extra = PRESERVE[preserve]
    for add_generation_prompt in (True, False):
        for thinking in {kwargs.get("enable_thinking"), False}:
            expected = jinja_render(reuse_template_text, "qwen3", messages, tools, add_generation_prompt,
                                    thinking, **extra)
            got = render_chat(messages, tools=tools, template="qwen3-reuse",
                              add_generation_prompt=add_generation_prompt, enable_thinking=thinking, **extra)
            assert got == expected


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_preserve_false_is_the_official_template(reuse_template_text, official_qwen3, name):
    messages, tools, kwargs = CONVERSATIONS[name]
    for add_generation_prompt in (True, False):
        official = jinja_render(official_qwen3, "qwen3", messages, tools, add_generation_prompt,
                                kwargs.get("enable_thinking"))
        assert jinja_render(reuse_template_text, "qwen3", messages, tools, add_generation_prompt,
                            kwargs.get("enable_thinking"), preserve_thinking=False) == official
        assert render_chat(messages, tools=tools, template="qwen3-reuse", add_generation_prompt=add_generation_prompt,
                           preserve_thinking=False, **kwargs) == official


def test_reuse_keeps_history_reasoning_and_empty_think_blocks():
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"},
            {"role": "user", "content": "Thanks"}]
    reuse = render_chat(msgs, template="qwen3-reuse", enable_thinking=False)
    assert reuse == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4"
                     "<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n6"
                     "<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    stock = render_chat(msgs, template="qwen3", enable_thinking=False)
    assert "Add them." not in stock and stock.count("<think>") == 1
    # the official template ignores preserve_thinking (vLLM passes it, the template never reads it)
    assert render_chat(msgs, template="qwen3", preserve_thinking=True, enable_thinking=False) == stock


REASONING = ["The user greets me; answer briefly.", "Compute step by step:\n1. first\n2. second",
             "用户在问天气。", "Nothing hard here."]
ANSWERS = ["Hello! How can I help?", "The result is 42.", "北京今天晴，25°C。", "Sure — here is a list:\n- a\n- b",
           "  leading spaces kept?", "Done."]


def _conversation_turns(thinking: bool, template: str, tok, turns: int = 10):
    """Simulate a thinking model over ``turns`` turns; returns [(prompt ids, generated ids), ...]."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t}: {ANSWERS[t % len(ANSWERS)][::-1]}"})
        prompt = render_chat(messages, template=template, enable_thinking=thinking)
        answer = ANSWERS[t % len(ANSWERS)].strip()
        if thinking:  # the model writes its reasoning after "<|im_start|>assistant\n"
            reasoning = REASONING[t % len(REASONING)]
            generated = f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>"
            messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
        else:  # the generation prompt already holds the empty think block
            generated = f"{answer}<|im_end|>"
            messages.append({"role": "assistant", "content": answer})
        out.append((tok.encode(prompt), tok.encode(generated)))
    return out


@pytest.mark.parametrize("thinking", [True, False])
def test_reuse_mode_is_a_strict_token_prefix_across_turns(hf_tok, thinking):
    turns = _conversation_turns(thinking, "qwen3-reuse", hf_tok)
    for (prompt, generated), (next_prompt, _) in zip(turns, turns[1:]):
        seen = prompt + generated
        assert len(next_prompt) > len(seen) and next_prompt[:len(seen)] == seen


@pytest.mark.parametrize("thinking", [True, False])
def test_stock_template_breaks_at_the_previous_generation(hf_tok, thinking):
    """Official template: thinking on, the generated reasoning is dropped from history (the match ends where
    the generation began); thinking off, the empty think block of the generation prompt is missing from
    history (the match ends even before it). Either way none of the previous completion is reusable."""
    empty_think = len(hf_tok.encode("<think>\n\n</think>\n\n"))
    turns = _conversation_turns(thinking, "qwen3", hf_tok)
    for (prompt, generated), (next_prompt, _) in zip(turns, turns[1:]):
        expected = len(prompt) if thinking else len(prompt) - empty_think
        assert common_prefix(prompt + generated, next_prompt) == expected


def test_count_chat_reuse_matches_the_tokenized_jinja(hf_tok, reuse_template_text):
    for name, (messages, tools, kwargs) in CONVERSATIONS.items():
        text = jinja_render(reuse_template_text, "qwen3", messages, tools, True, kwargs.get("enable_thinking"))
        assert count_chat(messages, hf_tok, tools=tools, template="qwen3-reuse", **kwargs) == len(hf_tok.encode(text))


def test_template_path_and_errors():
    assert template_path().endswith("qwen3-reuse.jinja") and set(REUSE_TEMPLATES) == {"qwen3-reuse"}
    with pytest.raises(ValueError, match="no shipped chat template"):
        template_path("qwen3")
    with pytest.raises(ValueError, match="unknown chat template"):
        render_chat([{"role": "user", "content": "hi"}], template="qwen3-reuse2")
