"""Operator CLI for gateway API keys: ``python -m qwen_vllm_ext.keys create|list|show|update|revoke``.

``create --name NAME [scope]`` prints the secret ONCE (it is not stored: only its HMAC is). Scope options
(create and update): ``--models a,b`` ``--rpm N`` ``--tpm N`` ``--max-concurrent N`` ``--max-tokens-cap N``
``--daily-budget X`` ``--monthly-budget X`` (billed units, up to 6 decimals) ``--expires WHEN`` (unix time,
ISO date/time, or a duration: 30d, 12h) ``--label k=v`` (repeatable). In ``update``, a limit ``none`` (or
``unlimited``) removes it, ``--expires never`` removes the expiry, ``--all-models`` clears the model list,
``--unlabel k`` removes a label, ``--suspend-until WHEN [--suspend-reason TEXT]`` / ``--unsuspend``.
``list`` (``--all`` includes revoked keys) and ``show KEY_ID`` print tables, or JSON with ``--json``; neither
ever shows a secret. ``revoke KEY_ID`` is final.

The store is the ledger's (``--backend sqlite|redis``, ``--db PATH``, ``--redis-url URL``), defaulting from
the settings: ``ledger_backend``, ``<data_dir>/ledger.sqlite3``, ``ledger_redis_url``. Exit status 2 for
bad values, unknown key ids and an unreachable store.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any

from qwen_vllm_ext.common.client_strings import printable
from qwen_vllm_ext.config import Settings
from qwen_vllm_ext.keys import (MICRO, ApiKey, KeyNotFound, KeyStoreUnavailable, open_key_store,
                                        parse_billed, parse_expiry)

FAILURE = 2
_UNLIMITED = ("none", "unlimited")


def _arg(fn):
    """Turn a ValueError of ``fn`` into argparse's clean 'argument --x: ...' error (exit 2)."""
    def parse(text: str) -> Any:
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = fn.__name__
    return parse


@_arg
def limit(text: str) -> int | None:
    if text.strip().lower() in _UNLIMITED:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer or 'none', got {text!r}") from None
    if value <= 0:
        raise ValueError(f"expected a positive integer or 'none', got {text!r}")
    return value


@_arg
def budget(text: str) -> int | None:
    return None if text.strip().lower() in _UNLIMITED else parse_billed(text)


@_arg
def when(text: str) -> float | None:
    return parse_expiry(text)


@_arg
def models(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError("expected comma-separated model names (use --all-models for every model)")
    return names


@_arg
def label(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return name.strip(), value


# dest -> ApiKey field for the scope options
_FIELDS = {"models": "models", "rpm": "rpm", "tpm": "tpm", "max_concurrent": "max_concurrent",
           "max_tokens_cap": "max_tokens_cap", "max_n": "max_n", "daily_budget": "daily_budget_micro",
           "monthly_budget": "monthly_budget_micro", "expires": "expires_at", "name": "name",
           "suspend_until": "suspended_until", "suspend_reason": "suspend_reason", "spike_breaker": "spike_breaker"}


def _fields(args: argparse.Namespace, current: ApiKey | None = None) -> dict[str, Any]:
    """The fields the given options set (options not given are absent: argparse.SUPPRESS)."""
    given = vars(args)
    out = {field: given[dest] for dest, field in _FIELDS.items() if dest in given}
    if given.get("all_models"):
        out["models"] = []
    if given.get("unsuspend"):
        out["suspended_until"], out["suspend_reason"] = None, None
    if "label" in given or "unlabel" in given:
        labels = dict(current.labels) if current else {}
        labels.update(given.get("label", []))
        for name in given.get("unlabel", []):
            labels.pop(name, None)
        out["labels"] = labels
    return out


# ---------------------------------------------------------------------------------------------- output
def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _billed(micro: int | None) -> str:
    if micro is None:
        return "-"
    whole, frac = divmod(micro, MICRO)
    return f"{whole}.{frac:06d}".rstrip("0").rstrip(".")


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _public(key: ApiKey) -> dict[str, Any]:
    return {**key.to_public_dict(), "status": key.status()}


def show_lines(key: ApiKey) -> list[tuple[str, str]]:
    status = key.status()
    if status == "suspended":
        status += (f" until {_time(key.suspended_until)} ({key.suspend_reason or 'no reason given'}); lift it with "
                   f"`python -m qwen_vllm_ext.keys update {key.key_id} --unsuspend`")
    return [("key_id", key.key_id), ("name", key.name), ("prefix", key.prefix + "..."), ("status", status),
            ("created", _time(key.created_at)), ("expires", _time(key.expires_at)),
            ("revoked", _time(key.revoked_at)), ("models", ", ".join(key.models) or "(all)"),
            ("rpm", _num(key.rpm)), ("tpm", _num(key.tpm)), ("max_concurrent", _num(key.max_concurrent)),
            ("max_tokens_cap", _num(key.max_tokens_cap)), ("max_n", _num(key.max_n)), ("daily_budget", _billed(key.daily_budget_micro)),
            ("monthly_budget", _billed(key.monthly_budget_micro)),
            ("labels", ", ".join(f"{k}={v}" for k, v in sorted(key.labels.items())) or "-"),
            ("spike_breaker", "on" if key.spike_breaker else "exempt")]


def format_show(key: ApiKey) -> str:
    lines = show_lines(key)
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {printable(v)}" for k, v in lines)


def format_list(keys: list[ApiKey]) -> str:
    head = ["KEY_ID", "NAME", "PREFIX", "STATUS", "MODELS", "RPM", "TPM", "CONC", "MAX_TOK", "DAILY",
            "MONTHLY", "EXPIRES"]
    rows = [[printable(c) for c in row] for row in ([k.key_id, k.name, k.prefix + "...", k.status(), ",".join(k.models) or "(all)", _num(k.rpm),
             _num(k.tpm), _num(k.max_concurrent), _num(k.max_tokens_cap), _billed(k.daily_budget_micro),
             _billed(k.monthly_budget_micro), _time(k.expires_at)] for k in keys)]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows])


