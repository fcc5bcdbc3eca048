"""Seeded request bodies over every field that changes the prompt or the reservation (chat and completions).

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
]
_CONTINUABLE = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "one two"}]
_PROMPTS = ["hi", "def fib(n):", "The quick brown fox", "数字 12345 和 emoji 🙂", " leading space\nnew line"]


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


def bodies(seed: int, count: int, model: str, kinds=("chat", "completion")) -> list[tuple[str, dict]]:
    """``count`` (kind, body) pairs, kinds alternating, reproducible from ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        out.append((kind, chat_body(rng, model) if kind == "chat" else completion_body(rng, model)))
    return out


def fields_set(body: dict, table: dict) -> set[str]:
    """The fields of ``table`` (a :mod:`request_fields` table) that ``body`` sets."""
    return {name for name in body if name in table}
