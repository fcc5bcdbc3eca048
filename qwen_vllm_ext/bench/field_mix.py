"""Seeded request bodies over every field that changes the prompt or the reservation (chat, completions and
Anthropic messages).

Used by the gateway's field-coverage test and by TokenStorm's ``--field-mix`` workload: each body sets a random
subset of the fields :mod:`qwen_vllm_ext.gateway.request_fields` classifies as prompt, output, scope or reject,
with values vLLM accepts and values the gateway must refuse. :func:`fields_set` says which table fields a body
sets, so a test can check that the mix covers the whole table.
"""
from __future__ import annotations

import random

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Good morning"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}],
    [{"role": "user", "content": "写一首关于春天的短诗。"}],
    # words the official Qwen3.5/3.6 merges join and a rank-capped merge list did not (issue 46)
    [{"role": "user", "content": "Это является важным вопросом, и они являются экспертами."}],
    [{"role": "system", "content": "人力资源和社会保障部发布通知。"},
     {"role": "user", "content": "قال المصري إن نسبة البطالة أخرى، Kami akan melanjutkan diskusi."}],
]
_CONTINUABLE = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "one two"}]
_PROMPTS = ["hi", "def fib(n):", "The quick brown fox", "数字 12345 和 emoji 🙂", " leading space\nnew line",
            "人力资源市场稳定。", "Они являются экспертами", "المصري نسبة أخرى"]


def _maybe(rng: random.Random, p: float = 0.5) -> bool:
    return rng.random() < p


def chat_body(rng: random.Random, model: str) -> dict:
    body: dict = {"messages": [dict(m) for m in rng.choice(_CONVERSATIONS)]}
    pick = rng.random()
    if pick < 0.7:
        body["model"] = model
    elif pick < 0.85:
        body["model"] = None
    if _maybe(rng, 0.3):
        body["tools"] = TOOLS
        # vLLM defaults tool_choice to "auto" when tools are given, which needs a tool parser on the server
        body["tool_choice"] = rng.choice(["none"] * 6 + ["auto", None])
        if body["tool_choice"] is None:
            del body["tool_choice"]
    if _maybe(rng, 0.4):
        body["reasoning_effort"] = rng.choice(["none", "low", "high"])
    if _maybe(rng, 0.4):
        body["chat_template_kwargs"] = rng.choice([{}, {"enable_thinking": False}, {"enable_thinking": True},
                                                   {"enable_thinking": None}, {"preserve_thinking": False},
                                                   {"add_generation_prompt": False}])
    if _maybe(rng, 0.2):
        body["documents"] = [{"title": "note", "text": "a document the Qwen templates do not render"}]
    if _maybe(rng, 0.15):
        body["messages"] = [dict(m) for m in _CONTINUABLE]
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    elif _maybe(rng, 0.2):
        body["add_generation_prompt"] = rng.choice([True, False])
    _common(rng, body, max_name=rng.choice(["max_tokens", "max_completion_tokens"]))
    if _maybe(rng, 0.15):
        body["echo"] = True
    if _maybe(rng, 0.05):
        body["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"  # refused: cannot count
    return body


def completion_body(rng: random.Random, model: str) -> dict:
    shape = rng.randrange(4)
    if shape == 0:
        prompt = rng.choice(_PROMPTS)
    elif shape == 1:
        prompt = rng.sample(_PROMPTS, rng.randint(1, 3))
    elif shape == 2:
        prompt = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 12))]
    else:
        prompt = [[rng.randrange(100, 5000) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]
    body: dict = {"prompt": prompt}
    if _maybe(rng, 0.8):
        body["model"] = model
    _common(rng, body, max_name="max_tokens")
    if _maybe(rng, 0.2):
        body["echo"] = True
    if _maybe(rng, 0.04):
        body["suffix"] = "return x"  # refused: fill-in-the-middle
    if _maybe(rng, 0.04):
        body["prompt_embeds"] = "AAAA"  # refused: no tokens to count
    return body


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
_ANTHROPIC_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": [{"type": "thinking", "thinking": "Two and two.", "signature": "s"},
                                       {"type": "text", "text": "4"}]},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                        "input": {"city": "Paris"}}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
    [{"role": "user", "content": "写一首关于春天的短诗。"}],
]


