"""Gateway API keys on real SQLite and a real redis-server (no mocks): identical assertions for both stores,
plus the ``python -m qwen_vllm_ext.keys`` CLI end to end."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import types

import pytest

from qwen_vllm_ext import keys as K
from qwen_vllm_ext.keys import (KeyCache, KeyNotFound, KeyStoreUnavailable, RedisKeyStore,
                                        SqliteKeyStore, open_key_store, parse_billed, parse_expiry,
                                        resolve_server_secret)
from tests.redis_server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_SECRET = "s" * 32
_prefixes = itertools.count()


class Target:
    """Where a backend's keys live; ``open()`` gives a fresh store on the same data (as another process)."""

    def __init__(self, backend: str, location: str, prefix: str = "qvk:"):
        self.backend, self.location, self.prefix = backend, location, prefix
        self.stores: list = []

    def open(self, server_secret=SERVER_SECRET):
        if self.backend == "sqlite":
            store = SqliteKeyStore(self.location, server_secret)
        else:
            store = RedisKeyStore(self.location, server_secret, prefix=self.prefix)
        self.stores.append(store)
        return store

    def raw(self) -> str:
        """Everything the backend holds, as text (to prove no secret is stored)."""
        if self.backend == "sqlite":
            with sqlite3.connect(self.location) as db:
                return repr([db.execute(f"SELECT * FROM {t}").fetchall() for t in ("api_keys", "api_keys_version")])
        import redis
        r = redis.Redis.from_url(self.location, decode_responses=True)
        out = {}
        for name in r.scan_iter(self.prefix + "*"):
            out[name] = r.smembers(name) if r.type(name) == "set" else r.get(name)
        r.close()
        return repr(out)


@pytest.fixture(params=["sqlite", "redis"])
def target(request, tmp_path):
    if request.param == "sqlite":
        t = Target("sqlite", str(tmp_path / "ledger.sqlite3"))
    else:
        t = Target("redis", request.getfixturevalue("redis_server").url, f"t{next(_prefixes)}:")
    yield t
    for s in t.stores:
        s.close()


@pytest.fixture
def store(target):
    return target.open()


# ------------------------------------------------------------------------------------ create / auth
def test_create_authenticate_and_nothing_secret_is_stored(target, store):
    secret, key = store.create("alice", models=["Qwen/Qwen3-8B"], rpm=60, tpm=10_000, labels={"team": "a"})
    assert secret.startswith("qve-") and len(secret) == 47 and K.well_formed(secret)
    assert key.key_id.startswith("k_") and len(key.key_id) == 12 and key.prefix == secret[:8]
    assert key.active() == (True, None) and key.allows_model("Qwen/Qwen3-8B") and not key.allows_model("other")
    assert store.authenticate(secret) == key == store.get(key.key_id)
    assert target.open().authenticate(secret) == key                       # another process
    wrong = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    for bad in (wrong, "", "qve-", secret + "x", None, 42, "Bearer " + secret):
        assert store.authenticate(bad) is None
    assert target.open(server_secret="another-server-secret!").authenticate(secret) is None
    raw = target.raw()
    assert secret not in raw and secret[8:] not in raw and secret[4:20] not in raw
    digest = hmac.new(SERVER_SECRET.encode(), secret.encode(), hashlib.sha256).hexdigest()
    assert digest in raw and store.hash_secret(secret) == digest
    public = json.dumps(key.to_public_dict())
    assert secret[8:] not in public and digest not in public and "hash" not in public


def test_id_or_hash_collision_is_refused(store):
    """``create`` retries with fresh random values if an id or hash already exists (never overwrites)."""
    _, key = store.create("alice")
    bob_secret, _ = store.create("bob")
    v = store.version()
    assert not store._insert(key, "0" * 64)                                   # same key id
    assert not store._insert(dataclasses.replace(key, key_id="k_other0000"), store.hash_secret(bob_secret))
    assert store.version() == v and store.get(key.key_id) == key and store.get("k_other0000") is None


