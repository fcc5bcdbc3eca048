"""Admission decisions of the gateway, as pure functions (no ASGI, no vLLM): body checks, exact cost, headers.

Everything a request is judged on before the engine sees it: the JSON body (well-formed, an object, not
double-wrapped, the right types), the key's scope (model, max_tokens cap), the exact prompt count from
``qwen_v3_calculator`` (chat template included) against the context length, and the token cost reserved:
``prompt + min(max_tokens or the key's cap, max_model_len - prompt) x n``.
"""
from __future__ import annotations

import dataclasses
import json
import math

from qwen_v3_calculator.hygiene import sanitize

GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class Rejection(Exception):
    """A request the gateway answers itself: HTTP status, OpenAI error code, actionable message."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.type = status, code, message, param, type_
        self.headers = headers or {}


@dataclasses.dataclass
class Admission:
    body: dict
    body_changed: bool
    prompt_tokens: int
    max_completion: int
    n: int
    cost: int  # tokens reserved against TPM
    sanitized_chars: int

    def encoded(self) -> bytes:
        return json.dumps(self.body, ensure_ascii=False, separators=(",", ":")).encode()


def parse_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejection(400, "invalid_json", f"the request body is not valid UTF-8 (byte {exc.start}); "
                        "send UTF-8 encoded JSON") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Rejection(400, "invalid_json", f"the request body is not valid JSON ({exc}); check the "
                        "quoting and commas of your payload") from None
    if not isinstance(body, dict):
        raise Rejection(400, "invalid_request_error", "the request body must be a JSON object")
    if "data" in body and isinstance(body["data"], dict) and not {"messages", "prompt", "model"} & body.keys():
        raise Rejection(400, "double_wrapped_body", "the request body is wrapped in {\"data\": ...}: send the "
                        "OpenAI request object itself (a proxy or CDN may be re-encoding it)", param="data")
    return body


def _clean_content(content, counter: list):
    if isinstance(content, str):
        clean = sanitize(content)
        counter[0] += len(content) - len(clean)
        return clean
    if isinstance(content, list):
        return [dict(part, text=_clean_content(part["text"], counter))
                if isinstance(part, dict) and isinstance(part.get("text"), str) else part for part in content]
    return content


def sanitize_body(body: dict, kind: str) -> int:
    """Remove invisible characters from the prompt text in place; returns how many were removed."""
    removed = [0]
    if kind == "chat" and isinstance(body.get("messages"), list):
        body["messages"] = [dict(m, content=_clean_content(m.get("content"), removed))
                            if isinstance(m, dict) and "content" in m else m for m in body["messages"]]
    elif kind == "completion":
        body["prompt"] = _clean_content(body.get("prompt"), removed)
    return removed[0]


def _int_field(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Rejection(400, "invalid_request_error", f"'{name}' must be an integer >= {minimum}, got {value!r}",
                        param=name)
    return value


def count_prompts(body: dict, kind: str, calculator) -> list[int]:
    """Exact token count of each prompt of the request (one for chat)."""
    try:
        if kind == "chat":
            if not isinstance(body.get("messages"), list):
                raise ValueError("'messages' must be a list of message objects")
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ValueError("'chat_template_kwargs' must be an object")
            return [calculator.count_chat(body["messages"], tools=body.get("tools"),
                                          add_generation_prompt=body.get("add_generation_prompt", True), **kwargs)]
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [calculator.count_tokens(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [calculator.count_tokens(p) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [len(prompt)]  # token ids
        raise ValueError("'prompt' must be a string, a list of strings or a list of token ids")
    except (TypeError, ValueError) as exc:
        raise Rejection(400, "invalid_request_error", str(exc),
                        param="messages" if kind == "chat" else "prompt") from None


def admit(body: dict, kind: str, key, calculator, max_model_len: int, over_cap: str = "reject",
          clean: bool = True) -> Admission:
    """Check a parsed generation request against the key's scope and compute its exact cost."""
    model = body.get("model")
    if key is not None and model is not None and not key.allows_model(str(model)):
        raise Rejection(403, "model_not_allowed", f"this API key may not use model {model!r}; allowed: "
                        f"{', '.join(key.models)}", param="model", type_="permission_error")
    removed = sanitize_body(body, kind) if clean else 0
    max_tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int_field(body, max_tokens_name, 1)
    n = _int_field(body, "n", 1) or 1
    changed = removed > 0
    cap = getattr(key, "max_tokens_cap", None) if key is not None else None
    if cap is not None and max_tokens is not None and max_tokens > cap:
        if over_cap == "cap":
            body[max_tokens_name] = max_tokens = cap
            changed = True
        else:
            raise Rejection(400, "max_tokens_exceeds_cap", f"'{max_tokens_name}' is {max_tokens} but this API "
                            f"key allows at most {cap}; lower it", param=max_tokens_name)
    prompts = count_prompts(body, kind, calculator)
    longest = max(prompts)
    if longest >= max_model_len:
        raise Rejection(400, "context_length_exceeded", f"the prompt has {longest} tokens but this model's "
                        f"context is {max_model_len} tokens (prompt + output); shorten the prompt or the "
                        "conversation history", param="messages" if kind == "chat" else "prompt")
    wanted = max_tokens if max_tokens is not None else cap  # None: up to the context
    completions = [min(wanted, max_model_len - p) if wanted is not None else max_model_len - p for p in prompts]
    cost = sum(prompts) + n * sum(completions)  # an upper bound of what the engine can compute
    return Admission(body=body, body_changed=changed, prompt_tokens=sum(prompts), max_completion=max(completions),
                     n=n, cost=cost, sanitized_chars=removed)


def duration(seconds: float) -> str:
    """OpenAI's rate-limit reset format: ``1s``, ``6m0s``, ``1h2m3s``, ``250ms``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"
