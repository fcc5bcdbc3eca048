"""Admission decisions of the gateway, as pure functions (no ASGI, no vLLM): body checks, exact cost, headers.

Everything a request is judged on before the engine sees it: the JSON body (well-formed, an object, not
double-wrapped, the right types), the key's scope (the model the engine will serve -- the default one when
the request names none -- and the max_tokens cap), every request field classified by :mod:`.request_fields`
(counted exactly, or refused with 400), the exact prompt count from ``qwen_v3_calculator`` (chat template and
template kwargs merged as vLLM merges them, truncation applied) against the context length, and the token
cost reserved: ``prompt + min(max_tokens or the key's cap, max_model_len - prompt) x n`` -- the prompt once,
as usage counts it, the output once per parallel sample.
"""
from __future__ import annotations

import dataclasses
import json
import math

from qwen_v3_calculator.hygiene import sanitize

from ..common.client_strings import (MAX_ID_CHARS, MAX_MODEL_CHARS, BadClientString, check_label,
                                     find_lone_surrogate, find_unsafe_number, may_hold_surrogates, printable)
from .request_fields import TEMPLATE_KWARGS, rejected_field, unknown_fields

GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/messages": "messages"}
# POST routes that generate nothing and may pass an authenticated key unmetered; every other POST (vLLM's
# /v1/responses, /v1/messages, /invocations, /inference/v1/generate, ...) is refused while the gateway is on,
# so no generation escapes metering.
UNMETERED_POST = ("/tokenize", "/detokenize", "/v1/tokens/count", "/v1/messages/count_tokens")
# Generating routes the gateway refuses, and why: each would need its own exact count (README, "Routes").
REFUSED_ROUTES = {
    "/v1/responses": "the Responses API renders stored conversation state (previous_response_id), built-in "
                     "tools and instructions into the prompt on the server, which the gateway cannot count "
                     "before the engine; use /v1/chat/completions",
    "/invocations": "SageMaker invocations dispatch to any task by body shape; call the OpenAI route directly",
    "/inference/v1/generate": "token-in/token-out generation bypasses the chat and completion request models "
                              "the gateway counts; use /v1/completions with token ids",
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default


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
    model: str | None = None  # the model the engine serves the request with (the default when none is named)

    def encoded(self) -> bytes:
        return json.dumps(self.body, ensure_ascii=False, separators=(",", ":")).encode()


def refusal_reason(path: str) -> str:
    return REFUSED_ROUTES.get(path, "no generating route other than those can be metered")


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
    check_client_strings(body, raw)
    if "data" in body and isinstance(body["data"], dict) and not {"messages", "prompt", "model"} & body.keys():
        raise Rejection(400, "double_wrapped_body", "the request body is wrapped in {\"data\": ...}: send the "
                        "OpenAI request object itself (a proxy or CDN may be re-encoding it)", param="data")
    return body


LABEL_FIELDS = {"model": MAX_MODEL_CHARS, "user": MAX_ID_CHARS, "request_id": MAX_ID_CHARS,
                "session_id": MAX_ID_CHARS, "cache_salt": MAX_ID_CHARS}
"""Body fields the server may store, label or log, with their length caps (characters)."""


def check_client_strings(body: dict, raw: bytes = b"") -> None:
    """Refuse (400 ``invalid_value`` naming the field) a body whose label fields (:data:`LABEL_FIELDS`) are too long
    or hold control characters, any of whose numbers is beyond an int64 or not finite, or any of whose strings holds
    a lone UTF-16 surrogate (a ``\\ud800`` escape: no
    store, metric or log line can hold it). Runs before the key's scope is checked, so nothing of it is recorded."""
    try:
        for name, cap in LABEL_FIELDS.items():
            check_label(name, body.get(name), cap)
    except BadClientString as exc:
        raise Rejection(400, "invalid_value", f"{exc}", param=exc.field) from None
    unsafe = find_unsafe_number(body)
    if unsafe is not None:
        where, reason = unsafe
        raise Rejection(400, "invalid_value", f"'{where}' {reason}", param=where)
    if not raw or may_hold_surrogates(raw):
        where = find_lone_surrogate(body)
        if where is not None:
            raise Rejection(400, "invalid_value", f"'{where}' holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF "
                            "escape without its pair): send valid Unicode text", param=where.split(" ")[0])


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


MAX_INT_FIELD = 2**31 - 1
"""Largest integer admission accepts in a numeric field (vLLM's own bound for token counts): no arithmetic on a
client's ``10**30``."""


def _int_field(body: dict, name: str, minimum: int, maximum: int = MAX_INT_FIELD, why: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
        raise Rejection(400, "invalid_request_error", f"'{name}' must be an integer from {minimum} to {maximum}"
                        f"{why}, got {shown}", param=name)
    return value


@dataclasses.dataclass(frozen=True)
class Served:
    """What admission needs to know about the served model, read once at startup by the gateway's glue."""

    calculator: object  # qwen_v3_calculator.Calculator for the served tokenizer and template
    max_model_len: int
    names: tuple[str, ...] = ()  # served model names; the first is the default vLLM serves when 'model' is absent
    engine_fields: dict = dataclasses.field(default_factory=dict)  # kind -> field names of vLLM's request model
    template_defaults: dict = dataclasses.field(default_factory=dict)  # --default-chat-template-kwargs
    exclude_tools_when_tool_choice_none: bool = False  # the vLLM server flag of that name

    def resolve_model(self, body: dict) -> str | None:
        """The model the engine serves this request with: vLLM serves its default model when 'model' is
        missing, null or empty."""
        model = body.get("model")
        if model is None or model == "":
            return self.names[0] if self.names else None
        if not isinstance(model, str):
            raise Rejection(400, "invalid_request_error", f"'model' must be a string, got {model!r}", param="model")
        return model


def check_model_scope(body: dict, key, served: Served) -> str | None:
    """Refuse a key outside its model scope, for the model the engine will actually serve."""
    model = served.resolve_model(body)
    if key is not None and key.models and (model is None or not key.allows_model(model)):
        raise Rejection(403, "model_not_allowed", f"this API key may not use model {model!r}"
                        f"{' (the default model, as the request names none)' if not body.get('model') else ''}; "
                        f"allowed: {', '.join(key.models)}", param="model", type_="permission_error")
    return model


def _merge(defaults: dict, overrides: dict) -> dict:
    """vLLM's ``merge_kwargs``: overrides win unless they are None or "auto"."""
    return {**defaults, **{k: v for k, v in overrides.items() if v is not None and v != "auto"}}


def template_kwargs(body: dict, server_defaults: dict | None = None) -> dict:
    """The chat template kwargs vLLM renders this request with (``ChatCompletionRequest.build_chat_params``
    merged over the server's ``--default-chat-template-kwargs`` by ``ChatParams.with_defaults``)."""
    user = body.get("chat_template_kwargs")
    if user is None:
        user = {}
    if not isinstance(user, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    unknown = sorted(set(user) - TEMPLATE_KWARGS)
    if unknown:
        raise Rejection(400, "unsupported_parameter", f"chat_template_kwargs {unknown} cannot be counted by the "
                        f"gateway (it counts {', '.join(sorted(TEMPLATE_KWARGS))}); leave them out",
                        param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    extra = {"add_generation_prompt": body.get("add_generation_prompt", True),
             "continue_final_message": body.get("continue_final_message", False),
             "documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    return _merge(server_defaults or {}, _merge(user, extra))


def _truncated(count: int, body: dict) -> int:
    limit = body.get("truncate_prompt_tokens")
    if limit is None:
        return count
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise Rejection(400, "unsupported_parameter", f"'truncate_prompt_tokens' must be an integer >= 0 behind "
                        f"the gateway (got {limit!r}); -1 (the whole context) depends on the engine's budget and "
                        "cannot be reserved exactly: send the number of tokens to keep", param="truncate_prompt_tokens")
    return min(count, limit)


def count_prompts(body: dict, kind: str, served: Served) -> list[int]:
    """Exact token count of each prompt of the request (one for chat), as the engine will see it."""
    calculator = served.calculator
    try:
        if kind == "chat":
            if not isinstance(body.get("messages"), list):
                raise ValueError("'messages' must be a list of message objects")
            kwargs = template_kwargs(body, served.template_defaults)
            for name in ("add_generation_prompt", "continue_final_message"):
                kwargs[name] = bool(kwargs.get(name, name == "add_generation_prompt"))
            kwargs.pop("documents", None)  # the Qwen templates do not read documents
            kwargs.pop("reasoning_effort", None)  # already turned into enable_thinking, as vLLM does
            count = calculator.count_chat(
                body["messages"], tools=body.get("tools"), tool_choice=body.get("tool_choice"),
                exclude_tools_when_tool_choice_none=served.exclude_tools_when_tool_choice_none,
                **kwargs)
            return [_truncated(count, body)]
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            counts = [calculator.count_tokens(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            counts = calculator.count_tokens_batch(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            counts = [len(prompt)]  # token ids
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(_is_int(t) for t in p)
                                                         for p in prompt):
            counts = [len(p) for p in prompt]  # a batch of token-id prompts
        else:
            raise ValueError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists (none empty)")
        return [_truncated(c, body) for c in counts]
    except (TypeError, ValueError) as exc:
        raise Rejection(400, "invalid_request_error", str(exc),
                        param="messages" if kind == "chat" else "prompt") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_fields(body: dict, kind: str, served: Served) -> None:
    """Refuse fields the gateway cannot count (see :mod:`.request_fields`)."""
    rejected = rejected_field(body, kind)
    if rejected:
        name, reason = rejected
        raise Rejection(400, "unsupported_parameter", f"'{name}' is not supported through the gateway: {reason}",
                        param=name)
    unclassified, unknown = unknown_fields(body, kind, served.engine_fields.get(kind))
    if unclassified:
        raise Rejection(400, "unsupported_parameter", f"{unclassified} cannot be counted by the gateway: this vLLM "
                        "reads them but the gateway does not know their effect on the prompt yet; leave them out",
                        param=unclassified[0])
    if unknown:
        shown = ", ".join(repr(printable(k[:MAX_ID_CHARS])) for k in unknown[:5])
        raise Rejection(400, "unknown_parameter", f"unrecognized request field{'s' if len(unknown) > 1 else ''} "
                        f"{shown}: not a field of {kind} requests on this server (docs/gateway.md, 'Request "
                        "fields'); check the spelling or leave it out", param=unknown[0][:MAX_ID_CHARS])


def admit(body: dict, kind: str, key, served: Served, over_cap: str = "reject", clean: bool = True,
          max_n: int = 0, max_sequences: int = 0) -> Admission:
    """Check a parsed generation request against the key's scope and compute its exact cost.

    Rule for ``n`` (parallel samples): the prompt is counted once per prompt (as usage reports it) and the
    output up to ``n x max_tokens``; the reconciliation charges usage's prompt + completion tokens.
    ``n`` is at most ``max_n`` (settings ``max_n``; lowered by the key's own ``max_n``) and the engine sequences
    of the request (``n`` x prompts) at most ``max_sequences`` (0: no bound).
    """
    model = check_model_scope(body, key, served)
    check_fields(body, kind, served)
    removed = sanitize_body(body, kind) if clean else 0
    # vLLM reads max_completion_tokens (chat only) before max_tokens; completions know max_tokens only.
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int_field(body, name, 1)
    key_n = getattr(key, "max_n", None) if key is not None else None
    n_cap, whose = max_n or MAX_INT_FIELD, " (the server's max_n)" if max_n else ""
    if key_n and key_n < n_cap:
        n_cap, whose = key_n, " (this API key's max_n)"
    n = _int_field(body, "n", 1, n_cap, whose) or 1
    _int_field(body, "min_tokens", 0)
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
    prompts = count_prompts(body, kind, served)
    if max_sequences and n * len(prompts) > max_sequences:
        raise Rejection(400, "too_many_sequences", f"the request runs {n * len(prompts)} engine sequences ({len(prompts)}"
                        f" prompt(s) x n={n}); this server runs at most {max_sequences} per request "
                        "(max_sequences_per_request): send fewer prompts or a smaller n", param="n")
    longest = max(prompts)
    max_model_len = served.max_model_len
    if longest >= max_model_len:
        raise Rejection(400, "context_length_exceeded", f"the prompt has {longest} tokens but this model's "
                        f"context is {max_model_len} tokens (prompt + output); shorten the prompt or the "
                        "conversation history", param="messages" if kind == "chat" else "prompt")
    completion = n * sum(min(max_tokens, max_model_len - p) if max_tokens is not None else max_model_len - p
                         for p in prompts)  # an upper bound of what the engine can generate
    return Admission(body=body, body_changed=changed, prompt_tokens=sum(prompts), completion_tokens=completion,
                     cost=sum(prompts) + completion, sanitized_chars=removed, model=model)


def admit_messages(body: dict, chat_body: dict, key, served: Served, over_cap: str = "reject", max_n: int = 0,
                   max_sequences: int = 0) -> Admission:
    """An Anthropic ``/v1/messages`` request, counted as the chat request ``chat_body`` that vLLM converts it to
    (:func:`qwen_vllm_ext.gateway.vllm_requests.to_chat_body`). The body forwarded to vLLM stays the Anthropic one;
    a max_tokens lowered to the key's cap is written back into it. Text is not sanitized here: the count must
    be of the text the engine will see."""
    check_fields(body, "messages", served)
    try:
        admission = admit(chat_body, "chat", key, served, over_cap=over_cap, clean=False, max_n=max_n,
                          max_sequences=max_sequences)
    except Rejection as rej:  # name the Anthropic field, not the chat field it was converted to
        if rej.param == "max_completion_tokens":
            rej.param, rej.message = "max_tokens", rej.message.replace("'max_completion_tokens'", "'max_tokens'")
        raise
    capped = chat_body.get("max_completion_tokens")
    changed = capped is not None and capped != body.get("max_tokens")
    if changed:
        body = dict(body, max_tokens=capped)
    return dataclasses.replace(admission, body=body, body_changed=changed)


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
