"""Gateway admission as pure functions: the model the engine will serve is what the key's scope is checked
against, every prompt-changing field is counted the way vLLM applies it (or refused with a 400 naming it), and
the rule for n (prompt once, output n times)."""
from __future__ import annotations

import dataclasses

import pytest

from qwen_v3_calculator import Calculator
from qwen_vllm_ext.gateway.admission import Rejection, Served, admit, count_prompts, template_kwargs
from qwen_vllm_ext.gateway.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, REJECT, REJECT_REASONS
from qwen_vllm_ext.usage.ledger import LedgerRecord

HI = [{"role": "user", "content": "hi"}]  # 9 tokens with the Qwen3 templates (generation prompt included)


@dataclasses.dataclass
class Key:
    models: tuple = ()
    max_tokens_cap: int | None = None

    def allows_model(self, name):
        return not self.models or name in self.models


@pytest.fixture(scope="module")
def served():
    return Served(Calculator(template="qwen3"), 4096, names=("qwen3-demo", "alias"),
                  engine_fields={"chat": frozenset(CHAT_FIELDS) | {"brand_new_field"},
                                 "completion": frozenset(COMPLETION_FIELDS)})


def rejection(fn, *args, **kwargs) -> Rejection:
    with pytest.raises(Rejection) as exc:
        fn(*args, **kwargs)
    return exc.value


