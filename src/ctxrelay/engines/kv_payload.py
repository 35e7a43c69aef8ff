"""The K/V ctxrelay hands to a serving engine for one request: the receiver cache a relay built (any
transport, or a model's own exact prefill), as the engine's attention reads it.

Per layer, keys after the family's k-norm and RoPE and values, `[tokens, kv_heads, head_dim]`, in the
engine's dtype (bf16 on CPU), for context positions 0..tokens-1. The manifest binds it to the receiver's
weights, the tenant, the exact token ids it covers (their sha256: the engine only loads it under a prompt
that starts with those very tokens) and whether it is exact (a model's own K/V) or approximate (a
translated cache: never to enter the engine's exact prefix cache). It is a sealed tensor file
(tensorfile.py): an edited or foreign file is refused, and the engine then computes those tokens itself.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxrelay import tensorfile
from ctxrelay.errors import BindingError
from ctxrelay.models.runner import KVCache

FORMAT = "ctxrelay-engine-kv"
VERSION = 1


def handoff_dir(prefix: str = "ctxrelay-kv-") -> Path:
    """A private (0700) folder for payload files, in shared memory where the machine has it: the hand-off to
    the engine's worker then never touches a disk (the files are removed once the engine has loaded them)."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


def token_digest(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class KVPayload:
    keys: list[torch.Tensor]  # per layer [tokens, kv_heads, head_dim]
    values: list[torch.Tensor]
    token_ids: list[int]
    weights_hash: str
    tenant: str
    exact: bool

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @staticmethod
    def from_cache(
        cache: KVCache, token_ids: list[int], weights_hash: str, tenant: str, exact: bool, dtype=torch.bfloat16
    ) -> KVPayload:
        """The first len(token_ids) positions of a runner cache, in the engine's layout and dtype."""
        n = len(token_ids)
        keys, values = [], []
        for i in range(len(cache.keys)):
            k, v = cache.view(i, n)  # [1, Hkv, n, d]
            keys.append(k[0].transpose(0, 1).to(dtype).contiguous())
            values.append(v[0].transpose(0, 1).to(dtype).contiguous())
        return KVPayload(keys, values, list(token_ids), weights_hash, tenant, exact)

    def save(self, path: str | Path, durable: bool = False) -> Path:
        """Not fsynced by default: the file lives only until the engine has loaded it."""
        tensors = {f"k.{i}": k for i, k in enumerate(self.keys)} | {f"v.{i}": v for i, v in enumerate(self.values)}
        manifest = {
            "format": FORMAT, "version": VERSION, "layers": len(self.keys), "tokens": self.tokens,
            "token_digest": token_digest(self.token_ids), "weights_hash": self.weights_hash,
            "tenant": self.tenant, "exact": self.exact,
        }  # fmt: skip
        return tensorfile.write(path, tensors, manifest, durable=durable)

    @staticmethod
    def load(path: str | Path, token_ids: list[int], weights_hash: str, tenant: str) -> KVPayload:
        """The payload at `path`, refused unless it is this owner's (seal), of this model and tenant, and
        covers exactly the first tokens of `token_ids` (the request's prompt)."""
        keys, values, m = read_bound(path, FORMAT, VERSION, "engine K/V file", weights_hash, tenant)
        n = int(m["tokens"])
        if n > len(token_ids) or token_digest(list(token_ids[:n])) != m["token_digest"]:
            raise BindingError(f"{path} covers other tokens than this prompt's first {n}")
        return KVPayload(keys, values, list(token_ids[:n]), m["weights_hash"], m["tenant"], bool(m["exact"]))


def read_bound(
    path: str | Path, fmt: str, version: int, what: str, weights_hash: str, tenant: str
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Per-layer keys and values (`k.i`, `v.i`) and the manifest of a sealed K/V file, refused unless it is
    this owner's, of this format, these weights and this tenant (the caller checks the tokens)."""
    # mapped: written by this owner and replaced atomically, never truncated in place
    tensors, m = tensorfile.read(path, seal_mode="required", mapped=True)
    if m.get("format") != fmt or m.get("version") != version:
        raise BindingError(f"{path} is not a ctxrelay {what} of version {version}")
    if m["weights_hash"] != weights_hash:
        raise BindingError(f"{path} holds K/V of other weights ({m['weights_hash'][:12]}), not this model's")
    if m["tenant"] != tenant:
        raise BindingError(f"{path} belongs to another tenant")
    layers = int(m["layers"])
    return [tensors[f"k.{i}"] for i in range(layers)], [tensors[f"v.{i}"] for i in range(layers)], m