def messages_body(rng: random.Random, model: str) -> dict:
    """An Anthropic ``/v1/messages`` body (``max_tokens`` and ``model`` are required there)."""
    body: dict = {"model": model, "max_tokens": rng.randint(1, 4),
                  "messages": [dict(m) for m in rng.choice(_ANTHROPIC_CONVERSATIONS)]}
    if _maybe(rng, 0.4):
        body["system"] = rng.choice(["You are terse.", [{"type": "text", "text": "Be brief."},
                                                        {"type": "text", "text": "Answer in English."}]])
    if _maybe(rng, 0.3):
        body["tools"] = ANTHROPIC_TOOLS
        if _maybe(rng, 0.3):
            body["tool_choice"] = {"type": "none"}
    if _maybe(rng, 0.3):
        body["thinking"] = rng.choice([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024},
                                       {"type": "adaptive"}])
    if _maybe(rng, 0.2):
        body["output_config"] = {"effort": rng.choice(["low", "medium", "high"])}
    if _maybe(rng, 0.2):
        body["chat_template_kwargs"] = rng.choice([{"enable_thinking": False}, {"preserve_thinking": False}])
    if _maybe(rng, 0.1):
        body["stop_sequences"] = ["\n\n"]
    return body


def _common(rng: random.Random, body: dict, max_name: str) -> None:
    """Output bounds, parallel samples, truncation and special tokens, shared by both kinds."""
    if _maybe(rng, 0.85):
        body[max_name] = rng.randint(1, 4)
    if _maybe(rng, 0.3):
        body["n"] = rng.randint(1, 3)
    if _maybe(rng, 0.2):
        body["min_tokens"] = rng.randint(0, 1)
    if _maybe(rng, 0.2):
        body["truncate_prompt_tokens"] = rng.choice([3, 6, 1000, -1])  # -1 is refused
        if _maybe(rng):
            body["truncation_side"] = rng.choice(["left", "right"])
    if _maybe(rng, 0.2):
        body["add_special_tokens"] = rng.choice([True, False])
    if _maybe(rng, 0.05):
        body["use_beam_search"] = True  # refused
    body["ignore_eos"] = True  # the output length is the reservation's bound, so overshoot would show


def storm_extras(rng: random.Random, probability: float) -> tuple[dict, dict, int]:
    """TokenStorm's ``--field-mix``: with ``probability``, prompt-changing fields for one chat request.

    Returns (fields to add to the request, the matching calculator kwargs, n). The calculator kwargs say what
    the fields do to the prompt (independently of the gateway's own admission code, so the storm checks it):
    ``reasoning_effort: "none"`` and ``enable_thinking: false`` add the empty think block, ``tools`` with
    ``tool_choice: "none"`` render the tool list, ``n`` multiplies the output.
    """
    if rng.random() >= probability:
        return {}, {}, 1
    fields: dict = {}
    calc: dict = {}
    pick = rng.randrange(3)
    if pick == 0:
        fields["reasoning_effort"] = rng.choice(["none", "low"])
        calc["enable_thinking"] = fields["reasoning_effort"] != "none"
    elif pick == 1:
        fields["chat_template_kwargs"] = {"enable_thinking": False}
        calc["enable_thinking"] = False
    if rng.random() < 0.5:
        fields["tools"], fields["tool_choice"] = TOOLS, "none"
        calc["tools"] = TOOLS
    n = 2 if rng.random() < 0.3 else 1
    if n > 1:
        fields["n"] = n
    return fields, calc, n


PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "messages": "/v1/messages"}
_MAKERS = {"chat": chat_body, "completion": completion_body, "messages": messages_body}


