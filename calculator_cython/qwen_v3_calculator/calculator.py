"""The ``Calculator``: a tokenizer + a chat template + a billing policy, and the counting API over them."""
from __future__ import annotations

import os
from decimal import Decimal

from . import hygiene
from .billing import BillingPolicy, get_policy, has_code_block
from .chat import count_chat as _count_chat, message_text, validate_messages
from .tokenizer import Tokenizer
from .vocab import flavor_of


def _require_str(name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__}")
    return value


def default_template(tokenizer: Tokenizer) -> str:
    """Chat template family of a tokenizer: Qwen3.5/3.6 (large vocabulary), Qwen3 (<think>), else Qwen2.5."""
    if tokenizer.vocab_size > 200_000:
        return "qwen3.5"
    if "<think>" in tokenizer.added_tokens:
        return "qwen3"
    return "qwen2.5"


class Calculator:
    """Exact Qwen token counts and billed units.

    ``tokenizer``: ``None`` (the bundled vocabulary of ``model``), a ``Tokenizer``, or a path to a
    ``tokenizer.json`` / model directory (a fine-tune with added tokens: use its own files). ``model``: which bundled
    vocabulary -- ``"qwen3"`` (default; Qwen2/2.5/3, Qwen3-Next), ``"qwen2.5"``, ``"qwen3.6"`` (Qwen3.5/3.6; also
    ``"qwen3.5"`` or a checkpoint id like ``"Qwen/Qwen3.6-27B"``). ``policy``: a ``BillingPolicy`` or a preset
    name. ``template``: chat template family for ``count_chat`` (default: from the tokenizer).
    """

    def __init__(self, tokenizer: "Tokenizer | str | os.PathLike | None" = None,
                 policy: "BillingPolicy | str | None" = None, template: str | None = None, model: str | None = None):
        if tokenizer is None:
            tokenizer = Tokenizer.bundled(flavor_of(model))
        elif model is not None:
            raise ValueError("pass either tokenizer or model, not both")
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = Tokenizer.from_file(tokenizer)
        self.tokenizer = tokenizer
        self.policy = get_policy(policy)
        self.template = template or default_template(tokenizer)

    # ---- plain text ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def count_tokens_batch(self, texts, threads: int | None = None) -> list[int]:
        """Counts of a sequence of str, in order, spread over ``threads`` threads (default: the cores this
        process may use; the compiled core releases the GIL). Identical to counting one text at a time."""
        return self.tokenizer.count_batch(texts, threads)

    def encode_batch(self, texts, threads: int | None = None) -> list[list[int]]:
        """Ids of a sequence of str, in order (``threads`` as for count_tokens_batch)."""
        return self.tokenizer.encode_batch(texts, threads)

    # ---- chat -----------------------------------------------------------------------------------
    def count_chat(self, messages, tools=None, template: str | None = None, add_generation_prompt: bool = True,
                   enable_thinking: bool | None = None, **template_kwargs) -> int:
        """Exact prompt tokens vLLM produces for this chat request with this model's chat template."""
        return _count_chat(messages, self.tokenizer, tools=tools, template=template or self.template,
                           add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                           **template_kwargs)

    # ---- billing --------------------------------------------------------------------------------
    def calculate_tokens(self, input_text: str = "", output_text: str = "", messages: list | None = None,
                         cached_tokens: int = 0, tools=None, **chat_kwargs) -> dict:
        """Token counts and billed figures of one request (the signature gateway billing plugins call).

        With ``messages`` the prompt is the chat request (``input_text`` is then ignored); otherwise
        ``input_text``. With ``policy.sanitize`` (default) invisible characters are removed first, as the
        gateway does before the engine sees the text.
        """
        _require_str("input_text", input_text)
        _require_str("output_text", output_text)
        policy = self.policy
        clean = hygiene.sanitize if policy.sanitize else (lambda s: s)
        removed = 0
        if messages is not None:
            validate_messages(messages)
            cleaned = [_clean_message(m, clean) for m in messages]
            removed = sum(len(message_text(a)) - len(message_text(b)) for a, b in zip(messages, cleaned))
            prompt_text = "".join(message_text(m) for m in cleaned)
            prompt_tokens, excluded = self._count_messages(cleaned, tools, chat_kwargs)
        else:
            prompt_text = clean(input_text)
            removed = len(input_text) - len(prompt_text)
            prompt_tokens, excluded = self.tokenizer.count(prompt_text), 0
        output = clean(output_text)
        removed += len(output_text) - len(output)
        completion_tokens = self.tokenizer.count(output)
        billing = policy.bill(prompt_tokens, completion_tokens, cached_tokens=cached_tokens,
                              excluded_prompt_tokens=excluded, input_has_code=has_code_block(prompt_text),
                              output_has_code=has_code_block(output))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "cached_tokens": cached_tokens,
            "sanitized_chars": removed,
            "billing": billing,
        }

    def _count_messages(self, messages: list, tools, chat_kwargs) -> tuple[int, int]:
        """(prompt tokens, tokens of system messages) under the policy's message counting."""
        if self.policy.message_counting == "role_colon_text":
            kept = [m for m in messages if not (self.policy.exclude_system and m["role"] == "system")]
            total = self.tokenizer.count("".join(f"{m['role']}: {message_text(m)}\n" for m in kept))
            return total, 0  # system messages are already left out of the text
        total = self.count_chat(messages, tools=tools, **chat_kwargs)
        if not self.policy.exclude_system or not any(m["role"] == "system" for m in messages):
            return total, 0
        without = self.count_chat([m for m in messages if m["role"] != "system"], tools=tools, **chat_kwargs)
        return total, max(total - without, 0)


def _clean_message(message: dict, clean) -> dict:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": clean(content)}
    if isinstance(content, list):
        return {**message, "content": [
            {**part, "text": clean(part["text"])} if isinstance(part, dict) and isinstance(part.get("text"), str)
            else part for part in content]}
    return message


def to_jsonable(value):
    """Decimals as strings (exact), recursively: for JSON output of ``calculate_tokens``."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_jsonable(v) for v in value]
    return value
