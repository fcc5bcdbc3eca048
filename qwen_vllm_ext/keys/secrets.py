"""Key secrets and the server secret their HMAC hashes use."""
from __future__ import annotations

import logging
import os
import secrets
from typing import Any


from .model import KeyStoreUnavailable, MIN_SERVER_SECRET, SECRET_LEN, SECRET_PREFIX, _URLSAFE

log = logging.getLogger("qwen_vllm_ext.keys")


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
