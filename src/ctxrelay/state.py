"""ContextState: the one object that leaves a sender and crosses model boundaries.

It holds the text (so any receiver can fall back to native prefill), the sender's tokens and each
token's character span (for token alignment), whatever sender state a transport needs (pre-RoPE
keys and values for heterofold, compressed attention maps for mapflow) and the bindings that
decide who may use it: the sender's exact weights and tokenizer, and the tenant that owns it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ctxrelay import tensorfile
from ctxrelay.errors import BindingError

if TYPE_CHECKING:  # floor 1 names models only in annotations
    from ctxrelay.models.spec import LoadedModel

STATE_FORMAT = 2  # 2: transport parts by name (1 had one hard-wired "maps" part; still read)


@dataclass
class Binding:
    model_name: str
    weights_hash: str
    tokenizer_hash: str
    tenant: str

    @staticmethod
    def of(m: LoadedModel, tenant: str) -> Binding:
        return Binding(m.spec.name, m.spec.weights_hash, m.spec.tokenizer_hash, tenant)


@dataclass
class ContextState:
    text: str
    tokens: torch.Tensor  # [T] sender token ids
    offsets: torch.Tensor  # [T, 2] character span of each token in `text` (end exclusive)
    binding: Binding
    keys_pre_rope: torch.Tensor | None = None  # [L, T, Hkv, d], before k-norm and RoPE
    values: torch.Tensor | None = None  # [L, T, Hkv, d]
    # what a transport's capture added, by part name (e.g. mapflow's "maps"): tensors and their metadata
    parts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    parts_meta: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def content_hash(self) -> str:
        return content_hash(self.text)

    def has(self, part: str) -> bool:
        """ "kv" (pre-RoPE keys and values) or the name of a transport's part."""
        if part == "kv":
            return self.keys_pre_rope is not None and self.values is not None
        return bool(self.parts.get(part))

    def set_part(self, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        if not name or "." in name or name == "kv":
            raise ValueError(f"a state part needs a plain name without '.', not {name!r}")
        self.parts[name], self.parts_meta[name] = tensors, meta

    def nbytes(self) -> int:
        ts = [self.tokens, self.offsets, self.keys_pre_rope, self.values]
        ts += [t for part in self.parts.values() for t in part.values()]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def check(self, m: LoadedModel | None = None, tenant: str | None = None) -> None:
        """Refuse use by another tenant, or as state of a model it did not come from."""
        b = self.binding
        if tenant is not None and tenant != b.tenant:
            raise BindingError(f"context state belongs to tenant {b.tenant!r}; tenant {tenant!r} may not read it")
        if m is not None:
            if m.spec.weights_hash != b.weights_hash:
                raise BindingError(
                    f"context state was made by {b.model_name} (weights {b.weights_hash[:12]}), "
                    f"not {m.spec.name} (weights {m.spec.weights_hash[:12]})"
                )
            if m.spec.tokenizer_hash != b.tokenizer_hash:
                raise BindingError(f"context state's tokenizer differs from {m.spec.name}'s tokenizer")

    # ---- persistence ----------------------------------------------------------------------------

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {"tokens": self.tokens, "offsets": self.offsets}
        if self.keys_pre_rope is not None:
            tensors["keys_pre_rope"] = self.keys_pre_rope
        if self.values is not None:
            tensors["values"] = self.values
        for name, part in self.parts.items():
            tensors.update({f"{name}.{k}": v for k, v in part.items()})
        manifest = {
            "kind": "context_state",
            "format": STATE_FORMAT,
            "text": self.text,
            "binding": vars(self.binding),
            "parts": sorted(self.parts),
            "parts_meta": self.parts_meta,
            "meta": self.meta,
        }
        return tensors, manifest

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], manifest: dict, what: str = "state") -> ContextState:
        """The state a checked file holds; any field of the wrong type, shape or dtype is a TensorFileError."""
        fmt = manifest.get("format")
        if manifest.get("kind") != "context_state" or fmt not in (1, STATE_FORMAT):
            raise tensorfile.TensorFileError(
                f"{what} is not a ctxrelay context state (format {STATE_FORMAT}); "
                f"it says kind={manifest.get('kind')!r} format={fmt!r}"
            )
        bad = lambda why: tensorfile.TensorFileError(f"{what} is a malformed context state: {why}")
        if fmt == 1:  # one "maps" part, its metadata under maps_meta
            names, parts_meta = ["maps"], {"maps": manifest.get("maps_meta", {})}
        else:
            names, parts_meta = manifest.get("parts", []), manifest.get("parts_meta", {})
        binding = manifest.get("binding")
        if not isinstance(manifest.get("text"), str):
            raise bad("its text is not a string")
        if not isinstance(binding, dict) or set(binding) != set(Binding.__dataclass_fields__):
            raise bad(f"its binding must have exactly {', '.join(Binding.__dataclass_fields__)}")
        if not all(isinstance(v, str) for v in binding.values()):
            raise bad("its binding's fields must be strings")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad("its part names are not a list of strings")
        if not isinstance(parts_meta, dict) or not isinstance(manifest.get("meta", {}), dict):
            raise bad("its part metadata or meta is not a JSON object")
        _check_tensors(tensors, bad)
        parts = {n: {k[len(n) + 1 :]: v for k, v in tensors.items() if k.startswith(n + ".")} for n in names}
        parts = {n: p for n, p in parts.items() if p}
        return ContextState(
            text=manifest["text"],
            tokens=tensors["tokens"],
            offsets=tensors["offsets"],
            binding=Binding(**binding),
            keys_pre_rope=tensors.get("keys_pre_rope"),
            values=tensors.get("values"),
            parts=parts,
            parts_meta={n: parts_meta.get(n, {}) for n in parts},
            meta=manifest.get("meta", {}),
        )

    def to_bytes(self) -> bytes:
        return tensorfile.to_bytes(*self.to_tensors())

    @staticmethod
    def from_bytes(data: bytes, what: str = "state") -> ContextState:
        """Only a state sealed by this store's owner is read: an edited binding is a SealError."""
        return ContextState.from_tensors(*tensorfile.from_bytes(data, what, "required"), what=what)

    def save(self, path: str | Path) -> Path:
        return tensorfile.write(path, *self.to_tensors())

    @staticmethod
    def load(path: str | Path, mapped: bool = False) -> ContextState:
        """`mapped`: for files only this owner writes, by atomic replace (tensorfile.read)."""
        return ContextState.from_tensors(*tensorfile.read(path, "required", mapped=mapped), what=str(path))


_INT_DTYPES = (torch.int64, torch.int32)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_tensors(t: dict[str, torch.Tensor], bad) -> None:
    """tokens [T] and offsets [T, 2] of integers; keys and values [L, T, Hkv, d] of floats, the same shape."""
    tokens, offsets = t.get("tokens"), t.get("offsets")
    if tokens is None or tokens.dim() != 1 or tokens.dtype not in _INT_DTYPES:
        raise bad("tokens must be a 1-d integer tensor")
    n = tokens.shape[0]
    if offsets is None or tuple(offsets.shape) != (n, 2) or offsets.dtype not in _INT_DTYPES:
        raise bad(f"offsets must be an integer tensor [{n}, 2]")
    kv = [t.get("keys_pre_rope"), t.get("values")]
    if (kv[0] is None) != (kv[1] is None):
        raise bad("it holds keys without values or values without keys")
    if kv[0] is not None:
        for x in kv:
            if x.dim() != 4 or x.shape[1] != n or x.dtype not in _FLOAT_DTYPES:
                raise bad(f"keys and values must be float tensors [layers, {n}, heads, head_dim]")
        if kv[0].shape != kv[1].shape:
            raise bad("keys and values differ in shape")


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
