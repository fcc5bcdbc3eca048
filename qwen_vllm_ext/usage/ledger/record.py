"""One ledger record: what the ledger keeps per request, validated before any store writes it (pure)."""
from __future__ import annotations

import calendar
import dataclasses
import math
import time
from typing import Any


STATUSES = ("stop", "length", "client_disconnected", "aborted", "error")
PROBE_PREFIX = "qwen-doctor-"
"""Request ids (``x-request-id``) of health probes: see :attr:`LedgerRecord.probe`."""
MICRO = 1_000_000
_INT_FIELDS = ("http_status", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
               "engine_prompt_tokens", "billed_prompt_micro", "billed_completion_micro", "cost_pico_usd")
_MAX_INT = 2**63 - 1
_STR_FIELDS = ("request_id", "instance_id", "model", "endpoint", "status", "api_key_id", "conversation_id")
# Aggregates kept per (api key, UTC day, model) and reported by ``report``.
DAILY_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "billed_micro", "cost_pico_usd")
TOTAL_FIELDS = ("requests", "prompt_tokens", "engine_prompt_tokens", "cached_tokens", "completion_tokens",
                "reasoning_tokens", "billed_micro", "cost_pico_usd")
REPORT_BY = {"key": "api_key_id", "model": "model", "day": "day", "instance": "instance_id"}
# ``instance`` (the replica, for a fleet sharing one Redis ledger) is not in the daily aggregates: read off records.


class LedgerUnavailable(RuntimeError):
    """The ledger store cannot be opened or reached."""


class LedgerWriteError(RuntimeError):
    """A batch could not be committed after retries; ``spilled_to`` is the spill file (None if spill failed)."""

    def __init__(self, message: str, spilled_to: str | None):
        super().__init__(message)
        self.spilled_to = spilled_to


class LedgerDeadLettered(LedgerWriteError, ValueError):
    """The record can never be written to the store (it fails :meth:`LedgerRecord.validate`, or the store refused it
    while it took the rest of its batch): it was appended to the dead-letter file ``spilled_to`` with ``reason``
    (``None`` if even that failed) and is not retried. Also a ``ValueError``: the record, not the store, is at fault."""

    def __init__(self, message: str, spilled_to: str | None, reason: str):
        super().__init__(message, spilled_to)
        self.reason = reason


def utc_day(ts: float) -> str:
    """``YYYY-MM-DD`` (UTC) of a unix timestamp."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def _day_start(day: str) -> float:
    return float(calendar.timegm(time.strptime(day, "%Y-%m-%d")))


def billed_prompt_tokens(prompt_tokens: int, engine_prompt_tokens: int) -> int:
    """The prompt tokens billed and charged: usage's count (each prompt once), only when the engine computed the
    prompt (a request aborted before prefill is not billed for it)."""
    return prompt_tokens if engine_prompt_tokens else 0


@dataclasses.dataclass
class LedgerRecord:
    """One request as the ledger records it. Billed figures are integer micro-units (units x 10^6); the cost is
    integer pico-dollars (USD x 10^12: exact for the provider's prices, ``qwen_v3_calculator.billing.Prices``)."""

    request_id: str
    instance_id: str
    model: str
    endpoint: str
    status: str
    http_status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    engine_prompt_tokens: int
    billed_prompt_micro: int
    billed_completion_micro: int
    received_at: float
    finished_at: float
    ttft_s: float | None
    latency_s: float
    streamed: bool
    api_key_id: str | None = None
    conversation_id: str | None = None  # x-session-id / x-conversation-id header or the `user` field (KV reuse)
    reuse_ratio: float | None = None  # cached tokens / previous turn's prompt + completion of the conversation
    cost_pico_usd: int = 0  # usage x the provider's prices (settings price_*), pico-dollars; 0 without prices

    def __post_init__(self) -> None:
        self._check_shape()

    @property
    def usage_tokens(self) -> int:
        """Prompt + completion tokens as usage and billing count them: each prompt once (also with ``n`` > 1
        parallel samples), and only when the engine computed it; every sample's generated tokens. The gateway
        charges exactly this against TPM."""
        return billed_prompt_tokens(self.prompt_tokens, self.engine_prompt_tokens) + self.completion_tokens

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (run by the writer and the stores before writing).

        Construction checks the types and ranges (:meth:`_check_shape`: a record of the wrong shape is a bug);
        ``validate`` also refuses strings no store can hold -- lone surrogates (not UTF-8 encodable, e.g. a
        ``"\\ud800"`` JSON escape in a client's ``model``) and NUL characters -- so a record built from such a
        request still exists and the writer can set it aside (its dead letter) instead of failing its batch."""
        self._check_shape()
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if "\x00" in value:
                raise ValueError(f"LedgerRecord.{name} must not contain NUL characters, got {value!r}")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"LedgerRecord.{name} must be valid Unicode text (UTF-8 encodable), got {value!r}: "
                                 f"{exc.reason} at {exc.start}") from None

    def _check_shape(self) -> None:
        """Types and ranges: ``ValueError`` naming the first bad field."""
        for name in ("request_id", "instance_id", "model", "endpoint"):
            value = getattr(self, name)
            if not isinstance(value, str) or (name == "request_id" and not value):
                raise ValueError(f"LedgerRecord.{name} must be a{' non-empty' if name == 'request_id' else ''} "
                                 f"string, got {value!r}")
        if self.status not in STATUSES:
            raise ValueError(f"LedgerRecord.status must be one of {STATUSES}, got {self.status!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
                raise ValueError(f"LedgerRecord.{name} must be a non-negative integer, got {value!r}")
        for name in ("received_at", "finished_at", "ttft_s", "latency_s"):
            value = getattr(self, name)
            if value is None and name == "ttft_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"LedgerRecord.{name} must be a non-negative number, got {value!r}")
            setattr(self, name, float(value))
        if not isinstance(self.streamed, bool):
            raise ValueError(f"LedgerRecord.streamed must be a bool, got {self.streamed!r}")
        if self.api_key_id is not None and not isinstance(self.api_key_id, str):
            raise ValueError(f"LedgerRecord.api_key_id must be a string or None, got {self.api_key_id!r}")
        if self.conversation_id is not None and not isinstance(self.conversation_id, str):
            raise ValueError(f"LedgerRecord.conversation_id must be a string or None, got {self.conversation_id!r}")
        if self.reuse_ratio is not None:
            if isinstance(self.reuse_ratio, bool) or not isinstance(self.reuse_ratio, (int, float)) \
                    or not math.isfinite(self.reuse_ratio) or self.reuse_ratio < 0:
                raise ValueError(f"LedgerRecord.reuse_ratio must be a non-negative number or None, "
                                 f"got {self.reuse_ratio!r}")
            self.reuse_ratio = float(self.reuse_ratio)

    @property
    def probe(self) -> bool:
        """A health probe (``python -m qwen_vllm_ext.doctor``): recorded and in the instance totals (the engine did the
        work), but not in the daily aggregates nor, by default, in reports."""
        return self.request_id.startswith(PROBE_PREFIX)

    @property
    def billed_total_micro(self) -> int:
        return self.billed_prompt_micro + self.billed_completion_micro

    @property
    def day(self) -> str:
        """UTC day of ``finished_at``: the ``daily`` aggregate this record counts in."""
        return utc_day(self.finished_at)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LedgerRecord":
        """Inverse of :meth:`to_dict`; unknown keys are ignored (forward compatibility)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