@pytest.mark.parametrize("body", [{}, {"model": None}, {"model": ""}], ids=["missing", "null", "empty"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_scope_is_checked_against_the_default_model_when_none_is_named(served, body, kind):
    request = {**body, "messages": HI} if kind == "chat" else {**body, "prompt": "hi"}
    rej = rejection(admit, dict(request), kind, Key(models=("other-model",)), served)
    assert (rej.status, rej.code, rej.param) == (403, "model_not_allowed", "model")
    assert "qwen3-demo" in rej.message and "default model" in rej.message
    admitted = admit(dict(request), kind, Key(models=("qwen3-demo",)), served)
    assert admitted.model == "qwen3-demo"


def test_scope_names_and_types(served):
    assert admit({"model": "alias", "messages": HI}, "chat", Key(models=("alias",)), served).model == "alias"
    assert rejection(admit, {"model": "qwen3-demo", "messages": HI}, "chat", Key(models=("alias",)), served).status == 403
    assert rejection(admit, {"model": 7, "messages": HI}, "chat", None, served).status == 400
    assert admit({"messages": HI}, "chat", Key(), served).model == "qwen3-demo"  # unscoped key: anything served


def test_reasoning_effort_is_counted_as_vllm_renders_it(served):
    calc = served.calculator
    base = count_prompts({"messages": HI}, "chat", served)[0]
    off = calc.count_chat(HI, enable_thinking=False)
    assert off == base + 4  # <think>\n\n</think>\n\n
    assert count_prompts({"messages": HI, "reasoning_effort": "none"}, "chat", served) == [off]
    assert count_prompts({"messages": HI, "reasoning_effort": "high"}, "chat", served) == [base]
    # an explicit enable_thinking in chat_template_kwargs wins over reasoning_effort (vLLM sets it only if absent)
    body = {"messages": HI, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    assert count_prompts(body, "chat", served) == [base]
    # ... and a None there is dropped by vLLM's merge: the template sees no enable_thinking at all
    body = {"messages": HI, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": None}}
    assert count_prompts(body, "chat", served) == [base]


def test_server_default_template_kwargs_apply_under_the_request_ones(served):
    calc = served.calculator
    off_by_default = dataclasses.replace(served, template_defaults={"enable_thinking": False})
    off = calc.count_chat(HI, enable_thinking=False)
    assert count_prompts({"messages": HI}, "chat", off_by_default) == [off]
    on = {"messages": HI, "chat_template_kwargs": {"enable_thinking": True}}
    assert count_prompts(on, "chat", off_by_default) == [off - 4]
    assert count_prompts({"messages": HI, "reasoning_effort": "low"}, "chat", off_by_default) == [off - 4]
    # the request's top-level add_generation_prompt wins over the same key in chat_template_kwargs
    merged = template_kwargs({"messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert merged["add_generation_prompt"] is True


def test_continue_final_message_and_generation_prompt(served):
    calc = served.calculator
    conv = [*HI, {"role": "assistant", "content": "hello the"}]
    body = {"messages": conv, "add_generation_prompt": False, "continue_final_message": True}
    assert count_prompts(body, "chat", served) == [calc.count_chat(conv, add_generation_prompt=False,
                                                                         continue_final_message=True)]
    assert count_prompts({"messages": HI, "add_generation_prompt": False}, "chat", served) == [
        calc.count_chat(HI, add_generation_prompt=False)]
    both = {"messages": conv, "continue_final_message": True}  # add_generation_prompt defaults to true
    assert rejection(count_prompts, both, "chat", served).status == 400


def test_tool_choice_none_drops_tools_only_with_the_server_flag(served):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"messages": HI, "tools": tools, "tool_choice": "none"}
    with_tools = count_prompts(body, "chat", served)[0]
    assert with_tools > 9
    flagged = dataclasses.replace(served, exclude_tools_when_tool_choice_none=True)
    assert count_prompts(body, "chat", flagged) == [9]


def test_truncation_is_applied_and_minus_one_refused(served):
    assert count_prompts({"prompt": "one two three four five six", "truncate_prompt_tokens": 3}, "completion",
                         served) == [3]
    assert count_prompts({"messages": HI, "truncate_prompt_tokens": 5}, "chat", served) == [5]
    assert count_prompts({"messages": HI, "truncate_prompt_tokens": 50}, "chat", served) == [9]
    rej = rejection(count_prompts, {"messages": HI, "truncate_prompt_tokens": -1}, "chat", served)
    assert (rej.status, rej.code, rej.param) == (400, "unsupported_parameter", "truncate_prompt_tokens")


def test_completion_prompt_shapes(served):
    assert count_prompts({"prompt": [[1, 2, 3], [4, 5]]}, "completion", served) == [3, 2]
    assert count_prompts({"prompt": [1, 2, 3]}, "completion", served) == [3]
    assert count_prompts({"prompt": ["hi", "hi there"]}, "completion", served) == [1, 2]
    for bad in ([], [[]], [[1], "x"], [True], None, 3):
        assert rejection(count_prompts, {"prompt": bad}, "completion", served).code == "invalid_request_error"


@pytest.mark.parametrize("kind,field,value", [
    ("chat", "use_beam_search", True), ("completion", "use_beam_search", True),
    ("chat", "chat_template", "{{ messages }}"), ("completion", "suffix", "def f():"),
    ("completion", "prompt_embeds", "AAAA"),
])
def test_fields_the_gateway_cannot_count_are_refused_by_name(served, kind, field, value):
    body = {"messages": HI} if kind == "chat" else {"prompt": "hi"}
    rej = rejection(admit, {**body, field: value}, kind, None, served)
    assert (rej.status, rej.code, rej.param) == (400, "unsupported_parameter", field)
    assert REJECT_REASONS[field] in rej.message
    admit({**body, field: False if field == "use_beam_search" else None}, kind, None, served)  # defaults pass


def test_every_reject_field_has_a_reason():
    for table in (CHAT_FIELDS, COMPLETION_FIELDS):
        assert {f for f, h in table.items() if h == REJECT} <= set(REJECT_REASONS)


def test_unclassified_engine_fields_and_template_kwargs_are_refused(served):
    rej = rejection(admit, {"messages": HI, "brand_new_field": 1}, "chat", None, served)
    assert (rej.code, rej.param) == ("unsupported_parameter", "brand_new_field")
    # one rule for fields nobody reads: refused naming the field, unless IGNORED lists them (OpenAI's and OpenRouter's
    # bookkeeping and routing fields)
    rej = rejection(admit, {"messages": HI, "frobnicate": True}, "chat", None, served)
    assert (rej.status, rej.code, rej.param) == (400, "unknown_parameter", "frobnicate") and "'frobnicate'" in rej.message
    rej = rejection(admit, {"prompt": "hi", "max_token": 5}, "completion", None, served)
    assert (rej.code, rej.param) == ("unknown_parameter", "max_token")
    for field in ("reasoning", "functions", "function_call"):  # read by other servers: never silently dropped
        assert rejection(admit, {"messages": HI, field: {}}, "chat", None, served).param == field
    admit({"messages": HI, "store": False, "metadata": {"a": "b"}, "service_tier": "auto", "provider": {"order": []},
           "usage": {"include": True}, "prompt_cache_key": "k"}, "chat", None, served)
    rej = rejection(admit, {"messages": HI, "chat_template_kwargs": {"tools": []}}, "chat", None, served)
    assert (rej.code, rej.param) == ("unsupported_parameter", "chat_template_kwargs")


def test_the_rule_for_n_prompt_once_output_n_times(served):
    a = admit({"messages": HI, "max_tokens": 10, "n": 3}, "chat", None, served)
    assert (a.prompt_tokens, a.completion_tokens, a.cost) == (9, 30, 39)
    a = admit({"prompt": ["hi", "hi there"], "max_tokens": 4, "n": 2}, "completion", None, served)
    assert (a.prompt_tokens, a.completion_tokens, a.cost) == (3, 16, 19)
    record = LedgerRecord(request_id="r", instance_id="i", model="m", endpoint="/v1/chat/completions",
                          status="stop", http_status=200, prompt_tokens=9, cached_tokens=0, completion_tokens=20,
                          reasoning_tokens=0, engine_prompt_tokens=18, billed_prompt_micro=0,
                          billed_completion_micro=0, received_at=1.0, finished_at=2.0, ttft_s=None, latency_s=1.0,
                          streamed=False)
    assert record.usage_tokens == 29  # what usage says; the engine prefilled the prompt once per sample
    assert dataclasses.replace(record, engine_prompt_tokens=0, completion_tokens=0).usage_tokens == 0


def test_error_bodies_are_openai_shaped_and_anthropic_shaped_on_messages_routes():
    import json

    from qwen_vllm_ext.gateway.middleware import error_payload

    plain = json.loads(error_payload("rate_limit_exceeded", "slow down", "tokens"))
    assert plain == {"error": {"message": "slow down", "type": "tokens", "param": None, "code": "rate_limit_exceeded"}}
    anthropic = json.loads(error_payload("rate_limit_exceeded", "slow down", "tokens", anthropic=True))
    assert anthropic == {"type": "error", **plain}
