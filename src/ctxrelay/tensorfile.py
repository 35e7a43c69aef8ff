"""Tensors + JSON manifest in one safetensors file, written atomically and checksummed.

Every file ctxrelay writes (context states, transport artifacts, disk-store entries) goes through
here, so a truncated, corrupted or foreign file is always a clear `TensorFileError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from ctxrelay.errors import CtxrelayError

MANIFEST_KEY = "ctxrelay"


class TensorFileError(CtxrelayError, ValueError):
    pass


def payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def to_bytes(tensors: dict[str, torch.Tensor], manifest: dict) -> bytes:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    manifest = dict(manifest, payload_sha256=payload_digest(tensors))
    return save(tensors, metadata={MANIFEST_KEY: json.dumps(manifest)})


def from_bytes(data: bytes, what: str = "data") -> tuple[dict[str, torch.Tensor], dict]:
    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
        manifest = json.loads(meta[MANIFEST_KEY])
    except (SafetensorError, KeyError, ValueError, json.JSONDecodeError, IndexError) as e:
        raise TensorFileError(f"{what} is not a ctxrelay tensor file or is damaged ({e})") from None
    digest = payload_digest(tensors)
    if manifest.get("payload_sha256") != digest:
        raise TensorFileError(f"{what} is corrupted: tensor checksum does not match its manifest")
    return tensors, manifest


def write(path: str | Path, tensors: dict[str, torch.Tensor], manifest: dict) -> Path:
    """Atomic: a crash leaves the old file or the new one, never half of either."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_bytes(tensors, manifest)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    path = Path(path)
    if not path.exists():
        raise TensorFileError(f"{path} does not exist")
    return from_bytes(path.read_bytes(), str(path))
