"""Pure logic of multi-turn KV-cache reuse (no vLLM import).

* :func:`reuse_template_for` / :func:`reuse_template_applies` — is the served model one whose official template
  breaks prefix reuse (a Qwen3 hybrid-thinking model, or a Qwen3.5/3.6 model with the official Qwen3.5 template),
  so that the launcher should serve the package's prefix-stable template (``qwen3-reuse``, ``qwen3.5-reuse``)?
* :func:`launcher_flags` — the vLLM flags the launcher adds for reuse mode.
* :class:`ReuseTracker` — a bounded LRU (per API-server process) of the previous turn's prompt + completion
  tokens per conversation; ``reuse ratio = cached tokens of this turn / (previous turn's prompt + completion)``.
* :func:`conversation_id` — the conversation a request belongs to (``x-session-id`` header -- the one
  vllm-router's ``consistent_hash`` hashes, so one header gives both router affinity and the reuse ratio --, else
  ``x-conversation-id`` (the older name; the router ignores it), else the OpenAI ``user`` field).
"""
from __future__ import annotations

import collections
import json
import os
import re
import threading

from ..common.client_strings import storable
from ..common.context import request_context
from ..common.family import read_json as _read_json

SESSION_HEADER = b"x-session-id"  # what clients send: vllm-router's consistent_hash hashes it (checked on 0.1.17)
CONVERSATION_HEADERS = (SESSION_HEADER, b"x-conversation-id")  # first present wins
VALID_CONVERSATION_ID = re.compile(r"^[A-Za-z0-9._:@~/+=-]{1,128}$")
MAX_USER_ID_CHARS = 256
REUSE_TEMPLATE = "qwen3-reuse"
HYBRID_REUSE_TEMPLATE = "qwen3.5-reuse"
# the package's prefix-stable templates -> the official template each renders with preserve_thinking=false
OFFICIAL_OF = {REUSE_TEMPLATE: "qwen3", HYBRID_REUSE_TEMPLATE: "qwen3.5"}
# the server's default template kwargs per reuse template. Qwen3.5/3.6 (issue 48's cache-pressure sweep): "answers"
# keeps a thinking-off turn as generated (its answer reused) and drops earlier reasoning as the official template
# does: keeping it doubled the thinking-on prompts and, once the cache held a fraction of the conversations,
# computed more prefill than vLLM with the official template. A client that wants the reasoning kept sends
# chat_template_kwargs {"preserve_thinking": true}.
DEFAULT_TEMPLATE_KWARGS = {REUSE_TEMPLATE: {"preserve_thinking": True},
                           HYBRID_REUSE_TEMPLATE: {"preserve_thinking": "answers"}}

QWEN3_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Hugging Face ids of the original Qwen3 hybrid-thinking checkpoints (Qwen3-8B, Qwen3-30B-A3B-FP8, ...).
# The 2507 Instruct/Thinking, Coder, VL, Base, Next and Qwen3.5+ releases have other templates.
_QWEN3_ID = re.compile(r"(?i)(?:^|/)qwen3-\d+(?:\.\d+)?b(?:-a\d+(?:\.\d+)?b)?(?:-(?:fp8|awq|gptq[\w-]*|int[48][\w-]*))?$")
# Hugging Face ids of the Qwen3.5/3.6 chat checkpoints (Qwen3.5-27B, Qwen3.6-35B-A3B-FP8, ...; not -Base).
_QWEN35_ID = re.compile(r"(?i)(?:^|/)qwen3\.[56]-\d+(?:\.\d+)?b(?:-a\d+(?:\.\d+)?b)?(?:-(?:fp8|awq|gptq[\w-]*|int[48][\w-]*))?$")


def _model_template(model_dir: str) -> str:
    """The chat template a model directory ships (``chat_template.jinja`` wins, as in transformers)."""
    try:
        with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
            return f.read()
    except OSError:
        pass
    template = _read_json(os.path.join(model_dir, "tokenizer_config.json")).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else ""


def is_hybrid_qwen3_template(template: str) -> bool:
    """The official Qwen3 hybrid-thinking template: reads ``enable_thinking`` and writes ``<think>`` blocks."""
    return "enable_thinking" in template and "<think>" in template and "reasoning_content" in template \
        and "<|im_start|>" in template


def is_qwen35_template(template: str) -> bool:
    """The official Qwen3.5/3.6 template: thinking switch, ``<think>`` blocks, ``<function=...>`` tool calls."""
    return is_hybrid_qwen3_template(template) and "<function=" in template


def reuse_template_for(model: str) -> tuple[str | None, str]:
    """(the package's template to serve, or None; reason). ``model``: a local model directory or a Hugging Face id.
    Qwen3 hybrid-thinking models get ``qwen3-reuse``; Qwen3.5/3.6 models (and the hybrid demo, a Qwen3-Next class
    with the Qwen3.6 tokenizer) with the official Qwen3.5 template get ``qwen3.5-reuse``."""
    from ..common.family import detect

    path = os.path.expanduser(model)
    if os.path.isdir(path):
        model_type = _read_json(os.path.join(path, "config.json")).get("model_type")
        if detect(path).name == "qwen3.6":
            if not is_qwen35_template(_model_template(path)):
                return None, "the model's own chat template is not the official Qwen3.5/3.6 template"
            return HYBRID_REUSE_TEMPLATE, f"Qwen3.5/3.6 model ({model_type}) with the official template"
        if model_type not in QWEN3_MODEL_TYPES:
            return None, (f"model_type {model_type!r} is neither Qwen3 ({', '.join(QWEN3_MODEL_TYPES)}) nor "
                          "Qwen3.5/3.6")
        if not is_hybrid_qwen3_template(_model_template(path)):
            return None, "the model's own chat template is not the Qwen3 hybrid-thinking template"
        return REUSE_TEMPLATE, f"Qwen3 model ({model_type}) with the official hybrid-thinking template"
    if _QWEN3_ID.search(model):
        return REUSE_TEMPLATE, "Hugging Face id of a Qwen3 hybrid-thinking checkpoint"
    if _QWEN35_ID.search(model):
        return HYBRID_REUSE_TEMPLATE, "Hugging Face id of a Qwen3.5/3.6 chat checkpoint"
    return None, "not a Qwen3 hybrid-thinking or Qwen3.5/3.6 chat model"


