"""The one way the extension connects to Redis (ledger, API keys, limiter): fail loudly, never retry silently."""
from __future__ import annotations

import re


def safe_url(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


def connect(url: str, error_cls: type[Exception], what: str, socket_timeout_s: float = 5.0):
    """A decoded-responses client that answered PING, or ``error_cls`` naming ``what`` and the (safe) URL.

    The client never retries by itself: retrying is the caller's decision (the ledger writer retries with
    backoff and spills; a limiter reservation must not be applied twice).
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=5,
                                      retry=Retry(NoBackoff(), 0), decode_responses=True)
        client.ping()
    except (redis.exceptions.RedisError, OSError, ValueError) as exc:
        raise error_cls(f"cannot reach the Redis {what} at {safe_url(url)}: {exc}") from exc
    return client
