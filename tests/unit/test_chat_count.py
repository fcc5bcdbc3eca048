"""count_chat / render_chat: the hand-written renderers equal the official Qwen templates rendered as
transformers (and so vLLM) renders them, on a seeded set of conversations; vLLM's preprocessing; bad input.

The conversations (``CONVERSATIONS``, tests/helpers/conversations.py) are shared with
tests/e2e/test_count_chat_vllm.py, which checks the counts against a real vLLM server.
"""
from __future__ import annotations

import json

import pytest

from qwen_v3_calculator.chat import (TEMPLATES, count_chat, message_text, normalize_messages, normalize_tools,
                                     render_chat, validate_messages)

from ..helpers.chat_reference import HFAdapter, jinja_render
from ..helpers.conversations import CONVERSATIONS, HANDWRITTEN, TOOLS


# ---------------------------------------------------------------------------------------------------
# Reference: the official template text rendered the way transformers' apply_chat_template renders it
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def official_templates():
    from qwen_vllm_ext.common import assets

    return {name: assets.chat_template(name) for name in TEMPLATES}


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renderer_equals_official_template(official_templates, template, name):
    import jinja2

    messages, tools, kwargs = CONVERSATIONS[name]
    for add_generation_prompt in (True, False):
        try:
            expected = jinja_render(official_templates[template], template, messages, tools,
                                    add_generation_prompt, kwargs.get("enable_thinking"))
        except jinja2.TemplateError:  # the template refuses this chat (Qwen3.5: no real user query): so do we
            with pytest.raises(ValueError):
                render_chat(messages, tools=tools, template=template, **kwargs)
            return
        got = render_chat(messages, tools=tools, template=template, add_generation_prompt=add_generation_prompt,
                          **kwargs)
        assert got == expected


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_enable_thinking_variants(official_templates, template, enable_thinking):
    for name in ("multi_turn", "reasoning_kept_after_last_query", "consecutive_tool_results"):
        messages, tools, _ = HANDWRITTEN[name]
        assert render_chat(messages, tools, template, enable_thinking=enable_thinking) == jinja_render(
            official_templates[template], template, messages, tools, True, enable_thinking)


def test_known_renderings():
    hi = [{"role": "user", "content": "hi"}]
    assert render_chat(hi) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(hi, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(hi, template="qwen2.5").startswith("<|im_start|>system\nYou are Qwen, created by Alibaba")
    assert render_chat(hi, template="qwen3.5").endswith("<|im_start|>assistant\n<think>\n")
    # reasoning_effort maps to enable_thinking as vLLM does
    assert render_chat(hi, reasoning_effort="none") == render_chat(hi, enable_thinking=False)
    # Qwen3.5 renders tool calls as <function=...><parameter=...> blocks, non-strings as JSON / str()
    msgs = HANDWRITTEN["null_assistant_content"][0]
    text = render_chat(msgs, TOOLS[1:2], "qwen3.5")
    assert ("<tool_call>\n<function=search>\n<parameter=nested>\n{\"a\": [1, 2.5, null, true]}\n</parameter>\n"
            "<parameter=flag>\nFalse\n</parameter>\n<parameter=n>\nNone\n</parameter>\n") in text


# ---------------------------------------------------------------------------------------------------
# vLLM preprocessing (mirrored from vllm/renderers/chat_utils.py and the request protocol)
# ---------------------------------------------------------------------------------------------------
def test_tool_call_arguments_are_parsed_and_reserialized():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"b":1,   "a":"é"}'}}
    conv = normalize_messages([{"role": "user", "content": "x"},
                               {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"b": 1, "a": "é"}
    assert call["function"]["arguments"] == '{"b":1,   "a":"é"}'  # the caller's message is not mutated
    assert '"arguments": {"b": 1, "a": "é"}}' in render_chat(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    for bad in ('{"oops', "[1]", "", None, "42"):
        call = {"type": "function", "function": {"name": "f", "arguments": bad}}
        conv = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
        assert conv[0]["tool_calls"][0]["function"]["arguments"] == {}
    conv = normalize_messages([{"role": "assistant", "content": "", "tool_calls": []}])
    assert "tool_calls" not in conv[0]


def test_tool_schemas_as_vllm_dumps_them():
    tools = [{"type": "function", "extra": 1, "function": {"name": "f", "extra": 2}},
             {"function": {"name": "g", "description": "d", "parameters": {"z": 1, "a": 2}, "strict": False},
              "defer_loading": True}]
    assert normalize_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": {"z": 1, "a": 2},
                                          "strict": False, "defer_loading": True}, "defer_loading": True}]
    assert json.dumps(normalize_tools(tools)[1]["function"]["parameters"]) == '{"z": 1, "a": 2}'  # order kept


