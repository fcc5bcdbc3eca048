"""An API key: its fields, what each may hold, and when it may be used (pure)."""
from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import math
import re
import time
from typing import Any, Callable

from ..common.client_strings import MAX_MODEL_CHARS, MAX_NAME_CHARS, MAX_TEXT_CHARS, printable, problem


SECRET_PREFIX = "qve-"
SECRET_LEN = len(SECRET_PREFIX) + 43
KEY_ID_PREFIX = "k_"
SECRET_FILE = "gateway.secret"
MICRO = 1_000_000
MIN_SERVER_SECRET = 16
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap", "max_n", "daily_budget_micro",
                "monthly_budget_micro")
SCOPE_FIELDS = ("models", *LIMIT_FIELDS, "expires_at", "labels", "spike_breaker")  # accepted by create()
UPDATABLE_FIELDS = ("name", *SCOPE_FIELDS, "suspended_until", "suspend_reason")   # accepted by update()
REASONS = ("revoked", "expired", "suspended")
_MAX_INT = 2**63 - 1
_URLSAFE = re.compile(r"[A-Za-z0-9_-]+")


class KeyStoreUnavailable(RuntimeError):
    """The key store (or the server secret) cannot be opened or reached."""


class KeyNotFound(LookupError):
    """No API key has this id."""

    def __init__(self, key_id: str):
        super().__init__(f"no API key with id {key_id!r}")
        self.key_id = key_id


@dataclasses.dataclass
class ApiKey:
    """The public record of one key (holds neither the secret nor its hash). ``None`` limits = unlimited;
    budgets are integer micro-units of billed units; times are unix seconds."""

    key_id: str
    name: str
    prefix: str
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    suspended_until: float | None = None
    suspend_reason: str | None = None
    models: list[str] = dataclasses.field(default_factory=list)   # empty = every model
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_tokens_cap: int | None = None
    max_n: int | None = None  # most parallel samples per request (below the server's max_n)
    daily_budget_micro: int | None = None
    monthly_budget_micro: int | None = None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    spike_breaker: bool = True  # False: exempt from the spike breaker (an aggregator's key: gateway/spike.py)

    def active(self, now: float | None = None) -> tuple[bool, str | None]:
        """``(True, None)`` or ``(False, reason)`` with reason ``revoked``, ``expired`` or ``suspended``."""
        now = time.time() if now is None else now
        if self.revoked_at is not None:
            return False, "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return False, "expired"
        if self.suspended_until is not None and now < self.suspended_until:
            return False, "suspended"
        return True, None

    def status(self, now: float | None = None) -> str:
        """``active`` or the reason it is not."""
        return self.active(now)[1] or "active"

    def allows_model(self, name: str) -> bool:
        return not self.models or name in self.models

    def to_public_dict(self) -> dict[str, Any]:
        """Every field (JSON-ready); safe to show: the record never holds the secret or its hash."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ApiKey":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# ------------------------------------------------------------------------------------------ validation
def parse_expiry(value: Any, now: float | None = None) -> float | None:
    """Unix seconds (number or numeric text), an ISO date/time (naive = UTC), a duration from now
    (``30d``, ``12h``, ``90m``, ``45s``, ``2w``, combinable: ``1d12h``), or ``never``/``none``/None -> None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"expected a non-negative unix time, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a time, got {type(value).__name__} {value!r}")
    text = value.strip()
    if text.lower() in ("", "never", "none"):
        return None
    try:
        return parse_expiry(float(text))
    except ValueError:
        pass
    if re.fullmatch(r"(\d+(\.\d+)?[smhdw])+", text.lower()):
        units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
        total = sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhdw])", text.lower()))
        return (time.time() if now is None else now) + total
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {value!r} (expected unix seconds, an ISO date/time such as 2026-12-31 "
                         "or 2026-12-31T12:00:00Z, a duration such as 30d, 12h, 90m, or 'never')") from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).timestamp()


def parse_billed(text: str | int | float) -> int:
    """Billed units (decimal text, up to 6 decimals, > 0) -> integer micro-units."""
    try:
        micro = decimal.Decimal(str(text).strip()) * MICRO
    except decimal.InvalidOperation:
        raise ValueError(f"not a number of billed units: {text!r}") from None
    if not micro.is_finite() or micro <= 0 or micro != micro.to_integral_value() or micro > _MAX_INT:
        raise ValueError(f"billed units must be positive with at most 6 decimals, got {text!r}")
    return int(micro)


def _v_positive(name: str, value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= _MAX_INT):
        return value
    raise ValueError(f"{name} must be a positive integer or None (unlimited), got {value!r}")


def _v_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be true or false, got {printable(str(value)[:80])!r}")


def _v_time(name: str, value: Any) -> float | None:
    try:
        return parse_expiry(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _text(name: str, value: str, max_chars: int, allow_controls: bool = False) -> str:
    """``value`` when it can be stored and printed (no lone surrogates, no control characters, not too long)."""
    reason = problem(value, max_chars, allow_controls)
    if reason is not None:
        raise ValueError(f"{name} {reason}, got {printable(value[:80])!r}")
    return value


def _v_name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{name} must be a non-empty string of at most {MAX_NAME_CHARS} characters, got "
                         f"{printable(str(value)[:80])!r}")
    return _text(name, value.strip(), MAX_NAME_CHARS)


def _v_reason(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > MAX_TEXT_CHARS):
        raise ValueError(f"{name} must be a string (at most {MAX_TEXT_CHARS} characters) or None, got "
                         f"{printable(str(value)[:80])!r}")
    return value if value is None else _text(name, value, MAX_TEXT_CHARS)


def _v_models(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) and m.strip() for m in value):
        raise ValueError(f"{name} must be a list of non-empty model names ([] = every model), got {value!r}")
    return list(dict.fromkeys(_text(name, m.strip(), MAX_MODEL_CHARS) for m in value))


def _v_labels(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.strip() and isinstance(v, str)
                                              for k, v in value.items()):
        raise ValueError(f"{name} must map non-empty string keys to string values, got {value!r}")
    return {_text(name, k, MAX_NAME_CHARS): _text(name, v, MAX_TEXT_CHARS) for k, v in value.items()}


_VALIDATORS: dict[str, Callable[[str, Any], Any]] = {
    "name": _v_name, "models": _v_models, "labels": _v_labels, "expires_at": _v_time,
    "suspended_until": _v_time, "suspend_reason": _v_reason, "spike_breaker": _v_bool,
    **{f: _v_positive for f in LIMIT_FIELDS}}


def validate_fields(fields: dict[str, Any], allowed: tuple[str, ...] = UPDATABLE_FIELDS) -> dict[str, Any]:
    """Checked and normalised copy of ``fields``; ``ValueError`` naming the first bad field."""
    out = {}
    for name, value in fields.items():
        if name not in allowed:
            raise ValueError(f"{name!r} is not a field that can be set here; allowed: {', '.join(allowed)}")
        out[name] = _VALIDATORS[name](name, value)
    return out