def test_authentication_confirms_with_compare_digest(store, monkeypatch):
    secret, key = store.create("alice")
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert store.authenticate(secret) == key
    assert calls == [(store.hash_secret(secret),) * 2]


@pytest.mark.parametrize("field, value", [
    ("rpm", 0), ("rpm", -1), ("rpm", True), ("rpm", "10"), ("tpm", 1.5), ("max_concurrent", 0),
    ("max_tokens_cap", -5), ("daily_budget_micro", 0.5), ("monthly_budget_micro", "1"),
    ("models", "Qwen/Qwen3-8B"), ("models", [""]), ("models", [1]), ("labels", {"": "x"}),
    ("labels", {"a": 1}), ("labels", ["a"]), ("expires_at", "next tuesday"), ("expires_at", -1),
    ("bogus", 1), ("created_at", 0.0), ("revoked_at", 1.0), ("key_id", "k_x")])
def test_scope_validation_names_the_field(store, field, value):
    with pytest.raises(ValueError, match=field):
        store.create("alice", **{field: value})
    _, key = store.create("bob")
    with pytest.raises(ValueError, match=field):
        store.update(key.key_id, **{field: value})
    assert store.get(key.key_id) == key                           # nothing changed
    with pytest.raises(ValueError, match="name"):
        store.create("  ")


def test_update_list_get(target, store):
    _, a = store.create("a", rpm=10)
    _, b = store.create("b", models=["m1", "m1", "m2"], expires_at="2099-01-01")
    assert b.models == ["m1", "m2"] and b.expires_at == 4070908800.0
    v = store.version()
    new = store.update(a.key_id, name="a2", rpm=None, tpm=500, models=["m3"], labels={"env": "prod"},
                       daily_budget_micro=1_500_000)
    assert (new.name, new.rpm, new.tpm, new.models, new.labels, new.daily_budget_micro) == \
        ("a2", None, 500, ["m3"], {"env": "prod"}, 1_500_000)
    assert target.open().get(a.key_id) == new and store.version() == v + 1
    assert store.update(a.key_id, tpm=500) == new and store.version() == v + 1   # no change, no bump
    assert [k.key_id for k in store.list()] == [a.key_id, b.key_id]
    assert store.get("k_missing") is None
    for call in (lambda: store.update("k_missing", rpm=1), lambda: store.revoke("k_missing"),
                 lambda: store.suspend("k_missing", time.time() + 9, "x")):
        with pytest.raises(KeyNotFound, match="k_missing"):
            call()


# ---------------------------------------------------------------------- revoke / expiry / suspension
def test_revoke_is_final_and_authenticate_still_says_why(target, store):
    """Decision: authenticate returns revoked/expired/suspended keys so the gateway can say why; callers
    must check ``active()`` (``KeyCache.resolve`` does)."""
    secret, key = store.create("alice")
    revoked = store.revoke(key.key_id)
    assert revoked.active() == (False, "revoked") and revoked.revoked_at is not None
    assert store.authenticate(secret).active() == (False, "revoked")
    assert store.revoke(key.key_id).revoked_at == revoked.revoked_at          # idempotent
    assert store.list() == [] and store.list(include_revoked=True) == [revoked]
    assert store.update(key.key_id, name="x").active() == (False, "revoked")  # no way back
    assert KeyCache(target.open()).resolve(secret) == (store.get(key.key_id), "revoked")
    assert KeyCache(store).resolve("qve-" + "A" * 43) == (None, "invalid")


def test_expiry(store):
    now = time.time()
    secret, key = store.create("old", expires_at=now - 1)
    assert store.authenticate(secret).active() == (False, "expired")
    _, key = store.create("new", expires_at="30d")
    assert abs(key.expires_at - (now + 30 * 86400)) < 5
    assert key.active() == (True, None) and key.active(now + 31 * 86400) == (False, "expired")
    assert store.update(key.key_id, expires_at=None).expires_at is None


