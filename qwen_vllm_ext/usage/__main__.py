"""Operator CLI: ``python -m qwen_vllm_ext.usage report [--by key|model|day] [--json|--csv] ...``,
``python -m qwen_vllm_ext.usage report --requests [--key ID] [--model NAME] [--limit N] ...`` (one row per request,
newest first) and ``python -m qwen_vllm_ext.usage reconcile --url http://HOST:PORT`` (exit 1 on drift).

The ledger defaults come from the settings (``Settings.current()``): backend ``ledger_backend``
(``sqlite``), Redis URL ``ledger_redis_url``, SQLite file ``<data_dir>/ledger.sqlite3``; flags override.
``--days N`` means the current UTC day and the N-1 before it; ``--since``/``--until`` take an ISO date/time or an age
(``15m``, ``2h``, ``1d``: that long before now). Subcommands: add a parser in :func:`build_parser` and a handler in
``COMMANDS``.
"""
from __future__ import annotations

import argparse
import calendar
import csv
import datetime as dt
import json
import os
import re
import sys
import time
from typing import Any, Callable

from qwen_v3_calculator.billing import usd

from qwen_vllm_ext.store import locations
from qwen_vllm_ext.usage.ledger import (DAILY_FIELDS, MICRO, LedgerRecord, LedgerUnavailable, REPORT_BY,
                                        SqliteLedgerStore, open_store)

