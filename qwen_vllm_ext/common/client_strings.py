"""Client strings the server stores, labels or logs: checked once, here (pure Python, no vLLM import).

A JSON body can carry any code point, lone surrogates (``"\\ud800"``) included, and SQLite, Redis, Prometheus'
text format and UTF-8 log lines cannot hold those. Every string a client chooses that ends up in the ledger, a
metric label, a key record or a log line (model names, ids, key names and labels) passes :func:`check_label`
first; prompt text passes :func:`find_lone_surrogate` (it may hold control characters such as newlines, not lone
surrogates). A failed check names the field, so the caller can answer 400 naming it.

Limits (characters): model names :data:`MAX_MODEL_CHARS`, ids :data:`MAX_ID_CHARS`, key names and labels
:data:`MAX_NAME_CHARS`, free text such as a suspension reason :data:`MAX_TEXT_CHARS`.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Any

MAX_MODEL_CHARS = 256
MAX_ID_CHARS = 256
MAX_NAME_CHARS = 200
MAX_TEXT_CHARS = 1000

# a \uD800-\uDFFF escape in raw JSON: the only way a lone surrogate gets into a body decoded as strict UTF-8
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BadClientString(ValueError):
    """A client string that must not be stored: ``field`` names it (a dotted path into the body, or a header)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"'{field}' {reason}")
        self.field, self.reason = field, reason


def problem(value: str, max_chars: int, allow_controls: bool = False) -> str | None:
    """Why ``value`` cannot be stored as a label (None when it can): too long, a lone surrogate, a control
    character (C0, DEL, C1; with ``allow_controls`` only surrogates and NUL are refused)."""
    if len(value) > max_chars:
        return f"is {len(value)} characters long; at most {max_chars} are accepted"
    for i, ch in enumerate(value):
        code = ord(ch)
        if 0xD800 <= code <= 0xDFFF:
            return f"holds a lone UTF-16 surrogate (U+{code:04X}) at character {i}: send valid Unicode text"
        if code == 0 or (not allow_controls and unicodedata.category(ch) == "Cc"):
            return f"holds a control character (U+{code:04X}) at character {i}"
    return None


def check_label(field: str, value: Any, max_chars: int, allow_controls: bool = False) -> Any:
    """``value`` unchanged when it is not a string or is a storable one; else :class:`BadClientString`."""
    if isinstance(value, str):
        reason = problem(value, max_chars, allow_controls)
        if reason is not None:
            raise BadClientString(field, reason)
    return value


def storable(value: Any, max_chars: int) -> str | None:
    """``value`` when it is a storable label string, else None (for what is recorded, never refused)."""
    return value if isinstance(value, str) and problem(value, max_chars) is None else None


def may_hold_surrogates(raw: bytes) -> bool:
    """Cheap test on the raw JSON: False means no string of the parsed body can hold a surrogate."""
    return _SURROGATE_ESCAPE.search(raw) is not None


MAX_JSON_INT = 2**63 - 1
"""Largest integer (in magnitude) a body may carry anywhere: what a C ``int64`` holds."""


def find_unsafe_number(value: Any, path: str = "") -> tuple[str, str] | None:
    """(dotted path, reason) of the first number in a parsed JSON value that no consumer can take safely: an integer
    beyond +-(2^63 - 1) or a non-finite float (``NaN``/``Infinity``, which Python's JSON parser accepts)."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, bool) or isinstance(item, str):
            continue
        if isinstance(item, int):
            if not -MAX_JSON_INT <= item <= MAX_JSON_INT:
                return where or "body", f"is an integer of {len(str(abs(item)))} digits; at most 2^63 - 1 is accepted"
        elif isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                return where or "body", f"is {item!r}, not a finite number"
        elif isinstance(item, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
    return None


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or object key) in a parsed JSON value holding a lone surrogate."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if _has_lone(item):
                return where or "body"
        elif isinstance(item, dict):
            for k, v in item.items():
                name = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and _has_lone(k):
                    return f"{where or 'body'} (a key)"
                stack.append((name, v))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
    return None


def _has_lone(text: str) -> bool:
    """A str from parsed JSON holds a surrogate code point only unpaired (pairs are joined): UTF-8 cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def printable(text: str) -> str:
    """``text`` with control characters (ANSI escapes included) and lone surrogates shown as ``\\xNN`` /
    ``\\uNNNN`` escapes: safe to print to a terminal or a log line."""
    out = []
    for ch in text:
        code = ord(ch)
        if 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        elif unicodedata.category(ch) == "Cc":
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)