def bodies(seed: int, count: int, model: str, kinds=("chat", "completion", "messages")) -> list[tuple[str, dict]]:
    """``count`` (kind, body) pairs, kinds alternating, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [(kinds[i % len(kinds)], _MAKERS[kinds[i % len(kinds)]](rng, model)) for i in range(count)]


def fields_set(body: dict, table: dict) -> set[str]:
    """The fields of ``table`` (a :mod:`request_fields` table) that ``body`` sets."""
    return {name for name in body if name in table}


# ---- every field vLLM's request models accept, with values a client would send (issue 46) -------------------------
_JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"]}
_COMMON_VALUES: dict[str, list] = {
    "model": [None], "max_tokens": [3], "n": [2], "min_tokens": [2], "truncate_prompt_tokens": [3],
    "truncation_side": ["left"], "add_special_tokens": [False], "use_beam_search": [True],
    "frequency_penalty": [0.5, -1.0], "presence_penalty": [0.7], "repetition_penalty": [1.2],
    "logit_bias": [{"100": 5, "200": -100}], "seed": [7, 0], "stop": ["\n", ["the", "a"]], "stream": [True],
    "stream_options": [{"include_usage": True, "continuous_usage_stats": True}],
    "temperature": [0.0, 1.5], "top_p": [0.3], "top_k": [5, -1], "min_p": [0.1], "user": ["end-user-7"],
    "watermarking": [True, False], "length_penalty": [1.0], "stop_token_ids": [[100, 151643]],
    "include_stop_str_in_output": [True], "ignore_eos": [True], "skip_special_tokens": [False],
    "spaces_between_special_tokens": [False], "allowed_token_ids": [[100, 200, 300, 400]], "prompt_logprobs": [2],
    "logprob_token_ids": [[100, 200]], "bad_words": [["the", " and"]],
    "response_format": [{"type": "json_object"}, {"type": "json_schema",
                                                  "json_schema": {"name": "a", "schema": _JSON_SCHEMA}}],
    "structured_outputs": [{"choice": ["yes", "no"]}, {"regex": "[a-z]{1,3}"}, {"json": _JSON_SCHEMA}],
    "priority": [0, 3], "request_id": ["client-chosen-id"], "session_id": ["session-7"],
    "return_tokens_as_token_ids": [True], "return_token_ids": [True], "routed_experts_prompt_start": [1],
    "return_token_offsets": [True], "mm_payload": ["none"], "return_mm_kwargs": [False], "cache_salt": ["salt-7"],
    "kv_transfer_params": [{}], "ec_transfer_params": [{}], "vllm_xargs": [{"note": 1}],
    "repetition_detection": [{"max_pattern_size": 4, "min_count": 3}], "thinking_token_budget": [8],
    "stream_interval": [2], "echo": [True],
}
FIELD_VALUES: dict[str, dict[str, list]] = {
    "chat": {**_COMMON_VALUES,
             "messages": [[{"role": "user", "content": "Это является важным вопросом"}]],
             "tools": [TOOLS], "tool_choice": ["none"], "reasoning_effort": ["low", "none"],
             "chat_template_kwargs": [{"enable_thinking": False}], "documents": [[{"title": "t", "text": "d"}]],
             "add_generation_prompt": [False], "continue_final_message": [True], "max_completion_tokens": [3],
             "chat_template": ["{% for m in messages %}{{ m.content }}{% endfor %}"], "logprobs": [True],
             "top_logprobs": [2], "media_io_kwargs": [{}], "mm_processor_kwargs": [{}], "include_reasoning": [False],
             "parallel_tool_calls": [False], "return_prompt_text": [True]},
    "completion": {**_COMMON_VALUES, "prompt": [[100, 200, 300], "人力资源市场稳定。"], "logprobs": [2],
                   "suffix": ["return x"], "prompt_embeds": ["AAAA"]},
}
"""Per request kind, values of every field of vLLM's request models (``tests/e2e/field_sweep.py`` checks the table
holds every field the installed vLLM accepts): each sent alone on a minimal request, and mixed in concurrent batches.
Some are refused by design (``use_beam_search``, ``chat_template``, ``suffix``, ``prompt_embeds``: the gateway
cannot count them) or by vLLM (``continue_final_message`` with the generation prompt on, ``top_logprobs`` without
``logprobs``): a 400 naming the field."""


def field_combination(rng: random.Random, kind: str, fields: int) -> dict:
    """``fields`` fields of :data:`FIELD_VALUES` with one of their values each (the mixed batches of the sweep)."""
    table = FIELD_VALUES[kind]
    return {name: rng.choice(table[name]) for name in rng.sample(sorted(table), fields)}
