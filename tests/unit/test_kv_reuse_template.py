"""The shipped prefix-stable templates (data/qwen3-reuse.jinja for Qwen3, data/qwen3.5-reuse.jinja for Qwen3.5/3.6)
and their mirrors in ``count_chat``.

* The Python renderer ``template="qwen3-reuse"`` / ``"qwen3.5-reuse"`` equals the Jinja file rendered as
  transformers/vLLM render it, on every seeded conversation, with ``preserve_thinking`` unset / true / false.
* ``preserve_thinking=false`` renders exactly as the OFFICIAL template (stock behaviour one kwarg away).
* Reuse mode is a strict token prefix across turns: prompt(N) + what the model generated in turn N is a token
  prefix of prompt(N+1), thinking on and off; the official template breaks that (why the mode exists).
"""
from __future__ import annotations

import pytest

from qwen_v3_calculator.chat import REUSE_TEMPLATES, count_chat, render_chat, template_path
from qwen_vllm_ext.kv.reuse import common_prefix
from tests.helpers.chat_reference import HFAdapter, jinja_render
from tests.helpers.conversations import CONVERSATIONS


# reuse template -> the official template it derives from (also the family's name in jinja_render)
OFFICIAL = {"qwen3-reuse": "qwen3", "qwen3.5-reuse": "qwen3.5"}


@pytest.fixture(scope="module")
def reuse_texts():
    out = {}
    for name in OFFICIAL:
        with open(template_path(name), encoding="utf-8") as f:
            out[name] = f.read()
    return out


@pytest.fixture(scope="module")
def official_texts():
    from qwen_vllm_ext.common import assets

    return {name: assets.chat_template(name) for name in OFFICIAL.values()}


@pytest.fixture(scope="module")
def hf_toks(qwen3_tokenizer_dir, qwen36_tokenizer_dir):
    return {"qwen3-reuse": HFAdapter(qwen3_tokenizer_dir / "tokenizer.json"),
            "qwen3.5-reuse": HFAdapter(qwen36_tokenizer_dir / "tokenizer.json")}


def _jinja_or_refused(text, family, messages, tools, add_generation_prompt, thinking, **extra):
    """The Jinja rendering, or None when the template refuses the chat (Qwen3.5: no real user query)."""
    import jinja2

    try:
        return jinja_render(text, family, messages, tools, add_generation_prompt, thinking, **extra)
    except jinja2.TemplateError:
        return None


PRESERVE = {"unset": {}, "true": {"preserve_thinking": True}, "false": {"preserve_thinking": False},
            "answers": {"preserve_thinking": "answers"}}


@pytest.mark.parametrize("template", list(OFFICIAL))
@pytest.mark.parametrize("preserve", list(PRESERVE))
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renderer_equals_shipped_jinja(reuse_texts, template, preserve, name):
    messages, tools, kwargs = CONVERSATIONS[name]
    extra = PRESERVE[preserve]
    for add_generation_prompt in (True, False):
        for thinking in {kwargs.get("enable_thinking"), False}:
            expected = _jinja_or_refused(reuse_texts[template], OFFICIAL[template], messages, tools,
                                         add_generation_prompt, thinking, **extra)
            if expected is None:  # the template refuses this chat: so does the mirror
                with pytest.raises(ValueError):
                    render_chat(messages, tools=tools, template=template, enable_thinking=thinking, **extra)
                continue
            got = render_chat(messages, tools=tools, template=template,
                              add_generation_prompt=add_generation_prompt, enable_thinking=thinking, **extra)
            assert got == expected


@pytest.mark.parametrize("template", list(OFFICIAL))
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_preserve_false_is_the_official_template(reuse_texts, official_texts, template, name):
    messages, tools, kwargs = CONVERSATIONS[name]
    family = OFFICIAL[template]
    for add_generation_prompt in (True, False):
        official = _jinja_or_refused(official_texts[family], family, messages, tools, add_generation_prompt,
                                     kwargs.get("enable_thinking"))
        assert _jinja_or_refused(reuse_texts[template], family, messages, tools, add_generation_prompt,
                                 kwargs.get("enable_thinking"), preserve_thinking=False) == official
        if official is not None:
            assert render_chat(messages, tools=tools, template=template,
                               add_generation_prompt=add_generation_prompt, preserve_thinking=False,
                               **kwargs) == official


def test_reuse_keeps_history_reasoning_and_empty_think_blocks():
    """Qwen3: every earlier turn keeps its think block (the official template drops it)."""
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


