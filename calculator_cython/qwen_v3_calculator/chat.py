"""The exact prompt vLLM builds for a chat request with an official Qwen chat template, and its token count.

``render_chat`` returns the prompt string, ``count_chat`` its token count (``tokenizer.encode`` of the prompt,
added tokens recognized, no BOS: vLLM tokenizes chat prompts with ``add_special_tokens=False``).
Supported templates: ``"qwen2.5"``, ``"qwen3"`` and ``"qwen3.5"`` (also Qwen3.6; tool calls rendered as
``<function=…><parameter=…>`` blocks), and ``"qwen3-reuse"`` / ``"qwen3.5-reuse"``: this package's prefix-stable
Qwen3 and Qwen3.5/3.6 templates (``data/qwen3-reuse.jinja``, ``data/qwen3.5-reuse.jinja``, :func:`template_path`),
which keep the ``<think>`` block of every earlier assistant turn (reasoning, or the empty block of
``enable_thinking=false``; the Qwen3.5 one also keeps the answer untrimmed) unless the template kwarg
``preserve_thinking`` is false, in which case they render exactly as the official template. Each is a
hand-written Python mirror of the official Jinja text
(``qwen_vllm_ext.common.assets.chat_template``), rendered as transformers does (``trim_blocks``, ``lstrip_blocks``,
``tojson`` = ``json.dumps(ensure_ascii=False)`` without key sorting); unit tests hold them equal to that
rendering. No jinja2 at count time.

Before rendering, the request is preprocessed as vLLM 0.32 does (``vllm/renderers/chat_utils.py``,
``renderers/hf.py``, ``entrypoints/openai/chat_completion/protocol.py``):

* content ``None``/missing -> empty; a string or a list of text parts (``text``, ``input_text``,
  ``output_text``, ``refusal``, ``thinking``; plain strings too; parts whose text is ``None`` are skipped).
  Templates that read content as a string (Qwen2.5, Qwen3) get the parts joined with ``"\\n"`` (empty parts
  dropped); Qwen3.5 iterates the parts itself and concatenates them; tool results are joined with ``"\\n"``.
* system text parts starting with ``x-anthropic-billing-header`` lose that first line.
* assistant ``reasoning`` / ``reasoning_content`` (``reasoning`` wins) reach the template as ``reasoning_content``.
* tool-call ``arguments`` JSON strings are parsed to dicts (invalid JSON, non-objects, empty -> ``{}``);
  an empty ``tool_calls`` list is dropped.
* ``developer`` messages become ``system`` and all system messages are merged into one at the front
  (the Qwen templates have no developer role).
* tool schemas are re-serialized as vLLM's pydantic model dumps them:
  ``{"type": "function", "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}}``,
  ``description``/``parameters`` kept as ``null`` when absent, unknown fields dropped.

Only text is countable: image/audio/video parts raise ``ValueError`` (their placeholder expansion depends
on the media). Malformed input raises ``ValueError`` naming the message index and field.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

__all__ = ["TEMPLATES", "REUSE_TEMPLATES", "count_chat", "render_chat", "normalize_messages", "normalize_tools",
           "validate_messages", "message_text", "template_path"]

TEMPLATES = ("qwen2.5", "qwen3", "qwen3.5")  # official templates (reference texts: qwen_vllm_ext.common.assets)
# shipped by this package: name -> file in data/
REUSE_TEMPLATES = {"qwen3-reuse": "qwen3-reuse.jinja", "qwen3.5-reuse": "qwen3.5-reuse.jinja"}
ANSWERS = "answers"
"""``preserve_thinking`` value of the reuse templates: keep turns without reasoning as generated (answers reused),
render turns with reasoning as the official template does (reasoning dropped before the last user query)."""
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_TEXT_PART_TYPES = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}  # part type -> key holding its text
_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


def _dumps(value) -> str:
    """transformers' ``tojson`` filter."""
    return json.dumps(value, ensure_ascii=False)


def _typename(value) -> str:
    return type(value).__name__


# ---------------------------------------------------------------------------------------------------
# vLLM preprocessing
# ---------------------------------------------------------------------------------------------------
def _content_texts(content, where: str, system: bool = False) -> list:
    """Texts of a message's content, as vLLM parses it (parts without text left out).

    ``system``: drop the ``x-anthropic-billing-header`` line of plain/``text`` parts, as vLLM does for
    system messages (the header changes on every request and would defeat prefix caching).
    """
    if content is None:
        return []
    if isinstance(content, str):
        content = [content]
    elif not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string, a list of content parts or null, "
                         f"not {_typename(content)}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            text, strippable = part, True
        elif not isinstance(part, dict):
            raise ValueError(f"{where}.content[{j}]: a content part must be an object or a string, "
                             f"not {_typename(part)}")
        else:
            ptype = part.get("type")
            key = _TEXT_PART_TYPES.get(ptype) if isinstance(ptype, str) else None
            if key is None:
                raise ValueError(f"{where}.content[{j}].type: only text parts can be counted, got {ptype!r}")
            text, strippable = part.get(key), ptype == "text"
            if text is None:
                continue  # vLLM skips text parts without text
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}].{key} must be a string, not {_typename(text)}")
        if system and strippable and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        texts.append(text)
    return texts