def test_parse_expiry_and_billed():
    assert parse_expiry("12h", now=1000.0) == 1000.0 + 12 * 3600
    assert parse_expiry("1d12h", now=0.0) == 36 * 3600.0 and parse_expiry("2w", now=0.0) == 14 * 86400.0
    assert parse_expiry("1700000000") == 1700000000.0 and parse_expiry(1.5) == 1.5
    assert parse_expiry("2025-01-31") == parse_expiry("2025-01-31T00:00:00Z") == 1738281600.0
    assert parse_expiry("2025-01-31T02:00:00+02:00") == 1738281600.0
    assert parse_expiry("never") is None and parse_expiry(None) is None
    for bad in ("soon", "12x", "-5", float("inf"), True, [1]):
        with pytest.raises(ValueError):
            parse_expiry(bad)
    assert parse_billed("1.5") == 1_500_000 and parse_billed("0.000001") == 1 and parse_billed(3) == 3_000_000
    for bad in ("0", "-1", "1e-7", "0.0000001", "abc", "nan", "inf"):
        with pytest.raises(ValueError):
            parse_billed(bad)


def test_suspension(store):
    secret, key = store.create("alice")
    now = time.time()
    s = store.suspend(key.key_id, now + 60, "spike: 4x baseline")
    assert store.authenticate(secret).active() == (False, "suspended") and s.suspend_reason.startswith("spike")
    assert s.active(now + 61) == (True, None)                                 # a suspension ends by itself
    assert store.suspend(key.key_id, "1h", None).active() == (False, "suspended")
    with pytest.raises(ValueError, match="suspended_until"):
        store.suspend(key.key_id, None, "x")
    assert store.update(key.key_id, suspended_until=None, suspend_reason=None).active() == (True, None)


def test_version_bumps_on_every_change(target, store):
    other = target.open()
    versions = [store.version()]
    _, key = store.create("a")
    for change in (lambda: store.update(key.key_id, rpm=5), lambda: store.suspend(key.key_id, "1h", "x"),
                   lambda: store.revoke(key.key_id)):
        versions.append(store.version())
        change()
    versions.append(store.version())
    assert versions == list(range(versions[0], versions[0] + 5)) and other.version() == versions[-1]


# ------------------------------------------------------------------------------------------------ cache
def test_key_cache_sees_revocation_by_another_store_within_1s(target, store):
    secret, key = store.create("alice")
    cache = KeyCache(store, ttl_s=0.5)
    assert cache.resolve(secret) == (key, None) and cache.resolve(secret) == (key, None)
    assert (cache.hits, cache.misses) == (1, 1)
    target.open().revoke(key.key_id)                                          # "another process/replica"
    t0 = time.monotonic()
    while cache.resolve(secret)[1] != "revoked":
        assert time.monotonic() - t0 < 1.0, "revocation not visible within 1 s"
        time.sleep(0.01)
    assert cache.invalidations == 1


def test_key_cache_is_thread_safe_and_bounded(store):
    secrets_ = [store.create(f"k{i}")[0] for i in range(20)]
    cache, errors = KeyCache(store, ttl_s=0.01, max_entries=8), []

    def work(i: int) -> None:
        try:
            for j in range(60):
                s = secrets_[(i + j) % 20]
                assert cache.authenticate(s).prefix == s[:8]
        except Exception as exc:             # noqa: BLE001  reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and len(cache._entries) <= 8


