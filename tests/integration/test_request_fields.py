"""The gateway's field table against the installed vLLM's request models: a field vLLM reads that the table does
not classify is a failing test (and, at runtime, a 400 for requests that set it), never a silent gap."""
from __future__ import annotations

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from qwen_vllm_ext.gateway import vllm_requests
from qwen_vllm_ext.gateway.request_fields import FIELDS, PROMPT


def test_every_vllm_request_field_is_classified():
    for kind, model in (("chat", ChatCompletionRequest), ("completion", CompletionRequest)):
        missing = sorted(set(model.model_fields) - set(FIELDS[kind]))
        assert not missing, f"{model.__name__} fields the gateway does not classify: {missing}"


def test_the_glue_reads_the_same_fields_the_table_is_checked_against():
    fields = vllm_requests.request_fields()
    assert fields["chat"] == frozenset(ChatCompletionRequest.model_fields)
    assert fields["completion"] == frozenset(CompletionRequest.model_fields)


def test_the_prompt_fields_are_the_ones_vllm_renders_or_tokenizes_with():
    """Cross-check against vLLM's own code: the fields build_chat_params/build_tok_params read are PROMPT."""
    import inspect

    chat_src = inspect.getsource(ChatCompletionRequest.build_chat_params) + inspect.getsource(
        ChatCompletionRequest.build_tok_params)
    for name in ("add_generation_prompt", "continue_final_message", "documents", "reasoning_effort",
                 "chat_template_kwargs", "truncate_prompt_tokens", "truncation_side", "add_special_tokens"):
        assert f"self.{name}" in chat_src, name
        assert FIELDS["chat"][name] == PROMPT, name


def test_every_anthropic_messages_field_is_classified():
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    missing = sorted(set(AnthropicMessagesRequest.model_fields) - set(FIELDS["messages"]))
    assert not missing, f"AnthropicMessagesRequest fields the gateway does not classify: {missing}"
    assert vllm_requests.request_fields()["messages"] == frozenset(AnthropicMessagesRequest.model_fields)


def test_the_anthropic_glue_targets_exist():
    """The gateway converts /v1/messages with vLLM's own converter and the serving object's probes."""
    import importlib
    import inspect

    for target in vllm_requests.TARGETS:
        module, cls, attr = target.rsplit(".", 2)
        owner = getattr(importlib.import_module(module), cls)
        if attr.startswith("_merge"):  # an instance attribute set in __init__
            assert f"self.{attr} =" in inspect.getsource(owner.__init__), target
        else:
            assert callable(getattr(owner, attr)), target