def test_content_parts_and_roles():
    parts = [{"type": "text", "text": "a"}, "b", {"type": "text", "text": None}, {"type": "text", "text": ""},
             {"type": "input_text", "text": "c"}, {"type": "refusal", "refusal": "d"}]
    assert normalize_messages([{"role": "user", "content": parts}])[0]["content"] == "a\nb\nc\nd"
    assert normalize_messages([{"role": "user", "content": parts}], "openai")[0]["content"] == [
        {"type": "text", "text": t} for t in ("a", "b", "", "c", "d")]
    assert normalize_messages([{"role": "tool", "content": parts}], "openai")[0]["content"] == "a\nb\n\nc\nd"
    assert normalize_messages([{"role": "user"}])[0]["content"] == ""
    assert message_text({"role": "user", "content": parts}) == "a\nb\nc\nd"
    # reasoning / reasoning_content reach the template as reasoning_content; `reasoning` wins
    conv = normalize_messages([{"role": "assistant", "content": "x", "reasoning": "r1", "reasoning_content": "r2"}])
    assert conv[0]["reasoning_content"] == "r1"
    # developer -> system, merged to the front
    conv = normalize_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                               {"role": "developer", "content": "d"}])
    assert conv == [{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}]
    # the per-request billing header line of system messages is dropped
    conv = normalize_messages([{"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe nice."}])
    assert conv[0]["content"] == "Be nice."


def test_continue_final_message(official_templates):
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}]
    for template in TEMPLATES:
        text = render_chat(msgs, template=template, add_generation_prompt=False, continue_final_message=True)
        assert text.endswith("Hi th") and text == jinja_render(official_templates[template], template, msgs, None,
                                                               False, continue_final_message=True)
        with pytest.raises(ValueError):
            render_chat(msgs, template=template, continue_final_message=True)


# ---------------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def hf_qwen3(qwen3_tokenizer_dir):
    return HFAdapter(qwen3_tokenizer_dir / "tokenizer.json")


def test_count_chat_counts_the_rendered_prompt(hf_qwen3):
    assert count_chat([{"role": "user", "content": "hi"}], hf_qwen3) == 9
    assert count_chat([{"role": "user", "content": "hi"}], hf_qwen3, enable_thinking=False) == 13
    for name, (messages, tools, kwargs) in CONVERSATIONS.items():
        text = render_chat(messages, tools, **kwargs)
        assert count_chat(messages, hf_qwen3, tools, **kwargs) == len(hf_qwen3.encode(text)), name


def test_count_chat_uses_count_when_present():
    class Counting:
        def count(self, text):
            return len(text)

        def encode(self, text):  # pragma: no cover - must not be used
            raise AssertionError

    assert count_chat([{"role": "user", "content": "hi"}], Counting()) == len(render_chat([{"role": "user",
                                                                                              "content": "hi"}]))


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages, match", [
    ("hi", r"messages must be a list"),
    ({"role": "user"}, r"messages must be a list"),
    ([], r"must not be empty"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role is missing"),
    ([{"role": "wizard", "content": "a"}], r"messages\[0\]\.role: unknown role 'wizard'"),
    ([{"role": None, "content": "a"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\.content must be"),
    ([{"role": "user", "content": {"text": "a"}}], r"messages\[0\]\.content must be"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"messages\[0\]\.content\[0\]\.text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\]\.type"),
    ([{"role": "user", "content": [7]}], r"messages\[0\]\.content\[0\]"),
    ([{"role": "assistant", "content": "", "tool_calls": {"a": 1}}], r"messages\[0\]\.tool_calls"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "assistant", "content": "", "reasoning_content": 1}], r"messages\[0\]\.reasoning"),
])
def test_bad_messages_raise_value_error_naming_index_and_field(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)
    for template in TEMPLATES:
        with pytest.raises(ValueError, match=match):
            render_chat(messages, template=template)


def test_bad_tools_and_template():
    hi = [{"role": "user", "content": "hi"}]
    for tools, match in (({}, "tools must be a list"), ([], "must not be an empty"), ([1], r"tools\[0\]"),
                         ([{"type": "code", "function": {"name": "f"}}], r"tools\[0\]"),
                         ([{"function": {"name": "f", "parameters": "x"}}], r"tools\[0\]\.function\.parameters")):
        with pytest.raises(ValueError, match=match):
            render_chat(hi, tools)
    with pytest.raises(ValueError, match="unknown chat template"):
        render_chat(hi, template="llama")


def test_qwen35_template_errors_mirrored(official_templates):
    import jinja2

    for messages in ([{"role": "system", "content": "s"}],
                     [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}]):
        with pytest.raises(jinja2.TemplateError):
            jinja_render(official_templates["qwen3.5"], "qwen3.5", messages, None)
        with pytest.raises(ValueError):
            render_chat(messages, template="qwen3.5")
