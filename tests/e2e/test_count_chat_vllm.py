"""E2E: ``count_chat`` (Qwen3 template) equals vLLM's ``usage.prompt_tokens`` on the demo server, exactly.

The demo server serves the package's prefix-stable ``qwen3-reuse`` template (KV-reuse mode, the launcher's default
for Qwen3 models) with the generated Qwen3 tokenizer; ``preserve_thinking=false`` per request renders exactly as
the official Qwen3 template (tests/unit/test_kv_reuse_template.py), so both are checked here (``mode``). Each seeded
conversation of tests/helpers/conversations.py, the ones tests/unit/test_chat_count.py checks (system/no system,
multi-turn, reasoning in earlier turns, tools, tool calls with string and dict arguments, consecutive tool results,
content parts, CJK, emoji, leading newlines, enable_thinking None/True/False) is sent with ``max_tokens=1``. The
demo server has no tool-call parser, so requests with tools use ``tool_choice="none"`` (vLLM still renders the tools).
"""
from __future__ import annotations

import json

import pytest

from qwen_v3_calculator.chat import count_chat
from qwen_vllm_ext.demo import SERVED_NAME
from tests.helpers.chat_reference import HFAdapter
from tests.helpers.conversations import CONVERSATIONS

EXTRA = {  # request options beyond the conversations: (messages, tools, count_chat kwargs)
    "no_generation_prompt": ([{"role": "user", "content": "Finish this"}, {"role": "assistant", "content": "OK."}],
                             None, {"add_generation_prompt": False}),
    "continue_final_message": ([{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}],
                               None, {"add_generation_prompt": False, "continue_final_message": True}),
    "reasoning_effort_none": ([{"role": "user", "content": "quick"}], None, {"reasoning_effort": "none"}),
    "reasoning_field": ([{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a", "reasoning": "thought"},
                         {"role": "tool", "content": "t"}], None, {}),
}
CASES = {**CONVERSATIONS, **EXTRA}


@pytest.fixture(scope="module")
def reference_tokenizer(qwen3_tokenizer_dir):
    """HF ``tokenizers`` on the same generated Qwen3 tokenizer.json the demo model ships."""
    return HFAdapter(qwen3_tokenizer_dir / "tokenizer.json")


def _wire(messages):
    """OpenAI wire format: tool-call arguments are JSON strings (vLLM's request schema requires it)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                   if isinstance(c["function"]["arguments"], str)
                                   else json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                for c in m["tool_calls"]]}
        out.append(m)
    return out


MODES = {"reuse": ("qwen3-reuse", {}), "stock": ("qwen3", {"preserve_thinking": False})}


def vllm_prompt_tokens(client, messages, tools, kwargs, mode: str = "reuse") -> int:
    extra = {}
    options = dict(kwargs)
    template_kwargs = dict(MODES[mode][1])
    if options.get("enable_thinking") is not None:
        template_kwargs["enable_thinking"] = options["enable_thinking"]
    if template_kwargs:
        extra["chat_template_kwargs"] = template_kwargs
    for key in ("add_generation_prompt", "continue_final_message"):
        if key in options:
            extra[key] = options[key]
    body = dict(model=SERVED_NAME, messages=_wire(messages), max_tokens=1, temperature=0, extra_body=extra)
    if "reasoning_effort" in options:
        body["reasoning_effort"] = options["reasoning_effort"]
    if tools:
        body.update(tools=tools, tool_choice="none")
    return client.chat.completions.create(**body).usage.prompt_tokens


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_count_chat_equals_vllm_prompt_tokens(openai_client, reference_tokenizer, name, mode):
    messages, tools, kwargs = CASES[name]
    template = MODES[mode][0]
    expected = vllm_prompt_tokens(openai_client, messages, tools, kwargs, mode)
    assert count_chat(messages, reference_tokenizer, tools=tools, template=template, **kwargs) == expected
    # the OpenAI wire form (arguments as JSON strings) counts the same
    assert count_chat(_wire(messages), reference_tokenizer, tools=tools, template=template, **kwargs) == expected


def test_count_chat_with_default_tokenizer_equals_vllm(openai_client):
    """The bundled tokenizer (``tokenizer=None``) gives the same counts as the server."""
    for name in ("single_user", "consecutive_tool_results", "seed3", "seed7"):
        messages, tools, kwargs = CASES[name]
        assert count_chat(messages, tools=tools, template="qwen3-reuse", **kwargs) == vllm_prompt_tokens(
            openai_client, messages, tools, kwargs), name


EDGE_MESSAGES = [  # preprocessing corners, checked against vLLM's own parser below
    {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=9\nBe brief."},
                                   "plain", {"type": "input_text", "text": "x-anthropic-billing-header: kept"}]},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None},
                                 {"type": "text", "text": ""}, {"type": "refusal", "refusal": "r"}, "s"]},
    {"role": "assistant", "content": None, "reasoning_content": "why", "name": "bot",
     "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}},
                    {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "t1"}, {"type": "text", "text": ""},
                                                      {"type": "text", "text": "t2"}]},
    {"role": "tool", "tool_call_id": "2"},
    {"role": "developer", "content": "dev"},
    {"role": "user", "content": "last"},
]


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_preprocessing_equals_vllm_parser(content_format):
    """normalize_messages/normalize_tools == vLLM's request validation + parse_chat_messages + developer
    handling + tool model_dump, for both content formats (Qwen2.5/3 read strings; Qwen3.5 iterates parts).
    No server needed; this is what the Qwen3.5 template receives, which the demo server cannot show."""
    import types

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import _consolidate_system_messages, _convert_developer_to_system

    from qwen_v3_calculator.chat import normalize_messages, normalize_tools

    model_config = types.SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None)
    cases = {**CASES, "edge": (EDGE_MESSAGES, None, {})}
    for name, (messages, tools, _) in cases.items():
        request = ChatCompletionRequest(model=SERVED_NAME, messages=_wire(messages), tools=tools,
                                        tool_choice="none" if tools else None)
        conv, _, _ = parse_chat_messages(request.messages, model_config, content_format)
        if any(m["role"] == "developer" for m in conv):
            conv = _consolidate_system_messages(_convert_developer_to_system(conv))
        assert json.dumps(normalize_messages(messages, content_format), sort_keys=True) == json.dumps(
            conv, sort_keys=True), name
        expected_tools = [t.model_dump() for t in request.tools] if request.tools else None
        assert json.dumps(normalize_tools(tools)) == json.dumps(expected_tools), name
