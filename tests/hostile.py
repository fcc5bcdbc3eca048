"""Hostile values for every request field, header and admin field (issue 45): what an attacker on the internet sends.

One generator, used by the unit fuzz of admission (tests/unit/test_hostile_input.py) and by the end-to-end abuse
suite against the demo with the gateway on (tests/e2e/test_gateway.py). The fields come from the gateway's request
field table (``qwen_vllm_ext.gateway.request_fields``): a field vLLM adds is fuzzed as soon as the table lists it.
"""
from __future__ import annotations

import json
import random

from qwen_vllm_ext.gateway.request_fields import FIELDS

LONG = 4 << 20  # a 4 MB string: the probe's model name

VALUES = [
    None, True, False, 0, -1, 1, 2**31, 2**63, 10**30, -10**30, 1e308, -1e308, 0.5, float("nan"), float("inf"),
    "", " ", "\ud800", "a\udfffb", "\x00", "\x1b[31mred\x1b[0m", "\u202egnp.exe", "\u200b", "x" * 5000,
    [], {}, [None], ["\ud800"], {"\ud800": 1}, {"a": "\ud800"}, [[[[[[[[[[[]]]]]]]]]]], [1] * 300,
    {"type": "text", "text": "\ud800"}, "true", "-1", "1e309",
]
"""Values that break naive code: wrong types, boundaries, huge numbers, NaN, lone surrogates, NUL, terminal escapes,
bidi overrides, long strings, nesting."""

HEADERS = {
    "x-request-id": ["\ud800", "x" * 5000, "../../etc/passwd", "a b", "", "qwen-doctor-fake"],
    "x-session-id": ["\x1b[31m", "x" * 5000, "", "a b", "ok-session"],
    "x-conversation-id": ["\u00e9", "x" * 300, ";drop table"],
    "authorization": ["Bearer ", "Bearer \u00e9", "Basic Zm9vOmJhcg==", "Bearer qve-" + "x" * 43, "x" * 10000],
    "x-api-key": ["", "qve-\u00e9", "x" * 10000],
}
"""Header values (latin-1 encodable: what HTTP can carry) for the headers the extension reads."""

ADMIN_FIELDS = ["name", "models", "rpm", "tpm", "max_concurrent", "max_tokens_cap", "max_n", "daily_budget",
                "monthly_budget", "expires_at", "labels"]
"""Fields of ``POST /qwen_ext/admin/keys``."""


def encode(body) -> bytes:
    """JSON as a client sends it: non-ASCII escaped (so lone surrogates travel as ``\\ud800`` escapes), NaN allowed."""
    return json.dumps(body).encode()


def field_cases(kind: str, base: dict, seed: int = 0, per_field: int | None = None):
    """(field, value, body) for every field of the ``kind`` table (chat, completion, messages) set to each hostile
    value (or ``per_field`` of them, drawn with ``seed``), on top of a valid ``base`` request."""
    rng = random.Random(seed)
    for field in sorted(FIELDS[kind]):
        values = VALUES if per_field is None else rng.sample(VALUES, per_field)
        for value in values:
            yield field, value, {**base, field: value}


def admin_cases(seed: int = 0, per_field: int | None = None):
    rng = random.Random(seed)
    for field in ADMIN_FIELDS:
        values = VALUES if per_field is None else rng.sample(VALUES, per_field)
        for value in values:
            yield field, value, {"name": "fuzz", field: value} if field != "name" else {"name": value}
