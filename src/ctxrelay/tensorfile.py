"""Tensors + JSON manifest in one safetensors file, written atomically and checksummed.

Every file ctxrelay writes (context states, transport artifacts, disk-store entries) goes through
here, so a truncated, corrupted or foreign file is always a clear `TensorFileError`. Each manifest
carries the tensors' sha256 and a keyed seal (seal.py) over both; reading checks the seal as the
caller asks (`SEAL_MODES`): states and artifacts require it, work files accept an unsealed legacy one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load, save, save_file

from ctxrelay import seal
from ctxrelay.errors import CtxrelayError

MANIFEST_KEY = "ctxrelay"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header
# "required": only this owner's seal; "if_present": also an unsealed (legacy) file; "ignored": the
# checksum only (files shipped inside the package, sealed by whoever built it)
SEAL_MODES = ("required", "if_present", "ignored")


class TensorFileError(CtxrelayError, ValueError):
    pass


class SealError(TensorFileError):
    """The file is intact as bytes but not sealed by this store's owner: its manifest or tensors were edited."""


def payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")  # no copy
    return h.hexdigest()


def _prepared(tensors: dict[str, torch.Tensor], manifest: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    manifest = seal.sealed(dict(manifest, payload_sha256=payload_digest(tensors)))
    return tensors, {MANIFEST_KEY: json.dumps(manifest)}


def to_bytes(tensors: dict[str, torch.Tensor], manifest: dict) -> bytes:
    tensors, metadata = _prepared(tensors, manifest)
    return save(tensors, metadata=metadata)


def _manifest(data: bytes) -> dict:
    header_len = int.from_bytes(data[:8], "little")
    if len(data) < 8 or header_len > min(len(data) - 8, MAX_HEADER_BYTES):
        raise ValueError(f"header of {header_len} bytes declared in {len(data)} bytes")
    header = json.loads(data[8 : 8 + header_len])
    manifest = json.loads(header["__metadata__"][MANIFEST_KEY])
    if not isinstance(manifest, dict):
        raise ValueError("the manifest is not a JSON object")
    return manifest


def from_bytes(data: bytes, what: str = "data", seal_mode: str = "if_present") -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and manifest of a file's bytes, checked: safetensors layout, checksum, seal (`SEAL_MODES`)."""
    _check_mode(seal_mode)
    try:
        manifest = _manifest(data)
        tensors = load(data)
    except (SafetensorError, KeyError, TypeError, ValueError, RecursionError, OverflowError) as e:
        raise TensorFileError(f"{what} is not a ctxrelay tensor file or is damaged ({str(e)[:200]})") from None
    return _checked(tensors, manifest, what, seal_mode)


def _check_mode(seal_mode: str) -> None:
    if seal_mode not in SEAL_MODES:
        raise ValueError(f"seal_mode must be one of {SEAL_MODES}, not {seal_mode!r}")


def _checked(
    tensors: dict[str, torch.Tensor], manifest: dict, what: str, seal_mode: str
) -> tuple[dict[str, torch.Tensor], dict]:
    if manifest.get("payload_sha256") != payload_digest(tensors):
        raise TensorFileError(f"{what} is corrupted: tensor checksum does not match its manifest")
    why = "" if seal_mode == "ignored" else seal.verify(manifest)
    if why and not (why == "unsealed" and seal_mode == "if_present"):
        # a file of this owner's written before seals existed: say how to vouch for it
        hint = why == "unsealed" and Path(what).is_file()
        raise SealError(f"{what} is refused: {why}" + (f" (if you trust it: `ctxrelay seal {what}`)" if hint else ""))
    manifest.pop("seal", None)
    return tensors, manifest


def write(path: str | Path, tensors: dict[str, torch.Tensor], manifest: dict, durable: bool = True) -> Path:
    """Atomic: a crash leaves the old file or the new one, never half of either. `durable=False` skips the
    fsync, for files that live no longer than the process reading them (an engine's K/V hand-off)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, metadata = _prepared(tensors, manifest)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)  # straight to the file: no bytes object of the whole payload
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def reseal(path: str | Path) -> Path:
    """Rewrite an intact file (its checksum holds) under this owner's seal: for files written before
    seals existed, or sealed with another secret the owner vouches for."""
    return write(path, *read(path, "ignored"))


def read(path: str | Path, seal_mode: str = "if_present", mapped: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """`mapped=True` maps the file instead of reading it into memory first: for large files that only this
    owner's processes write, and only by atomic replace (a file truncated under a mapping faults)."""
    path = Path(path)
    try:
        if mapped:
            return _read_mapped(path, seal_mode)
        data = path.read_bytes()
    except FileNotFoundError:
        raise TensorFileError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise TensorFileError(f"{path} is a directory, not a tensor file") from None
    return from_bytes(data, str(path), seal_mode)


def _read_mapped(path: Path, seal_mode: str) -> tuple[dict[str, torch.Tensor], dict]:
    _check_mode(seal_mode)
    try:
        with safe_open(str(path), "pt") as f:  # one open: the manifest and the mapped tensors
            manifest = json.loads((f.metadata() or {})[MANIFEST_KEY])
            if not isinstance(manifest, dict):
                raise ValueError("the manifest is not a JSON object")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    except FileNotFoundError:
        raise
    except (SafetensorError, KeyError, TypeError, ValueError, OSError) as e:
        raise TensorFileError(f"{path} is not a ctxrelay tensor file or is damaged ({str(e)[:200]})") from None
    return _checked(tensors, manifest, str(path), seal_mode)
