"""Which backend and which file or URL each store uses (from the settings; CLI flags may override).

The ledger and the API keys share one store (``<data_dir>/ledger.sqlite3`` or ``ledger_redis_url``); the limiter
has its own (``<data_dir>/limiter.sqlite3`` or ``limiter_redis_url``, defaulting to ``ledger_redis_url``).
"""
from __future__ import annotations

import dataclasses
import os

LEDGER_FILE = "ledger.sqlite3"  # the usage ledger and the API keys
LIMITER_FILE = "limiter.sqlite3"


@dataclasses.dataclass(frozen=True)
class Location:
    backend: str  # "sqlite" | "redis" | "memory"
    target: str  # SQLite file path, Redis URL, or "" (memory)


def ledger_file(data_dir: str) -> str:
    return os.path.join(data_dir, LEDGER_FILE)


def ledger(settings, backend: str | None = None, db: str | None = None, redis_url: str | None = None) -> Location:
    """The ledger's (and the API keys') store: ``backend`` defaults to ``ledger_backend`` (``redis`` when only a
    ``redis_url`` is given, ``sqlite`` when only a ``db`` file is)."""
    backend = backend or ("redis" if redis_url else "sqlite" if db else settings.ledger_backend)
    if backend == "redis":
        return Location("redis", redis_url or settings.ledger_redis_url)
    return Location(backend, db or ledger_file(settings.data_dir))


def limiter(settings) -> Location:
    if settings.limiter_backend == "redis":
        return Location("redis", settings.limiter_redis_url or settings.ledger_redis_url)
    if settings.limiter_backend == "memory":
        return Location("memory", "")
    return Location(settings.limiter_backend, os.path.join(settings.data_dir, LIMITER_FILE))


def shared_state_problem(settings) -> str | None:
    """Why these settings do not give every replica of a fleet the same keys, limits and ledger (``None`` when they
    do, or when ``require_shared_state`` is off). The launcher refuses to start with it; so does the plugin."""
    if not settings.require_shared_state:
        return None
    wrong = []
    for name, loc in (("ledger_backend (ledger and API keys)", ledger(settings)), ("limiter_backend", limiter(settings))):
        if loc.backend != "redis":
            wrong.append(f"{name} is {loc.backend}")
        elif not loc.target:
            wrong.append(f"{name} is redis without a URL")
    if not wrong:
        return None
    return ("require_shared_state is on (a replica of a fleet) but " + "; ".join(wrong) + ": per-host state would "
            "split limits, keys and the ledger between replicas. Set ledger_backend=redis, limiter_backend=redis and "
            "ledger_redis_url=redis://HOST:6379/0 (or turn require_shared_state off for a single server)")


def unreachable_store(settings) -> str | None:
    """Why a Redis store these settings name cannot be used now: the first that does not answer PING (``None`` when
    each does, or none is Redis). The launcher refuses with it before vLLM loads; a server started otherwise still
    refuses at start-up, when its store connects."""
    from .redis import connect

    tried = set()
    used = (("ledger_redis_url", "ledger", ledger(settings), settings.ledger or settings.gateway),  # keys live there
            ("limiter_redis_url", "limiter", limiter(settings), settings.gateway))
    for setting, what, loc, on in used:
        if not (settings.enabled and on) or loc.backend != "redis" or not loc.target or loc.target in tried:
            continue
        tried.add(loc.target)
        try:
            connect(loc.target, ConnectionError, what, socket_timeout_s=5.0).close()
        except ConnectionError as exc:
            return f"setting '{setting}': {exc} (start that Redis, or point the setting at one that runs)"
    return None