def _normalize_tool_calls(tool_calls, where: str) -> list | None:
    if tool_calls is None:
        return None
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"{where}.tool_calls must be a list, not {_typename(tool_calls)}")
    out = []
    for k, call in enumerate(tool_calls):
        w = f"{where}.tool_calls[{k}]"
        if not isinstance(call, dict):
            raise ValueError(f"{w} must be an object, not {_typename(call)}")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"{w}: only tool calls of type 'function' with a 'function' object are supported")
        if not isinstance(fn.get("name"), str):
            raise ValueError(f"{w}.function.name must be a string")
        args = fn.get("arguments")
        if not args:
            parsed = {}
        elif isinstance(args, dict):
            parsed = args
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:  # vLLM coerces malformed arguments to {} so the conversation can go on
                parsed = {}
        else:
            parsed = args
        if not isinstance(parsed, dict):
            parsed = {}
        out.append({**call, "function": {**fn, "arguments": parsed}})
    return out


def normalize_messages(messages, content_format: str = "string") -> list[dict]:
    """The conversation vLLM hands to the chat template (``content_format``: ``"string"`` or ``"openai"``).

    Raises ``ValueError`` naming the index and field of the first malformed message.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of message objects, not {_typename(messages)}")
    if not messages:
        raise ValueError("messages must not be empty")
    conv = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content', not {_typename(msg)}")
        if "role" not in msg:
            raise ValueError(f"{where}.role is missing")
        role = msg["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{where}.role: unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})")
        texts = _content_texts(msg.get("content"), where, system=role == "system")
        if content_format == "openai" and role != "tool":
            content = [{"type": "text", "text": t} for t in texts]
        elif content_format == "openai":  # tool results: text parts joined with "\n", empty ones kept
            content = "\n".join(texts)
        else:  # "string": empty parts are dropped, the rest joined with "\n"
            content = "\n".join(t for t in texts if t)
        out = {"role": role, "content": content}
        if role == "assistant":
            calls = _normalize_tool_calls(msg.get("tool_calls"), where)
            if calls:
                out["tool_calls"] = calls
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise ValueError(f"{where}.reasoning must be a string, not {_typename(reasoning)}")
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and msg.get("tool_call_id") is not None:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        conv.append(out)
    if any(m["role"] == "developer" for m in conv):
        conv = _developer_to_system(conv)
    return conv


def _developer_to_system(conv: list[dict]) -> list[dict]:
    """vLLM's ``_convert_developer_to_system`` + ``_consolidate_system_messages``."""
    conv = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conv]
    contents, rest, merge = [], [], False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or contents:
            merge = True
        c = m["content"]
        if isinstance(c, list):
            c = "\n".join(p["text"] for p in c)
        if c:
            contents.append(c)
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest] if merge else conv


def normalize_tools(tools) -> list[dict] | None:
    """Tool schemas as vLLM passes them to the template (``ChatCompletionToolsParam.model_dump()``)."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list, not {_typename(tools)}")
    if not tools:
        raise ValueError("tools must not be an empty list: give at least one tool or leave it out")
    out = []
    for k, tool in enumerate(tools):
        w = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{w} must be an object, not {_typename(tool)}")
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"{w}: only tools of type 'function' with a 'function' object are supported")
        for field, types in (("name", (str,)), ("description", (str, type(None))),
                             ("parameters", (dict, type(None))), ("strict", (bool, type(None))),
                             ("defer_loading", (bool, type(None)))):
            if not isinstance(fn.get(field), types):
                raise ValueError(f"{w}.function.{field} has the wrong type ({_typename(fn.get(field))})")
        defer = tool.get("defer_loading")
        if not isinstance(defer, (bool, type(None))):
            raise ValueError(f"{w}.defer_loading must be a boolean")
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        if fn.get("strict") is not None:
            f["strict"] = fn["strict"]
        fdefer = fn.get("defer_loading") if fn.get("defer_loading") is not None else defer
        if fdefer is not None:
            f["defer_loading"] = fdefer
        d = {"type": "function", "function": f}
        if defer is not None:
            d["defer_loading"] = defer
        out.append(d)
    return out


def validate_messages(messages) -> None:
    """Raise ``ValueError`` (naming the index and field) unless ``messages`` is a well-formed chat."""
    normalize_messages(messages)


def message_text(message: dict) -> str:
    """The text of a message's content (text parts joined with ``"\\n"``, as vLLM joins them)."""
    return "\n".join(t for t in _content_texts(message.get("content"), "message") if t)