# ---------------------------------------------------------------------------------------- server secret
def test_server_secret_file_is_0600_reused_and_race_free(tmp_path):
    db = str(tmp_path / "d" / "ledger.sqlite3")
    results = []
    threads = [threading.Thread(target=lambda: results.append(K._secret_file(str(tmp_path / "race.secret"))))
               for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(results) == 8 and len(set(results)) == 1 and os.listdir(tmp_path) == ["race.secret"]  # no tmp left
    s1 = SqliteKeyStore(db)                                                   # no gateway_secret
    path = tmp_path / "d" / "gateway.secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret, key = s1.create("alice")
    s2 = SqliteKeyStore(db)
    assert s2.authenticate(secret) == key and resolve_server_secret(None, s2) == path.read_text().strip().encode()
    configured = types.SimpleNamespace(gateway_secret="c" * 20, data_dir=str(tmp_path / "d"))
    assert resolve_server_secret(configured, s2) == b"c" * 20
    s3 = open_key_store("sqlite", None, configured)                           # the setting wins
    assert s3.authenticate(secret) is None and s3.path == db
    with pytest.raises(ValueError, match="gateway_secret"):
        SqliteKeyStore(db, "short")
    for s in (s1, s2, s3):
        s.close()


def test_redis_server_secret_is_shared_and_unreachable_redis_fails_loudly(redis_server):
    prefix = f"t{next(_prefixes)}:"
    a, b = RedisKeyStore(redis_server.url, None, prefix), RedisKeyStore(redis_server.url, None, prefix)
    secret, key = a.create("alice")
    assert b.authenticate(secret) == key and a._server_secret == b._server_secret
    import redis
    assert redis.Redis.from_url(redis_server.url).get(prefix + "server_secret").decode() == a._server_secret.decode()
    a.close(), b.close()
    with pytest.raises(KeyStoreUnavailable, match="cannot reach"):
        RedisKeyStore(f"redis://127.0.0.1:{free_port()}/0", SERVER_SECRET)
    with pytest.raises(KeyStoreUnavailable, match="URL"):
        open_key_store("redis", None, types.SimpleNamespace(data_dir="/nonexistent", ledger_redis_url=""))


# ------------------------------------------------------------------------------------------------- CLI
def run_cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen_vllm_ext.keys", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)


@pytest.fixture
def cli_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_VLLM_EXT_")}
    return {**env, "QWEN_VLLM_EXT_DATA_DIR": str(tmp_path / "data")}


def test_cli_end_to_end_sqlite(cli_env, tmp_path):
    p = run_cli(cli_env, "create", "--name", "alice", "--models", "m1,m2", "--rpm", "10", "--tpm", "5000",
                "--daily-budget", "1.5", "--monthly-budget", "20", "--expires", "30d", "--label", "team=a",
                "--label", "env=dev")
    assert p.returncode == 0, p.stderr
    secret = next(w for w in p.stdout.split() if w.startswith("qve-"))
    assert p.stdout.count(secret) == 1 and "NOT stored" in p.stderr and secret not in p.stderr
    store = SqliteKeyStore(str(tmp_path / "data" / "ledger.sqlite3"))           # same secret file as the CLI
    key = store.authenticate(secret)
    assert (key.models, key.rpm, key.tpm, key.daily_budget_micro, key.monthly_budget_micro, key.labels) == \
        (["m1", "m2"], 10, 5000, 1_500_000, 20_000_000, {"team": "a", "env": "dev"})
    cache = KeyCache(store)
    assert cache.resolve(secret) == (key, None)

    listed, shown = run_cli(cli_env, "list"), run_cli(cli_env, "show", key.key_id)
    assert key.key_id in listed.stdout and "alice" in listed.stdout and "1.5" in shown.stdout
    as_json = json.loads(run_cli(cli_env, "list", "--json").stdout)
    assert [k["key_id"] for k in as_json] == [key.key_id] and as_json[0]["status"] == "active"
    p = run_cli(cli_env, "update", key.key_id, "--rpm", "none", "--tpm", "7000", "--unlabel", "env",
                "--label", "tier=gold", "--all-models", "--json")
    assert p.returncode == 0, p.stderr
    upd = json.loads(p.stdout)
    assert (upd["rpm"], upd["tpm"], upd["models"], upd["labels"]) == (None, 7000, [], {"team": "a", "tier": "gold"})
    p = run_cli(cli_env, "update", key.key_id, "--suspend-until", "1h", "--suspend-reason", "spike")
    assert "suspended until" in p.stdout and "spike" in p.stdout

    assert run_cli(cli_env, "revoke", key.key_id).returncode == 0
    t0 = time.monotonic()                                   # revoked by another process: visible within 1 s
    while cache.resolve(secret)[1] != "revoked":
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.01)
    assert key.key_id not in run_cli(cli_env, "list").stdout
    assert "revoked" in run_cli(cli_env, "list", "--all").stdout
    outputs = [run_cli(cli_env, *a) for a in (("list", "--all"), ("list", "--all", "--json"), ("show", key.key_id),
                                              ("show", key.key_id, "--json"))]
    assert all(o.returncode == 0 and secret[8:] not in o.stdout + o.stderr for o in outputs)

    for args, needle in ((("show", "k_nope"), "no API key with id 'k_nope'"),
                         (("revoke", "k_nope"), "k_nope"), (("update", "k_nope", "--rpm", "3"), "k_nope"),
                         (("create", "--name", "x", "--rpm", "-3"), "--rpm"),
                         (("create", "--name", "x", "--daily-budget", "abc"), "--daily-budget"),
                         (("create", "--name", "x", "--expires", "soon"), "--expires"),
                         (("create", "--name", "x", "--label", "novalue"), "--label"),
                         (("update", key.key_id), "nothing to update")):
        p = run_cli(cli_env, *args)
        assert p.returncode == 2 and needle in p.stderr, (args, p.stderr)
    store.close()