def reuse_template_applies(model: str) -> tuple[bool, str]:
    """(applies, reason): :func:`reuse_template_for` as a yes/no."""
    name, reason = reuse_template_for(model)
    return name is not None, reason


def launcher_flags(enabled: bool, model: str, given: set[str]) -> tuple[list[str], str]:
    """vLLM flags for reuse mode and a one-line note for the operator.

    ``given``: destinations of the vLLM flags the user passed (a user ``--chat-template`` always wins).
    """
    from qwen_v3_calculator.chat import template_path

    if not enabled:
        return [], "off (kv_reuse_template=false): the model's own chat template"
    if "chat_template" in given:
        return [], "off: --chat-template given"
    name, reason = reuse_template_for(model)
    if name is None:
        return [], f"off: {reason}"
    flags = ["--chat-template", template_path(name)]
    if "default_chat_template_kwargs" not in given:
        flags += ["--default-chat-template-kwargs", json.dumps(DEFAULT_TEMPLATE_KWARGS[name])]
    return flags, f"on: {name} template ({reason})"


def served_template(args) -> str | None:
    """Calculator template name for a parsed vLLM namespace: ``qwen3-reuse`` / ``qwen3.5-reuse`` when one of the
    package's templates is served and the server's default kwargs do not switch ``preserve_thinking`` off, the
    official ``qwen3`` / ``qwen3.5`` when they do (then it renders as the official template); ``None``: not ours
    (the calculator picks from the tokenizer)."""
    from qwen_v3_calculator.chat import template_path

    chat_template = getattr(args, "chat_template", None)
    if not chat_template:
        return None
    served = os.path.abspath(os.path.expanduser(str(chat_template)))
    name = next((n for n in OFFICIAL_OF if served == template_path(n)), None)
    if name is None:
        return None
    defaults = getattr(args, "default_chat_template_kwargs", None) or {}
    if "preserve_thinking" in defaults and not defaults["preserve_thinking"]:
        return OFFICIAL_OF[name]
    return name


def conversation_header(headers) -> tuple[str, str] | None:
    """(header name, value) of the first of :data:`CONVERSATION_HEADERS` the request carries."""
    found = {}
    for k, v in headers or ():
        name = k.lower()
        if name in CONVERSATION_HEADERS and name not in found:
            found[name] = v.decode("latin-1").strip()
    for name in CONVERSATION_HEADERS:
        if name in found:
            return name.decode(), found[name]
    return None


def request_conversation_header(scope) -> tuple[str, str] | None:
    """:func:`conversation_header` of an ASGI request, read once and kept on its request context: the KV middleware
    validates it, the ledger records it."""
    request = request_context(scope)
    if not request.conversation_read:
        request.conversation_header = conversation_header(scope.get("headers"))
        request.conversation_read = True
    return request.conversation_header


def conversation_id(header: tuple[str, str] | None, body: dict) -> str | None:
    """The request's conversation: its ``header`` (:func:`conversation_header`: ``x-session-id``, else
    ``x-conversation-id``; validated by :func:`check_conversation` first), else the ``user`` field of the body (a
    non-empty string of at most 256 characters, no control characters or lone surrogates: it is stored in the
    ledger)."""
    if header is not None and VALID_CONVERSATION_ID.match(header[1]):
        return header[1]
    user = body.get("user") if isinstance(body, dict) else None
    return user or None if storable(user, MAX_USER_ID_CHARS) is not None else None


def check_conversation(header: tuple[str, str] | None) -> tuple[str, str] | None:
    """(error message, header name) when the conversation ``header`` (:func:`conversation_header`) is malformed,
    else ``None``."""
    if header is not None and not VALID_CONVERSATION_ID.match(header[1]):
        return (f"{header[0]} must be 1-128 characters from A-Z a-z 0-9 . _ : @ ~ / + = - "
                f"(got {len(header[1])} characters)"), header[0]
    return None


class ReuseTracker:
    """Bounded LRU: conversation id -> tokens of its previous turn (prompt + completion). Thread-safe."""

    def __init__(self, capacity: int = 10000):
        if capacity < 1:
            raise ValueError("ReuseTracker capacity must be >= 1")
        self.capacity = capacity
        self._prev: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def observe(self, conversation: str | None, prompt_tokens: int, cached_tokens: int,
                completion_tokens: int) -> float | None:
        """Record a finished turn; returns its reuse ratio (``None`` for a conversation's first turn seen here,
        or without a conversation id)."""
        if not conversation:
            return None
        with self._lock:
            prev = self._prev.pop(conversation, None)
            self._prev[conversation] = prompt_tokens + completion_tokens
            while len(self._prev) > self.capacity:
                self._prev.popitem(last=False)
        if not prev:
            return None
        return cached_tokens / prev

    def __len__(self) -> int:
        return len(self._prev)


def common_prefix(a, b) -> int:
    """Length of the common leading run of two token-id sequences (what prefix caching can reuse)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
