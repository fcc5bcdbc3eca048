"""The per-process key cache: authentication without a store round trip, revocations seen within ttl_s."""
from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable


from .model import ApiKey
from .secrets import well_formed
from .stores import KeyStore


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
