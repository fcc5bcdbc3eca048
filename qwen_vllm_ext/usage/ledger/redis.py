"""The shared ledger store on Redis: one Lua script per batch (``ledger.lua``, package data)."""
from __future__ import annotations

import importlib.resources
import json
from typing import Any

from ...store.redis import connect
from .record import DAILY_FIELDS, LedgerRecord, LedgerUnavailable
from .report import Reports, _check_limit, _empty_totals, _totals_of

# ARGV: prefix, then per record: id, json, finished_at, instance, api_key ('' = none), day, model, status,
# daily hash name (``qve:daily:<day>:<key>:<model>``, ':' and '%' in key/model percent-encoded), prompt,
# engine_prompt, cached, completion, reasoning, billed_micro, cost_pico_usd. Returns one 0/1 per record.
# The shebang makes Redis check OOM before the script starts, so a batch is applied entirely or not at all.
_LUA = (importlib.resources.files(__package__) / "ledger.lua").read_text()


class RedisLedgerStore(Reports):
    """The shared ledger on a (single, non-cluster) Redis server; several replicas may write concurrently."""

    def __init__(self, url: str, prefix: str = "qve:", socket_timeout_s: float = 10.0):
        import redis

        self.url, self.prefix, self.default_spill_dir = url, prefix, None
        # Conditions of the server that pass (a replica promoted, memory freed): retried, then spilled and replayed
        # -- never taken for a fault of the record (LedgerWriter dead-letters records a working store refuses).
        passing = tuple(getattr(redis.exceptions, name) for name in ("ReadOnlyError", "OutOfMemoryError",
                                                                     "MasterDownError", "TryAgainError")
                        if hasattr(redis.exceptions, name))
        self.transient_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                                 redis.exceptions.BusyLoadingError, OSError, *passing)
        self.record_errors = (redis.exceptions.DataError,)  # the record cannot be sent (LedgerWriter: dead letter)
        # Retries are the LedgerWriter's job (with backoff and spill): the client itself tries once.
        self._r = connect(url, LedgerUnavailable, "ledger", socket_timeout_s)
        self._script = self._r.register_script(_LUA)

    def write_batch(self, records: list[LedgerRecord]) -> int:
        return sum(self.write_batch_flags(records))

    def _daily_key(self, r: LedgerRecord) -> str:
        esc = lambda s: s.replace("%", "%25").replace(":", "%3A")   # noqa: E731  keep the key unambiguous
        return f"{self.prefix}daily:{r.day}:{esc(r.api_key_id or '')}:{esc(r.model)}"

    def write_batch_flags(self, records: list[LedgerRecord]) -> list[bool]:
        args: list[Any] = [self.prefix]
        for r in records:
            r.validate()
            args += [r.request_id, json.dumps(r.to_dict(), separators=(",", ":")), repr(r.finished_at),
                     r.instance_id, r.api_key_id or "", r.day, r.model, r.status,
                     "" if r.probe else self._daily_key(r),
                     r.prompt_tokens, r.engine_prompt_tokens, r.cached_tokens, r.completion_tokens, r.reasoning_tokens,
                     r.billed_total_micro, r.cost_pico_usd]
        if not records:
            return []
        return [bool(x) for x in self._script(args=args)]

    def get(self, request_id: str) -> LedgerRecord | None:
        blob = self._r.get(self.prefix + "req:" + request_id)
        return LedgerRecord.from_dict(json.loads(blob)) if blob else None

    def records(self, since=None, until=None, instance_id=None) -> list[LedgerRecord]:
        lo = "-inf" if since is None else repr(float(since))
        hi = "+inf" if until is None else "(" + repr(float(until))
        ids = self._r.zrangebyscore(self.prefix + "by_finished", lo, hi)
        out = []
        for i in range(0, len(ids), 1000):
            for blob in self._r.mget([self.prefix + "req:" + x for x in ids[i:i + 1000]]):
                if blob:
                    rec = LedgerRecord.from_dict(json.loads(blob))
                    if instance_id is None or rec.instance_id == instance_id:
                        out.append(rec)
        return out

    def requests(self, since=None, until=None, api_key_id=None, model=None, limit=100,
                 include_probes=False) -> list[LedgerRecord]:
        _check_limit(limit)
        lo = "-inf" if since is None else repr(float(since))
        hi = "+inf" if until is None else "(" + repr(float(until))
        # Newest first (equal scores: request ids descending, as SQLite orders them), one page of ids at a time until
        # `limit` records pass the filters. A record written meanwhile shifts the pages: `seen` drops the repeats.
        page = min(max(limit, 100), 1000)
        out: list[LedgerRecord] = []
        seen: set[str] = set()
        start = 0
        while len(out) < limit:
            ids = self._r.zrevrangebyscore(self.prefix + "by_finished", hi, lo, start=start, num=page)
            start += len(ids)
            for blob in self._r.mget([self.prefix + "req:" + x for x in ids]) if ids else ():
                rec = LedgerRecord.from_dict(json.loads(blob)) if blob else None
                if rec is None or rec.request_id in seen:
                    continue
                seen.add(rec.request_id)
                if (api_key_id is None or (rec.api_key_id or "") == api_key_id) \
                        and (model is None or rec.model == model) and (include_probes or not rec.probe):
                    out.append(rec)
                    if len(out) == limit:
                        break
            if len(ids) < page:
                break
        return out

    def totals(self, instance_id=None, since=None) -> dict[str, Any]:
        if since is not None:
            return _totals_of(self.records(since=since, instance_id=instance_id))
        instances = [instance_id] if instance_id is not None else sorted(self._r.smembers(self.prefix + "instances"))
        out = _empty_totals()
        for inst in instances:
            for field, value in self._r.hgetall(self.prefix + "totals:" + inst).items():
                if field.startswith("status:"):
                    out["by_status"][field[7:]] = out["by_status"].get(field[7:], 0) + int(value)
                else:
                    out[field] += int(value)
        return out

    def instance_tokens(self, instance_id: str) -> dict[str, int]:
        prompt, completion = self._r.hmget(self.prefix + "totals:" + instance_id, "engine_prompt_tokens",
                                           "completion_tokens")
        return {"engine_prompt_tokens": int(prompt or 0), "completion_tokens": int(completion or 0)}

    def _daily_rows(self) -> list[dict[str, Any]]:
        pipe = self._r.pipeline(transaction=False)
        for key in self._r.smembers(self.prefix + "dailies"):
            pipe.hgetall(key)
        return [row for row in pipe.execute() if row]

    def daily(self, api_key_id, day) -> dict[str, int]:
        out = dict.fromkeys(DAILY_FIELDS, 0)
        for row in self._daily_rows():
            if row["api_key_id"] == (api_key_id or "") and row["day"] == day:
                for f in DAILY_FIELDS:
                    out[f] += int(row.get(f) or 0)
        return out

    def close(self) -> None:
        self._r.close()