def test_cli_redis_backend(cli_env, redis_server):
    p = run_cli(cli_env, "create", "--name", "bob", "--tpm", "100", "--json", "--redis-url", redis_server.url)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    with RedisKeyStore(redis_server.url) as store:                         # the shared secret, default prefix
        assert store.authenticate(out["secret"]).to_public_dict() == {k: v for k, v in out["key"].items()
                                                                      if k != "status"}
    p = run_cli(cli_env, "show", out["key"]["key_id"], "--backend", "redis", "--redis-url", redis_server.url)
    assert p.returncode == 0 and "bob" in p.stdout and out["secret"][8:] not in p.stdout
    p = run_cli(cli_env, "list", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert p.returncode == 2 and "cannot reach" in p.stderr


def test_spike_breaker_exemption_on_create_update_show_and_the_cli(store, cli_env):
    """An aggregator's key is created exempt (``--no-spike-breaker``); the flag shows, updates, and is a bool only."""
    secret, key = store.create("agg", spike_breaker=False)
    assert key.spike_breaker is False and store.get(key.key_id).spike_breaker is False
    assert store.update(key.key_id, spike_breaker=True).spike_breaker is True
    with pytest.raises(ValueError, match="spike_breaker must be true or false"):
        store.update(key.key_id, spike_breaker="no")
    _, plain = store.create("plain")
    assert plain.spike_breaker is True
    p = run_cli(cli_env, "create", "--name", "openrouter", "--no-spike-breaker", "--json")
    made = json.loads(p.stdout)["key"]
    assert made["spike_breaker"] is False
    p = run_cli(cli_env, "show", made["key_id"])
    assert re.search(r"spike_breaker\s+exempt", p.stdout), p.stdout
    p = run_cli(cli_env, "update", made["key_id"], "--spike-breaker", "--suspend-until", "1h", "--suspend-reason",
                "usage spike")
    assert re.search(r"spike_breaker\s+on", p.stdout) and "--unsuspend" in p.stdout, p.stdout


def test_unsuspend_of_an_unknown_key_is_a_clear_error(cli_env):
    p = run_cli(cli_env, "update", "k_doesnotexist", "--unsuspend")
    assert p.returncode != 0 and "no API key with id 'k_doesnotexist'" in p.stderr, (p.returncode, p.stderr)