FAILURE = 2
DEFAULT_LIMIT = 100  # report --requests
_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_AGE_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(text: str, now: float | None = None) -> float:
    """ISO 8601 date or datetime (naive = UTC), or an age before ``now`` (``90s``, ``15m``, ``2h``, ``1d``,
    ``1w``) -> unix seconds."""
    age = _AGE.fullmatch(text.strip())
    if age:
        return (time.time() if now is None else now) - float(age[1]) * _AGE_UNIT_S[age[2]]
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO date/time nor an age: {text!r} (e.g. 2025-01-31, "
                                         "2025-01-31T12:00:00+00:00, 15m, 2h or 1d)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def iso_utc(ts: float) -> str:
    """Unix seconds -> ISO 8601 UTC with milliseconds, e.g. ``2025-03-01T12:00:00.250Z``."""
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def days_since(days: int, now: float | None = None) -> float:
    """Start (UTC midnight) of the window made of today and the ``days - 1`` days before it."""
    today = calendar.timegm(time.gmtime(time.time() if now is None else now)[:3] + (0, 0, 0))
    return float(today - 86400 * (days - 1))


def add_store_args(p: argparse.ArgumentParser) -> None:
    """Flags choosing the ledger (shared with other subcommands)."""
    p.add_argument("--backend", choices=("sqlite", "redis"), help="ledger backend (default: setting "
                   "ledger_backend, else sqlite)")
    p.add_argument("--db", help="SQLite ledger file (default: <data_dir>/ledger.sqlite3)")
    p.add_argument("--redis-url", help="Redis URL (default: setting ledger_redis_url)")


def open_from_args(args: argparse.Namespace):
    """Open the store the flags (or settings) name; raises LedgerUnavailable with a clear message."""
    from qwen_vllm_ext.config import Settings

    settings = Settings.current()
    where = locations.ledger(settings, args.backend, db=args.db, redis_url=args.redis_url)
    if where.backend == "redis":
        return open_store("redis", where.target)
    path = where.target
    if not os.path.exists(path):                   # reporting must not create an empty ledger
        raise LedgerUnavailable(f"no SQLite ledger at {path} (use --db PATH, or --backend redis)")
    return SqliteLedgerStore(path)


def billed(micro: int) -> str:
    """Exact decimal text of integer micro-units."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(micro), MICRO)
    return f"{sign}{whole}.{frac:06d}"


COUNTS = DAILY_FIELDS[:4]  # requests and token sums; then billed units and the cost


def money(row: dict[str, Any]) -> list[str]:
    """Billed units (exact) and the cost in USD, rounded half-even to 6 decimals: the one rounding the ledger's exact
    pico-dollars ever get (``qwen_v3_calculator.billing.usd``)."""
    return [billed(row["billed_micro"]), usd(row["cost_pico_usd"])]


def render_table(head: list[str], body: list[list[str]], foot: list[str] | None = None, left: int = 1) -> str:
    """Aligned columns: the first ``left`` left-justified, the rest right-justified; a rule under the head (and above
    the foot)."""
    lines = [head, *body, *([foot] if foot else [])]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]

    def fmt(line: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(head), rule, *map(fmt, body), *([rule, fmt(foot)] if foot else [])])


def format_table(by: str, rows: list[dict[str, Any]]) -> str:
    total = {f: sum(r[f] for r in rows) for f in DAILY_FIELDS}
    return render_table([by, *COUNTS, "billed", "cost_usd"],
                        [[str(r[by]) or "-", *(str(r[f]) for f in COUNTS), *money(r)] for r in rows],
                        ["TOTAL", *(str(total[f]) for f in COUNTS), *money(total)])


# report --requests: the row of one record (JSON keeps the integer billed_micro and cost_pico_usd, as report --json).
REQUEST_TEXT = ("request_id", "received_at", "key", "model", "status")
REQUEST_NUMBERS = ("http_status", "latency_s", "prompt_tokens", "cached_tokens", "completion_tokens",
                   "reasoning_tokens")
REQUEST_FIELDS = (*REQUEST_TEXT, *REQUEST_NUMBERS, "billed_micro", "cost_pico_usd")


def request_row(r: LedgerRecord) -> dict[str, Any]:
    """One request as ``report --requests`` shows it: ``received_at`` ISO UTC, ``key`` '' without an API key."""
    return {"request_id": r.request_id, "received_at": iso_utc(r.received_at), "key": r.api_key_id or "",
            "model": r.model, "status": r.status, "http_status": r.http_status, "latency_s": r.latency_s,
            **{f: getattr(r, f) for f in REQUEST_NUMBERS[2:]}, "billed_micro": r.billed_total_micro,
            "cost_pico_usd": r.cost_pico_usd}


def request_cells(row: dict[str, Any]) -> list[str]:
    """Table and CSV cells of a :func:`request_row` (billed exact, cost rounded as in the report)."""
    return [*(str(row[f]) for f in REQUEST_TEXT), str(row["http_status"]), f"{row['latency_s']:.3f}",
            *(str(row[f]) for f in REQUEST_NUMBERS[2:]), *money(row)]


def format_requests(rows: list[dict[str, Any]]) -> str:
    return render_table([*REQUEST_TEXT, *REQUEST_NUMBERS, "billed", "cost_usd"],
                        [[c or "-" for c in request_cells(r)] for r in rows], left=len(REQUEST_TEXT))


def report_requests(args: argparse.Namespace, since: float | None) -> int:
    """``report --requests``: the newest ``--limit`` records of the window (finished_at, as the grouped report)."""
    store = open_from_args(args)
    try:
        records = store.requests(since=since, until=args.until, api_key_id=args.key, model=args.model,
                                 limit=args.limit, include_probes=args.include_probes)
    finally:
        store.close()
    rows = [request_row(r) for r in records]
    if args.json:
        print(json.dumps({"since": since, "until": args.until, "key": args.key, "model": args.model,
                          "limit": args.limit, "rows": rows}, indent=2))
    elif args.csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow([*REQUEST_TEXT, *REQUEST_NUMBERS, "billed", "cost_usd"])
        out.writerows(request_cells(r) for r in rows)
    else:
        print(format_requests(rows))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    since = days_since(args.days) if args.days is not None else args.since
    if args.requests:
        return report_requests(args, since)
    store = open_from_args(args)
    try:
        rows = store.report(by=args.by, since=since, until=args.until, include_probes=args.include_probes)
    finally:
        store.close()
    if args.json:
        total = {f: sum(r[f] for r in rows) for f in DAILY_FIELDS}
        print(json.dumps({"by": args.by, "since": since, "until": args.until, "rows": rows, "total": total},
                         indent=2))
    elif args.csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow([args.by, *DAILY_FIELDS, "billed", "cost_usd"])
        for r in rows:
            out.writerow([r[args.by], *(r[f] for f in DAILY_FIELDS), *money(r)])
    else:
        print(format_table(args.by, rows))
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    """Ledger totals vs the server's Prometheus counters since its start; exit 1 on any drift."""
    from urllib.error import URLError

    from qwen_vllm_ext.usage.reconcile import fetch, reconcile

    try:
        if not (args.backend or args.db or args.redis_url):  # the ledger the server itself writes to
            settings = json.loads(fetch(args.url, "/qwen_ext/health", token=args.admin_key))["settings"]
            if "data_dir" not in settings:
                raise ValueError("the server shows its settings only to the admin when the gateway is on: pass "
                                 "--admin-key (or QWEN_VLLM_EXT_ADMIN_KEY), or name the ledger with --db/--redis-url")
            args.backend = settings["ledger_backend"]
            args.redis_url = settings.get("ledger_redis_url") or None
            args.db = locations.ledger_file(settings["data_dir"])
        store = open_from_args(args)
        result = reconcile(args.url, store, admin_key=args.admin_key)
    except (URLError, OSError, KeyError, ValueError) as exc:
        print(f"error: cannot reconcile with {args.url}: {exc}", file=sys.stderr)
        return FAILURE
    drift = result["drift"]
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"instance {result['instance_id']}: {result['ledger']['requests']} ledger records")
        for name, metric in (("prompt_tokens", "vllm:prompt_tokens_total"),
                             ("completion_tokens", "vllm:generation_tokens_total")):
            ledger_key = "engine_prompt_tokens" if name == "prompt_tokens" else name
            print(f"  {name:18} server {int(result['server'][metric]):>12}  ledger "
                  f"{int(result['ledger'][ledger_key]):>12}  drift {drift[name]:>+8}")
    ok = not any(drift.values())
    print("no drift" if ok else "DRIFT: the ledger and the server disagree", file=sys.stderr)
    return 0 if ok else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"report": cmd_report, "reconcile": cmd_reconcile}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qwen_vllm_ext.usage",
                                     description="Usage ledger tools of qwen-vllm-ext.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="usage and billed units per API key, model or UTC day; or per request "
                         "(--requests)")
    rep.add_argument("--by", choices=sorted(REPORT_BY), help="group by (default: key; not with --requests)")
    rep.add_argument("--requests", action="store_true",
                     help="one row per request, newest first (by finished_at): request id, received_at, key, model, "
                     "status, HTTP status, latency, tokens, billed units and cost")
    rep.add_argument("--key", help="--requests: only this API key id ('' = requests without a key)")
    rep.add_argument("--model", help="--requests: only this model")
    rep.add_argument("--limit", type=positive_int,
                     help=f"--requests: at most N rows, the newest (default {DEFAULT_LIMIT})")
    rep.add_argument("--include-probes", action="store_true",
                     help="count the doctor's health probes (request ids qwen-doctor-*) too")
    window = rep.add_mutually_exclusive_group()
    window.add_argument("--since", type=parse_time, help="ISO date/time (UTC if no zone) or an age (15m, 2h, 1d: "
                        "that long ago); finished_at >= since")
    window.add_argument("--days", type=int, help="today (UTC) and the N-1 days before")
    rep.add_argument("--until", type=parse_time, help="ISO date/time or an age; finished_at < until")
    fmt = rep.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="JSON object: rows and total (billed_micro integers; "
                     "--requests: rows only)")
    fmt.add_argument("--csv", action="store_true", help="CSV with a header row")
    add_store_args(rep)
    rec = sub.add_parser("reconcile", help="compare ledger totals with a running server's Prometheus counters")
    rec.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    rec.add_argument("--admin-key", default=os.environ.get("QWEN_VLLM_EXT_ADMIN_KEY") or None,
                     help="the server's admin key (default: QWEN_VLLM_EXT_ADMIN_KEY): with the gateway on, the server "
                     "shows its instance id and settings only to the admin")
    rec.add_argument("--json", action="store_true")
    add_store_args(rec)
    return parser


def check_report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options of ``report`` that go together (an argparse error, exit 2, otherwise); fills in the defaults."""
    if args.requests:
        if args.by is not None:
            parser.error("argument --by: not allowed with --requests (one row per request)")
        args.limit = DEFAULT_LIMIT if args.limit is None else args.limit
    else:
        for flag in ("key", "model", "limit"):
            if getattr(args, flag) is not None:
                parser.error(f"argument --{flag}: only with --requests")
        args.by = args.by or "key"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        check_report(parser, args)
    if getattr(args, "days", None) is not None and args.days < 1:
        print("error: --days must be at least 1", file=sys.stderr)
        return FAILURE
    try:
        return COMMANDS[args.command](args)
    except LedgerUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILURE


if __name__ == "__main__":
    sys.exit(main())
