"""Where keys live: the store interface, the SQLite and Redis stores (identical semantics), and which one to open."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import time
from typing import Any, Callable, Protocol, runtime_checkable

from ..store import locations
from ..store.redis import connect, safe_url
from ..store.sqlite import Database
from .model import ApiKey, KEY_ID_PREFIX, KeyNotFound, KeyStoreUnavailable, SCOPE_FIELDS, SECRET_FILE, validate_fields
from .secrets import _secret_bytes, _secret_file, new_secret, well_formed


@runtime_checkable
class KeyStore(Protocol):
    def create(self, name: str, **scope: Any) -> tuple[str, ApiKey]:
        """New key; returns ``(secret, key)`` -- the only time the secret is available."""

    def authenticate(self, secret: str) -> ApiKey | None:
        """The key of this secret (revoked/expired/suspended included: check ``active``), else None."""

    def get(self, key_id: str) -> ApiKey | None: ...

    def list(self, include_revoked: bool = False) -> list[ApiKey]:
        """Ordered by (created_at, key_id)."""

    def update(self, key_id: str, /, **fields: Any) -> ApiKey:
        """Set ``UPDATABLE_FIELDS``; ValueError naming a bad field, KeyNotFound for an unknown id."""

    def revoke(self, key_id: str) -> ApiKey:
        """Final; idempotent (keeps the first ``revoked_at``)."""

    def suspend(self, key_id: str, until: float | str, reason: str | None) -> ApiKey: ...

    def version(self) -> int:
        """Counter bumped by every change (cheap)."""

    def hash_secret(self, secret: str) -> str:
        """HMAC-SHA256(server secret, secret), hex: the only form in which a secret is stored."""

    def close(self) -> None: ...


class _BaseKeyStore:
    """Semantics shared by both stores; subclasses provide storage primitives."""

    def _init_secret(self, server_secret: str | bytes | None) -> None:
        self._server_secret = _secret_bytes(server_secret or self.stored_server_secret())

    def stored_server_secret(self) -> str:
        """The secret this store keeps for itself (used when no ``gateway_secret`` is configured)."""
        raise NotImplementedError

    def hash_secret(self, secret: str) -> str:
        return hmac.new(self._server_secret, secret.encode("utf-8"), hashlib.sha256).hexdigest()

    def create(self, name: str, **scope: Any) -> tuple[str, ApiKey]:
        fields = validate_fields({"name": name, **scope}, ("name", *SCOPE_FIELDS))
        for _ in range(8):
            secret = new_secret()
            key = ApiKey(key_id=KEY_ID_PREFIX + secrets.token_urlsafe(8)[:10], prefix=secret[:8],
                         created_at=time.time(), **fields)
            if self._insert(key, self.hash_secret(secret)):
                return secret, key
        raise RuntimeError("could not allocate a unique API key id")

    def authenticate(self, secret: str) -> ApiKey | None:
        if not well_formed(secret):
            return None
        digest = self.hash_secret(secret)
        found = self._find_by_hash(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]

    def update(self, key_id: str, /, **fields: Any) -> ApiKey:
        changes = validate_fields(fields)
        return self._mutate(key_id, lambda k: dataclasses.replace(k, **changes))

    def revoke(self, key_id: str) -> ApiKey:
        now = time.time()
        return self._mutate(key_id, lambda k: k if k.revoked_at is not None else dataclasses.replace(k, revoked_at=now))

    def suspend(self, key_id: str, until: float | str, reason: str | None) -> ApiKey:
        fields = validate_fields({"suspended_until": until, "suspend_reason": reason})
        if fields["suspended_until"] is None:
            raise ValueError("suspended_until must be a time (a suspension ends; revoke to end a key for good)")
        return self._mutate(key_id, lambda k: dataclasses.replace(k, **fields))

    # primitives: _insert(key, digest) -> bool (False on id/hash collision); _find_by_hash(digest) ->
    # (stored_digest, ApiKey) | None; _mutate(key_id, fn) -> ApiKey (atomic read-modify-write + version bump)
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (key_id TEXT PRIMARY KEY, secret_hash TEXT NOT NULL UNIQUE,
    revoked_at REAL, created_at REAL NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys_version (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL);
INSERT OR IGNORE INTO api_keys_version VALUES (0, 0)
"""
_BUMP = "UPDATE api_keys_version SET version = version + 1 WHERE id = 0"


