"""API key management of the in-server gateway (``python -m qwen_vllm_ext.keys``); the store itself is
:mod:`qwen_vllm_ext.gateway.keys`, re-exported here."""
from qwen_vllm_ext.gateway.keys import (ApiKey, KeyCache, KeyNotFound, KeyStore, KeyStoreUnavailable,
                                        RedisKeyStore, SqliteKeyStore, open_key_store, parse_billed,
                                        parse_expiry, resolve_server_secret)

__all__ = ["ApiKey", "KeyCache", "KeyNotFound", "KeyStore", "KeyStoreUnavailable", "RedisKeyStore",
           "SqliteKeyStore", "open_key_store", "parse_billed", "parse_expiry", "resolve_server_secret"]
