"""API keys of the in-server gateway: scoped keys stored only as HMAC hashes. Pure Python (no vLLM import).

Modules: :mod:`.model` (the key, validation), :mod:`.secrets` (key and server secrets), :mod:`.stores` (SQLite and
Redis stores), :mod:`.cache` (the per-process cache); ``python -m qwen_vllm_ext.keys`` is the CLI.

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
from .cache import KeyCache
from .model import (KEY_ID_PREFIX, LIMIT_FIELDS, MICRO, REASONS, SCOPE_FIELDS, SECRET_PREFIX, UPDATABLE_FIELDS, ApiKey,
                    KeyNotFound, KeyStoreUnavailable, parse_billed, parse_expiry, validate_fields)
from .secrets import _secret_file, new_secret, resolve_server_secret, well_formed  # noqa: F401 (_secret_file: tests)
from .stores import KeyStore, RedisKeyStore, SqliteKeyStore, open_key_store

__all__ = ["KEY_ID_PREFIX", "LIMIT_FIELDS", "MICRO", "REASONS", "SCOPE_FIELDS", "SECRET_PREFIX", "UPDATABLE_FIELDS",
           "ApiKey", "KeyCache", "KeyNotFound", "KeyStore", "KeyStoreUnavailable", "RedisKeyStore", "SqliteKeyStore",
           "new_secret", "open_key_store", "parse_billed", "parse_expiry", "resolve_server_secret", "validate_fields",
           "well_formed"]