def _dumps(key: ApiKey) -> str:
    return json.dumps(key.to_public_dict(), separators=(",", ":"), sort_keys=True)


class SqliteKeyStore(_BaseKeyStore):
    """Keys in a SQLite file (the ledger's); each process opens its own store on the same file."""

    def __init__(self, path: str, server_secret: str | bytes | None = None, busy_timeout_s: float = 30.0):
        self.path = os.path.abspath(path)
        try:
            self._sql = Database(self.path, synchronous="FULL", busy_timeout_s=busy_timeout_s)
            self._sql.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise KeyStoreUnavailable(f"cannot open the SQLite key store {self.path}: {exc}") from exc
        self._init_secret(server_secret)

    def stored_server_secret(self) -> str:
        return _secret_file(os.path.join(os.path.dirname(self.path), SECRET_FILE))

    def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._sql.transaction() as db:
            return fn(db)

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._sql.query(sql, args)

    def _insert(self, key: ApiKey, digest: str) -> bool:
        def fn(db: sqlite3.Connection) -> bool:
            try:
                db.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?)",
                           (key.key_id, digest, key.revoked_at, key.created_at, _dumps(key)))
            except sqlite3.IntegrityError:
                return False
            db.execute(_BUMP)
            return True
        return self._write(fn)

    def _find_by_hash(self, digest: str) -> tuple[str, ApiKey] | None:
        rows = self._query("SELECT secret_hash, data FROM api_keys WHERE secret_hash = ?", (digest,))
        return (rows[0][0], ApiKey.from_dict(json.loads(rows[0][1]))) if rows else None

    def get(self, key_id: str) -> ApiKey | None:
        rows = self._query("SELECT data FROM api_keys WHERE key_id = ?", (key_id,))
        return ApiKey.from_dict(json.loads(rows[0][0])) if rows else None

    def list(self, include_revoked: bool = False) -> list[ApiKey]:
        where = "" if include_revoked else " WHERE revoked_at IS NULL"
        rows = self._query(f"SELECT data FROM api_keys{where} ORDER BY created_at, key_id")
        return [ApiKey.from_dict(json.loads(r[0])) for r in rows]

    def _mutate(self, key_id: str, change: Callable[[ApiKey], ApiKey]) -> ApiKey:
        def fn(db: sqlite3.Connection) -> ApiKey:
            row = db.execute("SELECT data FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
            if row is None:
                raise KeyNotFound(key_id)
            old = ApiKey.from_dict(json.loads(row[0]))
            new = change(old)
            if new != old:
                db.execute("UPDATE api_keys SET data = ?, revoked_at = ? WHERE key_id = ?",
                           (_dumps(new), new.revoked_at, key_id))
                db.execute(_BUMP)
            return new
        return self._write(fn)

    def version(self) -> int:
        return int(self._query("SELECT version FROM api_keys_version WHERE id = 0")[0][0])

    def close(self) -> None:
        self._sql.close()


class RedisKeyStore(_BaseKeyStore):
    """Keys on a (single, non-cluster) Redis server shared by every replica."""

    def __init__(self, url: str, server_secret: str | bytes | None = None, prefix: str = "qvk:",
                 socket_timeout_s: float = 5.0):
        import redis

        self.url, self.prefix = url, prefix
        self.transient_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._r = connect(url, KeyStoreUnavailable, "key store", socket_timeout_s)
        try:
            self._init_secret(server_secret)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise KeyStoreUnavailable(f"cannot reach the Redis key store at {safe_url(url)}: {exc}") from exc

    def stored_server_secret(self) -> str:
        name = self.prefix + "server_secret"
        self._r.set(name, secrets.token_urlsafe(32), nx=True)   # the first replica wins; all share it
        return self._r.get(name)

    def _insert(self, key: ApiKey, digest: str) -> bool:
        kname, hname = self.prefix + "key:" + key.key_id, self.prefix + "hash:" + digest

        def tx(pipe) -> bool:
            if pipe.exists(kname) or pipe.exists(hname):
                return False
            pipe.multi()
            pipe.set(kname, json.dumps({"hash": digest, "key": key.to_public_dict()}))
            pipe.set(hname, key.key_id)
            pipe.sadd(self.prefix + "ids", key.key_id)
            pipe.incr(self.prefix + "version")
            return True
        return self._r.transaction(tx, kname, hname, value_from_callable=True)

    def _record(self, key_id: str) -> dict | None:
        blob = self._r.get(self.prefix + "key:" + key_id)
        return json.loads(blob) if blob else None

    def _find_by_hash(self, digest: str) -> tuple[str, ApiKey] | None:
        key_id = self._r.get(self.prefix + "hash:" + digest)
        rec = self._record(key_id) if key_id else None
        return (rec["hash"], ApiKey.from_dict(rec["key"])) if rec else None

    def get(self, key_id: str) -> ApiKey | None:
        rec = self._record(key_id)
        return ApiKey.from_dict(rec["key"]) if rec else None

    def list(self, include_revoked: bool = False) -> list[ApiKey]:
        ids = sorted(self._r.smembers(self.prefix + "ids"))
        blobs = self._r.mget([self.prefix + "key:" + i for i in ids]) if ids else []
        keys = [ApiKey.from_dict(json.loads(b)["key"]) for b in blobs if b]
        return sorted((k for k in keys if include_revoked or k.revoked_at is None),
                      key=lambda k: (k.created_at, k.key_id))

    def _mutate(self, key_id: str, change: Callable[[ApiKey], ApiKey]) -> ApiKey:
        kname = self.prefix + "key:" + key_id

        def tx(pipe) -> ApiKey:
            blob = pipe.get(kname)
            if blob is None:
                raise KeyNotFound(key_id)
            rec = json.loads(blob)
            old = ApiKey.from_dict(rec["key"])
            new = change(old)
            if new != old:
                pipe.multi()
                pipe.set(kname, json.dumps({"hash": rec["hash"], "key": new.to_public_dict()}))
                pipe.incr(self.prefix + "version")
            return new
        return self._r.transaction(tx, kname, value_from_callable=True)

    def version(self) -> int:
        return int(self._r.get(self.prefix + "version") or 0)

    def close(self) -> None:
        self._r.close()


def open_key_store(backend: str | None = None, location: str | None = None,
                   settings: Any = None) -> SqliteKeyStore | RedisKeyStore:
    """The key store next to the ledger: ``backend`` (default: setting ``ledger_backend``), ``location`` =
    SQLite file (default ``<data_dir>/ledger.sqlite3``) or Redis URL (default ``ledger_redis_url``); ``settings``:
    the caller's (the server's, or the CLI's ``Settings.current()``). Raises :class:`KeyStoreUnavailable`."""
    if settings is None:
        raise TypeError("open_key_store needs the settings (data_dir, ledger_backend, ledger_redis_url, gateway_secret)")
    backend = backend or settings.ledger_backend
    where = locations.ledger(settings, backend, db=location if backend == "sqlite" else None,
                             redis_url=location if backend == "redis" else None)
    secret = getattr(settings, "gateway_secret", "") or None
    if where.backend == "sqlite":
        return SqliteKeyStore(where.target, secret)
    if where.backend == "redis":
        url = where.target
        if not url:
            raise KeyStoreUnavailable("the Redis key store needs a URL (setting ledger_redis_url or --redis-url)")
        return RedisKeyStore(url, secret)
    raise ValueError(f"unknown key store backend {backend!r}; expected 'sqlite' or 'redis'")