# -------------------------------------------------------------------------------------------- commands
def _emit(args: argparse.Namespace, key: ApiKey) -> None:
    print(json.dumps(_public(key), indent=2, sort_keys=True) if args.json else format_show(key))


def cmd_create(store, args: argparse.Namespace) -> int:
    secret, key = store.create(**_fields(args))
    if args.json:
        print(json.dumps({"secret": secret, "key": _public(key)}, indent=2, sort_keys=True))
    else:
        print(f"Created API key {key.key_id} ({printable(key.name)}). Its secret:\n\n    {secret}\n")
        print(format_show(key))
    print("WARNING: the secret above is shown only now and is NOT stored (only its HMAC is); copy it now. "
          f"A lost secret cannot be recovered: revoke {key.key_id} and create a new key.", file=sys.stderr)
    return 0


def cmd_list(store, args: argparse.Namespace) -> int:
    keys = store.list(include_revoked=args.all)
    print(json.dumps([_public(k) for k in keys], indent=2, sort_keys=True) if args.json else format_list(keys))
    return 0


def _require(store, key_id: str) -> ApiKey:
    key = store.get(key_id)
    if key is None:
        raise KeyNotFound(key_id)
    return key


def cmd_show(store, args: argparse.Namespace) -> int:
    _emit(args, _require(store, args.key_id))
    return 0


def cmd_update(store, args: argparse.Namespace) -> int:
    fields = _fields(args, _require(store, args.key_id))
    if not fields:
        raise ValueError("nothing to update: give at least one option (see --help)")
    _emit(args, store.update(args.key_id, **fields))
    return 0


def cmd_revoke(store, args: argparse.Namespace) -> int:
    _emit(args, store.revoke(args.key_id))
    return 0


COMMANDS = {"create": cmd_create, "list": cmd_list, "show": cmd_show, "update": cmd_update, "revoke": cmd_revoke}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=("sqlite", "redis"), help="store backend (default: setting "
                        "ledger_backend; redis when --redis-url is given)")
    common.add_argument("--db", help="SQLite file (default: <data_dir>/ledger.sqlite3)")
    common.add_argument("--redis-url", help="Redis URL (default: setting ledger_redis_url)")
    common.add_argument("--json", action="store_true", help="JSON output")
    S = argparse.SUPPRESS
    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument("--models", type=models, default=S, help="comma-separated allowed models (default: all)")
    for flag, kind, what in (("--rpm", limit, "requests per minute"), ("--tpm", limit, "tokens per minute"),
                             ("--max-concurrent", limit, "concurrent requests"),
                             ("--max-tokens-cap", limit, "cap on a request's max_tokens"),
                             ("--max-n", limit, "most parallel samples (n) per request, below the server's max_n"),
                             ("--daily-budget", budget, "billed units per UTC day"),
                             ("--monthly-budget", budget, "billed units per UTC month")):
        scope.add_argument(flag, type=kind, default=S, help=f"{what} ('none' = unlimited)")
    scope.add_argument("--expires", type=when, default=S, help="unix time, ISO date/time (UTC if no zone), "
                       "duration from now (30d, 12h, 90m) or 'never'")
    scope.add_argument("--label", type=label, action="append", default=S, help="KEY=VALUE (repeatable)")
    scope.add_argument("--spike-breaker", action=argparse.BooleanOptionalAction, default=S,
                       help="watch the key with the spike breaker (default); --no-spike-breaker: exempt, for the one "
                            "key an aggregator such as OpenRouter sends all of a provider's traffic with")

    parser = argparse.ArgumentParser(prog="python -m qwen_vllm_ext.keys",
                                     description="API keys of the qwen-vllm-ext gateway (secrets are shown once).")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", parents=[common, scope], help="create a key (prints its secret once)")
    create.add_argument("--name", required=True, help="a label for people (not unique)")
    lst = sub.add_parser("list", parents=[common], help="list keys (no secrets)")
    lst.add_argument("--all", action="store_true", help="include revoked keys")
    sub.add_parser("show", parents=[common], help="show one key").add_argument("key_id")
    upd = sub.add_parser("update", parents=[common, scope], help="change a key's name or scope")
    upd.add_argument("key_id")
    upd.add_argument("--name", default=S)
    upd.add_argument("--all-models", action="store_true", help="allow every model")
    upd.add_argument("--unlabel", action="append", default=S, metavar="KEY", help="remove a label (repeatable)")
    upd.add_argument("--suspend-until", type=when, default=S, metavar="WHEN", help="suspend until WHEN")
    upd.add_argument("--suspend-reason", default=S)
    upd.add_argument("--unsuspend", action="store_true", help="end a suspension")
    sub.add_parser("revoke", parents=[common], help="revoke a key (final)").add_argument("key_id")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        backend = args.backend or ("redis" if args.redis_url else "sqlite" if args.db else None)  # None: settings
        store = open_key_store(backend, args.redis_url if backend == "redis" else args.db, Settings.current())
        try:
            return COMMANDS[args.command](store, args)
        finally:
            store.close()
    except (KeyNotFound, KeyStoreUnavailable, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILURE


if __name__ == "__main__":
    sys.exit(main())
