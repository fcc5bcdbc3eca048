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
