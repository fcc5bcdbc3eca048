"""Totals and reports over records or daily aggregates, and the interface every ledger store provides."""
from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

from .record import DAILY_FIELDS, REPORT_BY, STATUSES, TOTAL_FIELDS, LedgerRecord, _day_start


def _empty_totals() -> dict[str, Any]:
    return {**{f: 0 for f in TOTAL_FIELDS}, "by_status": {s: 0 for s in STATUSES}}


def _totals_of(records: Iterable[LedgerRecord]) -> dict[str, Any]:
    out = _empty_totals()
    for r in records:
        out["requests"] += 1
        for f in TOTAL_FIELDS[1:-2]:
            out[f] += getattr(r, f)
        out["billed_micro"] += r.billed_total_micro
        out["cost_pico_usd"] += r.cost_pico_usd
        out["by_status"][r.status] += 1
    return out


def _report_rows(by: str, groups: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    return [{by: k, **{f: v[f] for f in DAILY_FIELDS}} for k, v in sorted(groups.items())]


def _report_from_records(by: str, records: Iterable[LedgerRecord]) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, int]] = {}
    for r in records:
        k = {"key": r.api_key_id or "", "model": r.model, "day": r.day, "instance": r.instance_id}[by]
        g = groups.setdefault(k, dict.fromkeys(DAILY_FIELDS, 0))
        g["requests"] += 1
        g["prompt_tokens"] += r.prompt_tokens
        g["cached_tokens"] += r.cached_tokens
        g["completion_tokens"] += r.completion_tokens
        g["billed_micro"] += r.billed_total_micro
        g["cost_pico_usd"] += r.cost_pico_usd
    return _report_rows(by, groups)


def _report_from_daily(by: str, daily_rows: Iterable[dict[str, Any]], since: float | None,
                       until: float | None) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, int]] = {}
    for row in daily_rows:
        start = _day_start(row["day"])
        if (since is not None and start < since) or (until is not None and start >= until):
            continue
        g = groups.setdefault(row[REPORT_BY[by]], dict.fromkeys(DAILY_FIELDS, 0))
        for f in DAILY_FIELDS:
            g[f] += int(row.get(f) or 0)  # rows written before a field existed lack it
    return _report_rows(by, groups)


def _midnight(ts: float | None) -> bool:
    return ts is None or ts % 86400 == 0


def _from_daily(by: str, since: float | None, until: float | None) -> bool:
    """Whether the exact daily aggregates answer this report (whole UTC days, grouped by a daily column)."""
    return by != "instance" and _midnight(since) and _midnight(until)


def _check_by(by: str) -> None:
    if by not in REPORT_BY:
        raise ValueError(f"report by must be one of {sorted(REPORT_BY)}, got {by!r}")


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"requests limit must be a positive integer, got {limit!r}")


@runtime_checkable
class LedgerStore(Protocol):
    """What every ledger backend provides (identical semantics). Time ranges: ``since <= finished_at < until``."""

    url: str
    default_spill_dir: str | None

    def write_batch(self, records: list[LedgerRecord]) -> int:
        """Record a batch atomically (all or nothing); returns the number newly recorded. A request id
        already present (also earlier in the same batch) is ignored: nothing changes, nothing double counts."""

    def write_batch_flags(self, records: list[LedgerRecord]) -> list[bool]:
        """Like :meth:`write_batch`, one flag per record: True if newly recorded, False if already present."""

    def get(self, request_id: str) -> LedgerRecord | None: ...

    def records(self, since: float | None = None, until: float | None = None,
                instance_id: str | None = None) -> list[LedgerRecord]:
        """Records ordered by (finished_at, request_id)."""

    def requests(self, since: float | None = None, until: float | None = None, api_key_id: str | None = None,
                 model: str | None = None, limit: int = 100, include_probes: bool = False) -> list[LedgerRecord]:
        """The newest ``limit`` records (ordered by (finished_at, request_id), descending) of the window, of one API key
        (``''`` = requests without a key) and/or one model when given; health probes left out unless
        ``include_probes``. Reads only as far back as the rows it returns (SQLite: the ``finished_at`` index; Redis:
        ``by_finished`` newest first, page by page)."""

    def totals(self, instance_id: str | None = None, since: float | None = None) -> dict[str, Any]:
        """``requests``, token sums, ``billed_micro`` and ``by_status`` (every status, 0 included)."""

    def instance_tokens(self, instance_id: str) -> dict[str, int]:
        """``engine_prompt_tokens`` and ``completion_tokens`` summed over one instance's records (what vLLM's counters
        of that server count): cheap enough for every metrics scrape."""

    def report(self, by: str = "key", since: float | None = None, until: float | None = None,
               include_probes: bool = False) -> list[dict]:
        """One row per key/model/day: ``{by: value, requests, prompt_tokens, cached_tokens,
        completion_tokens, billed_micro}`` sorted by value (key '' = no API key); health probes left out unless
        ``include_probes``."""

    def daily(self, api_key_id: str | None, day: str) -> dict[str, int]:
        """The exact per-(key, day) aggregate summed over models (zeros when absent)."""

    def close(self) -> None: ...


class Reports:
    """``report()`` for both stores: from the exact daily aggregates when they answer the question (whole UTC days,
    grouped by a daily column, probes left out), else from the records. A store provides ``_daily_rows()`` and
    ``records()``."""

    def report(self, by="key", since=None, until=None, include_probes=False) -> list[dict[str, Any]]:
        _check_by(by)
        if _from_daily(by, since, until) and not include_probes:
            return _report_from_daily(by, self._daily_rows(), since, until)
        return _report_from_records(by, (r for r in self.records(since, until) if include_probes or not r.probe))
