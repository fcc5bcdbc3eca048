"""Chats to render and count: handwritten edge cases and a seeded set of random ones (system or not, multi-turn,
reasoning in earlier turns, tools, tool calls with string and dict arguments, consecutive tool results, content
parts, CJK, emoji, leading newlines, enable_thinking None/True/False). ``CONVERSATIONS`` maps a name to
``(messages, tools, kwargs)``; the unit tests check the renderers and counters on it against the official templates,
tests/e2e/test_count_chat_vllm.py against a real vLLM server."""
import random

TEXTS = [
    "hi", "What is 2 + 2?", "你好，世界！今天北京的天气怎么样？", "東京タワーの高さは？ 한국어도 좋아요.",
    "emoji 👋🏽 👨‍👩‍👧‍👦 🇯🇵 ✅", "\nstarts with a newline", "\n\n  indented after blank lines",
    "  leading spaces and trailing  ", "naïve café — “quotes” ‘and’ …", "tabs\tand\r\nCRLF\r\n",
    "```python\ndef f(x):\n    return x ** 2\n```", "numbers 1234567 3.14159 -0.5e10",
    "literal <think>tags</think> and <tool_call> in user text", "ends with newline\n",
    "<tool_response>\nlooks like a tool result\n</tool_response>", "Ünïcödé NFC: e\u0301 vs é; Zero\u200bwidth",
]
REASONINGS = ["Let me think step by step.", "\nThe user wants weather.\n", "首先，分析问题。", "  "]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. 北京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "top_k": {"type": "integer", "default": 5, "minimum": 1.0}}}}},
    {"type": "function", "function": {"name": "no_params", "description": "Takes nothing — 不需要参数", "strict": True}},
]
ARGS = [
    '{"city": "北京", "unit": "celsius"}', '{"query": "vLLM \\"quoted\\" 🚀", "top_k": 3}', "{}", "",
    '{"nested": {"a": [1, 2.5, null, true]}, "flag": false, "n": null, "f": 0.1, "big": 12345678901234567890}',
    '{"bad json', "[1, 2]", '{"multi": "line\\nvalue", "list": ["x", {"y": 1}]}',
]


def _tool_call(rng, k):
    return {"id": f"call_{k}", "type": "function",
            "function": {"name": rng.choice(["get_weather", "search", "no_params"]), "arguments": rng.choice(ARGS)}}


def _assistant(rng, with_tools, k):
    content = rng.choice(TEXTS + ["", ""])
    msg = {"role": "assistant", "content": content}
    style = rng.random()
    if style < 0.3:
        msg["reasoning_content"] = rng.choice(REASONINGS)
    elif style < 0.55:
        msg["content"] = "<think>\n" + rng.choice(REASONINGS) + "\n</think>\n\n" + content
    if with_tools and rng.random() < 0.5:
        msg["tool_calls"] = [_tool_call(rng, k + j) for j in range(rng.choice([1, 1, 2, 3]))]
        if rng.random() < 0.3:
            msg["content"] = None
    return msg


def random_conversation(seed: int):
    """(messages, tools, kwargs): a seeded multi-turn chat with optional tools, reasoning and tool results."""
    rng = random.Random(seed)
    tools = rng.sample(TOOLS, rng.randint(1, 3)) if rng.random() < 0.5 else None
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": rng.choice(["You are a helpful assistant.", "简洁地回答。",
                                                                  "\nSystem with leading newline", "🤖 Be brief."])})
    for turn in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": rng.choice(TEXTS)})
        if turn == 0 and rng.random() < 0.2:  # OpenAI content parts
            messages[-1]["content"] = [{"type": "text", "text": rng.choice(TEXTS)},
                                       {"type": "text", "text": rng.choice(TEXTS)}]
        for _ in range(rng.randint(0, 2)):
            msg = _assistant(rng, tools is not None, 10 * turn)
            messages.append(msg)
            for call in msg.get("tool_calls", []):  # consecutive tool results
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": rng.choice(TEXTS)})
            if not msg.get("tool_calls"):
                break
    if rng.random() < 0.3 and messages[-1]["role"] != "assistant":
        messages.append(_assistant(rng, tools is not None, 99))
        if messages[-1].get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": "call_99", "content": "42"})
    kwargs = {"enable_thinking": rng.choice([None, True, False])}
    return messages, tools, kwargs


WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
HANDWRITTEN = {
    "single_user": ([{"role": "user", "content": "hi"}], None, {}),
    "with_system": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}], None, {}),
    "multi_turn": ([{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another?"}], None, {"enable_thinking": False}),
    "reasoning_dropped_before_last_query": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
         {"role": "assistant", "content": "Also 4.", "reasoning_content": "double-check"},
         {"role": "user", "content": "And 3+3?"}], None, {}),
    "reasoning_kept_after_last_query": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [WEATHER_CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}], TOOLS[:1], {}),
    "consecutive_tool_results": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris and 東京?"},
         {"role": "assistant", "content": "Checking both.", "tool_calls": [
             WEATHER_CALL, {"id": "call_2", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "21°C ☀️"},
         {"role": "tool", "tool_call_id": "call_2", "content": "18°C 🌧"},
         {"role": "assistant", "content": "Paris 21°C, Tokyo 18°C."},
         {"role": "user", "content": "\nThanks! 🙏"}], TOOLS, {"enable_thinking": True}),
    "content_parts_and_newline": (
        [{"role": "user", "content": [{"type": "text", "text": "\nfirst"}, {"type": "text", "text": ""},
                                      {"type": "text", "text": "second 第二"}]}], None, {}),
    "developer_role": ([{"role": "developer", "content": "Answer in French."},
                        {"role": "user", "content": "Good morning"}], None, {}),
    "tool_without_description": (
        [{"role": "user", "content": "ping"}], [TOOLS[2], TOOLS[1]], {"enable_thinking": False}),
    "null_assistant_content": (
        [{"role": "user", "content": "search it"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c", "type": "function", "function": {"name": "search", "arguments": ARGS[4]}}]},
         {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "r1"},
                                                            {"type": "text", "text": "r2"}]},
         {"role": "user", "content": "ok"}], TOOLS[1:2], {}),
}
CONVERSATIONS = {**HANDWRITTEN, **{f"seed{seed}": random_conversation(seed) for seed in range(40)}}
