"""The store owner's secret and the keyed MAC every file ctxrelay writes carries.

A plain checksum proves a file is intact, not who wrote it: anyone who edits a manifest (to claim
another tenant or model) can recompute it. The seal is an HMAC-SHA256 over the manifest (which holds
the tensors' digest) with a secret only the owner of the store holds:

- `CTXRELAY_STORE_SECRET` (any string; every process sharing a store, e.g. through Redis, sets the same), else
- `<cache>/store.key`: 32 random bytes, created once with 0600 permissions; a key file others can
  read is refused (anyone who reads it can forge seals).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from pathlib import Path

from ctxrelay import paths
from ctxrelay.errors import CtxrelayError

ENV = "CTXRELAY_STORE_SECRET"
KEY_FILE = "store.key"
ALG = "hmac-sha256-v1"
_HEX = re.compile(r"[0-9a-f]{64}")


class SecretError(CtxrelayError, PermissionError):
    """The store secret cannot be read or created safely (the message says how to fix it)."""


_cache: dict[tuple[str, str], bytes] = {}


def secret() -> bytes:
    """The owner's secret: from CTXRELAY_STORE_SECRET, else the cache's key file (created on first use)."""
    env = os.environ.get(ENV, "")
    key_path = paths.cache_dir() / KEY_FILE
    where = (env, str(key_path))
    if where not in _cache:
        _cache[where] = env.encode() if env else _key_file(key_path)
    return _cache[where]


def _key_file(path: Path) -> bytes:
    if not path.exists():
        _create_key(path)
    try:
        st = path.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"store key {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                f"`chmod 600 {path}`, or set {ENV}"
            )
        data = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise SecretError(f"store key {path} is unreadable ({e}); delete it to make a new one, or set {ENV}") from None
    if len(data) < 16:
        raise SecretError(f"store key {path} is too short; delete it to make a new one, or set {ENV}")
    return data


def _create_key(path: Path) -> None:
    """Write the key to a private temporary file, then link it into place: two processes creating it at
    once end with one key, and nobody ever reads a half-written one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise SecretError(f"cannot create the store key {path} ({e}); set {ENV} instead") from None


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "seal"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def mac(manifest: dict, key: bytes | None = None) -> str:
    """The seal of a manifest (everything but its own `seal` field), with the owner's secret by default."""
    return hmac.new(
        secret() if key is None else key, ALG.encode() + b"\0" + _canonical(manifest), hashlib.sha256
    ).hexdigest()


def sealed(manifest: dict) -> dict:
    return dict(manifest, seal={"alg": ALG, "mac": mac(manifest)})


def verify(manifest: dict) -> str:
    """'' when the manifest's seal is this owner's, else why not ('unsealed' when it carries none)."""
    seal = manifest.get("seal")
    if seal is None:
        return "unsealed"
    given = seal.get("mac") if isinstance(seal, dict) else None
    if not isinstance(given, str) or not _HEX.fullmatch(given) or seal.get("alg") != ALG:
        return f"its seal is not a {ALG} seal"
    if not hmac.compare_digest(seal["mac"], mac(manifest)):
        return (
            "its seal does not match: the manifest or tensors changed after it was written, "
            "or another owner's secret sealed it"
        )
    return ""