def test_qwen35_reuse_keeps_think_blocks_and_the_answer_as_generated():
    """Qwen3.5/3.6: think blocks kept for earlier turns, and the answer untrimmed (the official template trims it:
    a generated leading space or trailing newline would change the tokens)."""
    msgs = [{"role": "user", "content": " 2+2? "},
            {"role": "assistant", "content": "\n\n 4\n", "reasoning_content": "\nAdd them.\n"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": " 6"},
            {"role": "user", "content": "Thanks"}]
    reuse = render_chat(msgs, template="qwen3.5-reuse", enable_thinking=False)
    assert reuse == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n 4\n"
                     "<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n 6"
                     "<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    stock = render_chat(msgs, template="qwen3.5", enable_thinking=False)
    assert "Add them." not in stock and stock.count("<think>") == 1 and "assistant\n6<|im_end|>" in stock


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
        if thinking:  # the model writes its reasoning after "<|im_start|>assistant\n" (Qwen3.5: after "<think>\n")
            reasoning = REASONING[t % len(REASONING)]
            opened = "" if prompt.endswith("<think>\n") else "<think>\n"
            generated = f"{opened}{reasoning}\n</think>\n\n{answer}<|im_end|>"
            messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
        else:  # the generation prompt already holds the empty think block
            generated = f"{answer}<|im_end|>"
            messages.append({"role": "assistant", "content": answer})
        out.append((tok.encode(prompt), tok.encode(generated)))
    return out


@pytest.mark.parametrize("template", list(OFFICIAL))
@pytest.mark.parametrize("thinking", [True, False])
def test_reuse_mode_is_a_strict_token_prefix_across_turns(hf_toks, template, thinking):
    turns = _conversation_turns(thinking, template, hf_toks[template])
    for (prompt, generated), (next_prompt, _) in zip(turns, turns[1:]):
        seen = prompt + generated
        assert len(next_prompt) > len(seen) and next_prompt[:len(seen)] == seen


@pytest.mark.parametrize("template", list(OFFICIAL))
@pytest.mark.parametrize("thinking", [True, False])
def test_stock_template_breaks_at_the_previous_generation(hf_toks, template, thinking):
    """Official template: thinking on, the generated reasoning is dropped from history (the match ends where
    the generation began, Qwen3.5: before the generation prompt's ``<think>\n``); thinking off, the empty think
    block of the generation prompt is missing from history (the match ends even before it). Either way none of
    the previous completion is reusable."""
    hf_tok = hf_toks[template]
    # what the generation prompt holds after <|im_start|>assistant\n (Qwen3.5 opens the think block itself)
    tail = "<think>\n\n</think>\n\n" if not thinking else "<think>\n" if template == "qwen3.5-reuse" else ""
    turns = _conversation_turns(thinking, OFFICIAL[template], hf_tok)
    for (prompt, generated), (next_prompt, _) in zip(turns, turns[1:]):
        expected = len(prompt) - len(hf_tok.encode(tail))
        assert common_prefix(prompt + generated, next_prompt) == expected


@pytest.mark.parametrize("template", list(OFFICIAL))
def test_count_chat_reuse_matches_the_tokenized_jinja(hf_toks, reuse_texts, template):
    hf_tok, checked = hf_toks[template], 0
    for name, (messages, tools, kwargs) in CONVERSATIONS.items():
        text = _jinja_or_refused(reuse_texts[template], OFFICIAL[template], messages, tools, True,
                                 kwargs.get("enable_thinking"))
        if text is not None:
            assert count_chat(messages, hf_tok, tools=tools, template=template, **kwargs) == len(hf_tok.encode(text))
            checked += 1
    assert checked >= 30


def test_template_path_and_errors():
    assert template_path().endswith("qwen3-reuse.jinja") and set(REUSE_TEMPLATES) == {"qwen3-reuse", "qwen3.5-reuse"}
    assert template_path("qwen3.5-reuse").endswith("qwen3.5-reuse.jinja")
    with pytest.raises(ValueError, match="no shipped chat template"):
        template_path("qwen3")
    with pytest.raises(ValueError, match="unknown chat template"):
        render_chat([{"role": "user", "content": "hi"}], template="qwen3-reuse2")


@pytest.mark.parametrize("template", list(OFFICIAL))
def test_answers_mode_keeps_answers_and_drops_reasoning_like_the_official_template(template):
    """preserve_thinking="answers" (issue 48: the Qwen3.5/3.6 default): a turn generated with thinking off comes
    back as generated (empty think block, the answer), so the next prompt extends it; a turn with reasoning renders
    as the official template renders it, reasoning dropped, so it is not re-sent (and re-billed) every turn."""
    thought = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
               {"role": "user", "content": "Thanks"}]
    plain = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "Thanks"}]
    official = OFFICIAL[template]
    for thinking in (True, False):
        answers = render_chat(thought, template=template, enable_thinking=thinking, preserve_thinking="answers")
        assert answers == render_chat(thought, template=official, enable_thinking=thinking)
        assert "Add them." not in answers
        kept = render_chat(plain, template=template, enable_thinking=thinking, preserve_thinking="answers")
        assert kept == render_chat(plain, template=template, enable_thinking=thinking, preserve_thinking=True)
        assert "<think>\n\n</think>\n\n4" in kept
    # a thinking-off turn's prompt + answer is a prefix of the next prompt
    first = render_chat(plain[:1], template=template, enable_thinking=False, preserve_thinking="answers")
    nxt = render_chat(plain, template=template, enable_thinking=False, preserve_thinking="answers")
    assert nxt.startswith(first + "4")
