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
# POST routes that generate nothing and may pass an authenticated key unmetered; every other POST (vLLM's
# /v1/responses, /v1/messages, /invocations, /inference/v1/generate, ...) is refused while the gateway is on,
# so no generation escapes metering.
UNMETERED_POST = ("/tokenize", "/detokenize", "/v1/tokens/count")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
HINT_KEY_SETTING = "sched_output_hint_key"


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
    completion_tokens: int  # the most the engine may generate for the whole request (every prompt, every n)
    cost: int  # tokens reserved against TPM: prompt_tokens + completion_tokens
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
    # vLLM reads max_completion_tokens (chat only) before max_tokens; completions know max_tokens only.
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int_field(body, name, 1)
    n = _int_field(body, "n", 1) or 1
    changed = removed > 0
    cap = getattr(key, "max_tokens_cap", None) if key is not None else None
    if cap is not None and max_tokens is not None and max_tokens > cap:
        if over_cap != "cap":
            raise Rejection(400, "max_tokens_exceeds_cap", f"'{name}' is {max_tokens} but this API key allows at "
                            f"most {cap}; lower it", param=name)
        max_tokens = None  # lowered to the cap below
    if cap is not None and max_tokens is None:
        body[name] = max_tokens = cap  # the cap is enforced by the engine, not only by the reservation
        changed = True
    if max_tokens is None and kind == "completion":
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    prompts = count_prompts(body, kind, calculator)
    longest = max(prompts)
    if longest >= max_model_len:
        raise Rejection(400, "context_length_exceeded", f"the prompt has {longest} tokens but this model's "
                        f"context is {max_model_len} tokens (prompt + output); shorten the prompt or the "
                        "conversation history", param="messages" if kind == "chat" else "prompt")
    completion = n * sum(min(max_tokens, max_model_len - p) if max_tokens is not None else max_model_len - p
                         for p in prompts)  # an upper bound of what the engine can generate
    return Admission(body=body, body_changed=changed, prompt_tokens=sum(prompts), completion_tokens=completion,
                     cost=sum(prompts) + completion, sanitized_chars=removed)


def strip_hint(body: dict, hint_key: str) -> bool:
    """Drop a client's scheduling hint (``vllm_xargs[hint_key]``): behind the gateway, clients must not be able
    to jump the token-weighted queue by claiming a tiny output."""
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and hint_key in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != hint_key}
        return True
    return False


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