# ---------------------------------------------------------------------------------------------------
# Renderers: each mirrors one official template, line for line (see the template texts in assets).
# ---------------------------------------------------------------------------------------------------
_QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
               "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
_TOOLS35_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_TOOLS35_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the "
    "specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> "
    "XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function "
    "call in natural language BEFORE the function call, but NOT after\n- If there is no function call "
    "available, answer the question like normal with your current knowledge and do not tell the user about "
    "function calls\n</IMPORTANT>")


def _tool_block(out: list, tools: list) -> None:
    for tool in tools:
        out.append("\n")
        out.append(_dumps(tool))


def _tool_result(out: list, msgs: list, i: int, content: str, opens: bool) -> None:
    """A ``tool`` message: consecutive results share one ``user`` turn."""
    if opens:
        out.append("<|im_start|>user")
    out.append("\n<tool_response>\n" + content + "\n</tool_response>")
    if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
        out.append("<|im_end|>\n")


def _render_qwen25(msgs, tools, add_generation_prompt, enable_thinking) -> str:
    out = []
    first_system = msgs[0]["role"] == "system"
    if tools:
        out.append("<|im_start|>system\n")
        out.append(msgs[0]["content"] if first_system else _QWEN25_DEFAULT_SYSTEM)
        out.append("\n\n" + _TOOLS_HEAD)
        _tool_block(out, tools)
        out.append(_TOOLS_TAIL)
    elif first_system:
        out.append("<|im_start|>system\n" + msgs[0]["content"] + "<|im_end|>\n")
    else:
        out.append("<|im_start|>system\n" + _QWEN25_DEFAULT_SYSTEM + "<|im_end|>\n")
    for i, m in enumerate(msgs):
        role, content, calls = m["role"], m["content"], m.get("tool_calls")
        if role == "user" or (role == "system" and i > 0) or (role == "assistant" and not calls):
            out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            out.append("<|im_start|>assistant")
            if content:
                out.append("\n" + content)
            for call in calls:
                fn = call["function"] if "function" in call else call
                out.append('\n<tool_call>\n{"name": "' + fn["name"] + '", "arguments": '
                           + _dumps(fn["arguments"]) + "}\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            _tool_result(out, msgs, i, content, i == 0 or msgs[i - 1]["role"] != "tool")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _split_think(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant text holding ``…</think>`` (the templates' split)."""
    head, _, _ = content.partition("</think>")
    return (head.rstrip("\n").split("<think>")[-1].lstrip("\n"),
            content.split("</think>")[-1].lstrip("\n"))


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def _render_qwen3(msgs, tools, add_generation_prompt, enable_thinking, preserve_thinking=False) -> str:
    """The official Qwen3 template; ``preserve_thinking``: data/qwen3-reuse.jinja (every assistant turn keeps
    its ``<think>`` block, empty when there is no reasoning)."""
    out = []
    first_system = msgs[0]["role"] == "system"
    if tools:
        out.append("<|im_start|>system\n")
        if first_system:
            out.append(msgs[0]["content"] + "\n\n")
        out.append(_TOOLS_HEAD)
        _tool_block(out, tools)
        out.append(_TOOLS_TAIL)
    elif first_system:
        out.append("<|im_start|>system\n" + msgs[0]["content"] + "<|im_end|>\n")
    n = len(msgs)
    last_query = n - 1  # the last real user query; assistant reasoning before it is dropped
    for i in range(n - 1, -1, -1):
        if msgs[i]["role"] == "user" and not _is_tool_response(msgs[i]["content"]):
            last_query = i
            break
    for i, m in enumerate(msgs):
        role, content = m["role"], m["content"]
        if role == "user" or (role == "system" and i > 0):
            out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    reasoning, content = _split_think(content)
            keep = (bool(preserve_thinking) and preserve_thinking != ANSWERS) or \
                (preserve_thinking == ANSWERS and not reasoning.strip("\n"))
            if keep or (i > last_query and (i == n - 1 or reasoning)):
                out.append("<|im_start|>assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                           + content.lstrip("\n"))
            else:
                out.append("<|im_start|>assistant\n" + content)
            for k, call in enumerate(m.get("tool_calls") or ()):
                if k or content:
                    out.append("\n")
                fn = call["function"] if call.get("function") else call
                args = fn["arguments"]
                out.append('<tool_call>\n{"name": "' + fn["name"] + '", "arguments": '
                           + (args if isinstance(args, str) else _dumps(args)) + "}\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            _tool_result(out, msgs, i, content, i == 0 or msgs[i - 1]["role"] != "tool")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)


def _content35(content) -> str:
    """Qwen3.5's ``render_content`` macro on text-only content, then ``|trim``."""
    if isinstance(content, str):
        return content.strip()
    return "".join(part["text"] for part in content).strip() if content else ""


def _param_value(value) -> str:
    if isinstance(value, Mapping) or (isinstance(value, (list, tuple)) and not isinstance(value, str)):
        return _dumps(value)
    return str(value)  # Jinja's |string


def _text35(content) -> str:
    """Qwen3.5's ``render_content`` macro on text-only content, untrimmed (the reuse template's answer)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content) if content else ""


def _render_qwen35(msgs, tools, add_generation_prompt, enable_thinking, preserve_thinking=False) -> str:
    """The official Qwen3.5 template; ``preserve_thinking``: data/qwen3.5-reuse.jinja (every assistant turn keeps
    its ``<think>`` block, empty when there is no reasoning, and its answer untrimmed)."""
    out = []
    first_system = msgs[0]["role"] == "system"
    if tools:
        out.append("<|im_start|>system\n" + _TOOLS35_HEAD)
        _tool_block(out, tools)
        out.append(_TOOLS35_TAIL)
        if first_system:
            system = _content35(msgs[0]["content"])
            if system:
                out.append("\n\n" + system)
        out.append("<|im_end|>\n")
    elif first_system:
        out.append("<|im_start|>system\n" + _content35(msgs[0]["content"]) + "<|im_end|>\n")
    n = len(msgs)
    contents = [_content35(m["content"]) for m in msgs]
    last_query = None
    for i in range(n - 1, -1, -1):
        if msgs[i]["role"] == "user" and not _is_tool_response(contents[i]):
            last_query = i
            break
    if last_query is None:
        raise ValueError("messages: the Qwen3.5 template needs at least one user message that is not a tool result")
    for i, m in enumerate(msgs):
        role, content = m["role"], contents[i]
        if role == "system":
            if i:
                raise ValueError(f"messages[{i}].role: the Qwen3.5 template allows a system message only first")
        elif role == "user":
            out.append("<|im_start|>user\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            keep = bool(preserve_thinking) and preserve_thinking != ANSWERS
            if preserve_thinking == ANSWERS:  # kept as generated when it has no reasoning
                raw, thought = _text35(m["content"]), m.get("reasoning_content")
                if not isinstance(thought, str):
                    thought = _split_think(raw)[0] if "</think>" in raw else ""
                keep = not thought.strip("\n")
            if keep:
                content = _text35(m["content"])
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = ""
                if "</think>" in content:
                    reasoning, content = _split_think(content)
            if keep:
                reasoning, content = reasoning.strip("\n"), content.lstrip("\n")
            else:
                reasoning = reasoning.strip()
            if keep or i > last_query:
                out.append("<|im_start|>assistant\n<think>\n" + reasoning + "\n</think>\n\n" + content)
            else:
                out.append("<|im_start|>assistant\n" + content)
            for k, call in enumerate(m.get("tool_calls") or ()):
                fn = call["function"] if "function" in call else call
                if k:
                    out.append("\n<tool_call>\n<function=" + fn["name"] + ">\n")
                else:
                    out.append(("\n\n" if content.strip() else "") + "<tool_call>\n<function=" + fn["name"] + ">\n")
                for name, value in (fn["arguments"].items() if "arguments" in fn else ()):
                    out.append("<parameter=" + name + ">\n" + _param_value(value) + "\n</parameter>\n")
                out.append("</function>\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            _tool_result(out, msgs, i, content, i > 0 and msgs[i - 1]["role"] != "tool")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        out.append("<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n")
    return "".join(out)


def _preserve(value):
    """``preserve_thinking`` as the reuse templates read it: :data:`ANSWERS`, or any value's truth."""
    return value if value == ANSWERS else bool(value)


def _render_qwen3_reuse(msgs, tools, add_generation_prompt, enable_thinking, preserve_thinking=True) -> str:
    return _render_qwen3(msgs, tools, add_generation_prompt, enable_thinking, _preserve(preserve_thinking))


def _render_qwen35_reuse(msgs, tools, add_generation_prompt, enable_thinking, preserve_thinking=True) -> str:
    return _render_qwen35(msgs, tools, add_generation_prompt, enable_thinking, _preserve(preserve_thinking))


_RENDERERS = {"qwen2.5": _render_qwen25, "qwen3": _render_qwen3, "qwen3.5": _render_qwen35,
              "qwen3-reuse": _render_qwen3_reuse, "qwen3.5-reuse": _render_qwen35_reuse}
_CONTENT_FORMAT = {"qwen2.5": "string", "qwen3": "string", "qwen3.5": "openai",
                   "qwen3-reuse": "string", "qwen3.5-reuse": "openai"}  # vLLM's detection result


def template_path(name: str = "qwen3-reuse") -> str:
    """Path of a chat template file shipped with this package (for vLLM's ``--chat-template``)."""
    import os

    if name not in REUSE_TEMPLATES:
        raise ValueError(f"no shipped chat template {name!r}; shipped: {', '.join(REUSE_TEMPLATES)}")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", REUSE_TEMPLATES[name])


def _renderer(template: str, template_kwargs: dict):
    """The renderer of ``template`` with the template kwargs it reads bound (others are ignored, as vLLM
    and the Jinja templates ignore them)."""
    renderer = _RENDERERS.get(template)
    if renderer is None:
        raise ValueError(f"unknown chat template {template!r}; known: {', '.join(_RENDERERS)}")
    if template in REUSE_TEMPLATES and "preserve_thinking" in template_kwargs:
        preserve = template_kwargs["preserve_thinking"]
        return lambda *a: renderer(*a, preserve_thinking=preserve)
    return renderer


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------
def render_chat(messages, tools=None, template: str = "qwen3", add_generation_prompt: bool = True,
                enable_thinking: bool | None = None, *, continue_final_message: bool = False,
                reasoning_effort: str | None = None, tool_choice=None,
                exclude_tools_when_tool_choice_none: bool = False, **template_kwargs) -> str:
    """The prompt text vLLM renders for this chat request.

    ``enable_thinking=None`` leaves it unset (the template default: thinking on). As in vLLM,
    ``reasoning_effort`` sets ``enable_thinking = reasoning_effort != "none"`` when ``enable_thinking`` is
    not given, ``tool_choice="none"`` drops the tools only with ``exclude_tools_when_tool_choice_none``
    (the server flag), and other template kwargs are accepted and ignored (the official Qwen templates read
    none; "qwen3-reuse" reads ``preserve_thinking``, default true).
    """
    renderer = _renderer(template, template_kwargs)
    if enable_thinking is None and reasoning_effort is not None:
        enable_thinking = reasoning_effort != "none"
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    conv = normalize_messages(messages, _CONTENT_FORMAT[template])
    tool_dicts = normalize_tools(tools)
    if tool_choice == "none" and exclude_tools_when_tool_choice_none:
        tool_dicts = None
    if not continue_final_message:
        return renderer(conv, tool_dicts, add_generation_prompt, enable_thinking)
    return _render_continued(renderer, conv, tool_dicts, enable_thinking)


def _render_continued(renderer, conv, tools, enable_thinking) -> str:
    """transformers' ``continue_final_message``: tag the final text, render, cut at the tag."""
    last = dict(conv[-1])
    content = last["content"]
    if isinstance(content, list):
        if not content:
            raise ValueError("continue_final_message: the final message has no text to continue")
        content = [*content[:-1], {**content[-1], "text": content[-1]["text"] + _CONTINUE_TAG}]
        final = conv[-1]["content"][-1]["text"]
    else:
        final, content = content, content + _CONTINUE_TAG
    last["content"] = content
    rendered = renderer([*conv[:-1], last], tools, False, enable_thinking)
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message: the template drops part of the final message")
    loc = rendered.rindex(tag)
    if rendered[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()


def count_chat(messages, tokenizer=None, tools=None, template: str = "qwen3", add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, **kwargs) -> int:
    """Exact ``usage.prompt_tokens`` vLLM reports for this chat request (see ``render_chat`` for kwargs).

    ``tokenizer``: any object with ``encode(str) -> list[int]`` that recognizes the added tokens (its
    ``count(str) -> int`` is used when present); ``None`` means the bundled Qwen3 tokenizer. For Qwen3.5/3.6
    pass the model's own tokenizer: its vocabulary differs.
    """
    text = render_chat(messages, tools=tools, template=template, add_generation_prompt=add_generation_prompt,
                       enable_thinking=enable_thinking, **kwargs)
    if tokenizer is None:
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.bundled("qwen3")
    count = getattr(tokenizer, "count", None)
    return count(text) if callable(count) else len(tokenizer.encode(text))
