"""API keys of the in-server gateway: scoped keys stored only as HMAC hashes. Pure Python (no vLLM import).

**Secrets.** A key's secret is ``qve-`` + 43 url-safe base64 characters (32 random bytes from
:mod:`secrets`). It is returned once, by :meth:`KeyStore.create`, and never stored: the store keeps only
``HMAC-SHA256(server_secret, secret)`` (hex), looks keys up by that hash and confirms the match with
:func:`hmac.compare_digest`. Nothing here logs a secret. The public part of a key is its id (``k_`` + 10
url-safe characters) and ``prefix`` (the secret's first 8 characters, for display).

**Server secret** (:func:`resolve_server_secret`): the setting ``gateway_secret`` when set (>= 16
characters); otherwise, for SQLite, the file ``gateway.secret`` next to the database (``<data_dir>`` by
default), created once with mode 0600; for Redis, the value ``<prefix>server_secret`` created with ``SET NX``
so every replica shares it. Changing the server secret invalidates every key.

**Stores.** Keys live where the ledger lives, in their own tables/keys, with identical semantics:

* :class:`SqliteKeyStore` -- tables ``api_keys`` (key_id, secret_hash UNIQUE, revoked_at, created_at,
  data = the key as JSON) and ``api_keys_version`` (one row: the change counter), in the ledger file
  ``<data_dir>/ledger.sqlite3``. Every change is one ``BEGIN IMMEDIATE`` transaction that also bumps the
  counter.
* :class:`RedisKeyStore` -- ``<prefix>key:<key_id>`` (JSON ``{"hash", "key"}``), ``<prefix>hash:<hex>``
  (-> key_id), set ``<prefix>ids``, counter ``<prefix>version``, ``<prefix>server_secret``; default prefix
  ``qvk:`` (the ledger uses ``qve:``). Every change is a WATCH/MULTI transaction that also INCRs the counter.

**Revoked, expired and suspended keys** are still returned by ``authenticate`` (so the gateway can say
*why* a key is refused); callers must check :meth:`ApiKey.active` (or use :meth:`KeyCache.resolve`).
Revocation is final; suspension ends at ``suspended_until`` or when cleared with ``update``.

**Propagation.** :meth:`KeyStore.version` is a cheap counter bumped by every change; :class:`KeyCache` (one
per process) re-reads it at most every ``ttl_s`` (0.5 s) and drops its entries when it moved, so a
revocation made by any process or replica is seen everywhere within ``ttl_s`` + one store round trip (< 1 s).
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import decimal
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from typing import Any, Callable, Protocol, runtime_checkable

from ..store import locations
from ..store.redis import connect, safe_url
from ..store.sqlite import Database

log = logging.getLogger(__name__)

SECRET_PREFIX = "qve-"
SECRET_LEN = len(SECRET_PREFIX) + 43
KEY_ID_PREFIX = "k_"
SECRET_FILE = "gateway.secret"
MICRO = 1_000_000
MIN_SERVER_SECRET = 16
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap", "daily_budget_micro", "monthly_budget_micro")
SCOPE_FIELDS = ("models", *LIMIT_FIELDS, "expires_at", "labels")          # accepted by create()
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
    daily_budget_micro: int | None = None
    monthly_budget_micro: int | None = None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)

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


def _v_time(name: str, value: Any) -> float | None:
    try:
        return parse_expiry(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _v_name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise ValueError(f"{name} must be a non-empty string of at most 200 characters, got {value!r}")
    return value.strip()


def _v_reason(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > 1000):
        raise ValueError(f"{name} must be a string (at most 1000 characters) or None, got {value!r}")
    return value


def _v_models(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) and m.strip() for m in value):
        raise ValueError(f"{name} must be a list of non-empty model names ([] = every model), got {value!r}")
    return list(dict.fromkeys(m.strip() for m in value))


def _v_labels(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.strip() and isinstance(v, str)
                                              for k, v in value.items()):
        raise ValueError(f"{name} must map non-empty string keys to string values, got {value!r}")
    return dict(value)


_VALIDATORS: dict[str, Callable[[str, Any], Any]] = {
    "name": _v_name, "models": _v_models, "labels": _v_labels, "expires_at": _v_time,
    "suspended_until": _v_time, "suspend_reason": _v_reason, **{f: _v_positive for f in LIMIT_FIELDS}}


def validate_fields(fields: dict[str, Any], allowed: tuple[str, ...] = UPDATABLE_FIELDS) -> dict[str, Any]:
    """Checked and normalised copy of ``fields``; ``ValueError`` naming the first bad field."""
    out = {}
    for name, value in fields.items():
        if name not in allowed:
            raise ValueError(f"{name!r} is not a field that can be set here; allowed: {', '.join(allowed)}")
        out[name] = _VALIDATORS[name](name, value)
    return out


# --------------------------------------------------------------------------------------- secrets, hash
def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def well_formed(secret: Any) -> bool:
    """Shape check only (cheap, leaks nothing): garbage is refused without touching the store."""
    return (isinstance(secret, str) and len(secret) == SECRET_LEN and secret.startswith(SECRET_PREFIX)
            and _URLSAFE.fullmatch(secret, len(SECRET_PREFIX)) is not None)


def _secret_file(path: str) -> str:
    """Read ``path``, creating it atomically (mode 0600, via a temp file + hard link) if it is missing."""
    for _ in range(10):
        try:
            with open(path, encoding="utf-8") as fh:
                value = fh.read().strip()
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)          # fails if another process created it first: then we read theirs
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
            continue
        if len(value) < MIN_SERVER_SECRET:
            raise KeyStoreUnavailable(f"the server secret file {path} is empty or too short: delete it (every "
                                      "key becomes invalid) or set gateway_secret")
        if os.stat(path).st_mode & 0o077:
            log.warning("the server secret file %s is readable by other users: chmod 600 it", path)
        return value
    raise KeyStoreUnavailable(f"cannot create the server secret file {path}")


def _secret_bytes(value: str | bytes) -> bytes:
    if len(value) < MIN_SERVER_SECRET:
        raise ValueError(f"gateway_secret must have at least {MIN_SERVER_SECRET} characters")
    return value.encode() if isinstance(value, str) else bytes(value)


def resolve_server_secret(settings: Any, store: Any) -> bytes:
    """The setting ``gateway_secret`` if set, else the secret kept by the store (file or Redis, see module)."""
    return _secret_bytes(getattr(settings, "gateway_secret", "") or store.stored_server_secret())


# ---------------------------------------------------------------------------------------------- stores
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


# ----------------------------------------------------------------------------------------------- cache
class KeyCache:
    """Per-process authentication cache in front of a store, keyed by the secret's hash (thread-safe).

    Entries (misses included, at most ``max_entries``, LRU) are dropped when ``store.version()`` changed;
    the version is read at most every ``ttl_s``, so any change (revocation, update) made by any process or
    replica is visible within ``ttl_s`` + one store read. Store errors propagate (the caller applies its
    fail-open/fail-closed policy) and force a version check on the next call.
    """

    def __init__(self, store: KeyStore, ttl_s: float = 0.5, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.ttl_s, self.max_entries, self._clock = store, ttl_s, max_entries, clock
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, ApiKey | None] = collections.OrderedDict()
        self._version = store.version()
        self._checked = clock()
        self.hits = self.misses = self.invalidations = 0

    def _current_version(self) -> int:
        now = self._clock()
        with self._lock:
            if now - self._checked < self.ttl_s:
                return self._version
            self._checked = now                     # this thread checks; the others use the cache meanwhile
        try:
            version = self.store.version()
        except BaseException:
            with self._lock:
                self._checked = -math.inf
            raise
        with self._lock:
            if version != self._version:
                self._entries.clear()
                self._version = version
                self.invalidations += 1
            return self._version

    def authenticate(self, secret: str) -> ApiKey | None:
        """Like ``store.authenticate`` (the caller checks ``active``), served from the cache when fresh."""
        if not well_formed(secret):
            return None
        digest = self.store.hash_secret(secret)
        version = self._current_version()
        with self._lock:
            if digest in self._entries:
                self._entries.move_to_end(digest)
                self.hits += 1
                return self._entries[digest]
            self.misses += 1
        key = self.store.authenticate(secret)
        with self._lock:
            if self._version == version:            # an invalidation since our read would make it stale
                self._entries[digest] = key
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        return key

    def resolve(self, secret: str, now: float | None = None) -> tuple[ApiKey | None, str | None]:
        """``(key, None)`` when usable, else ``(key or None, reason)``: ``invalid``, ``revoked``, ``expired``,
        ``suspended``."""
        key = self.authenticate(secret)
        if key is None:
            return None, "invalid"
        return key, key.active(now)[1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
