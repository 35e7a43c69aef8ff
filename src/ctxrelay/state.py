"""ContextState: the one object that leaves a sender and crosses model boundaries.

It holds the text (so any receiver can fall back to native prefill), the sender's tokens and each
token's character span (for token alignment), whatever sender state a transport needs (pre-RoPE
keys and values for heterofold, compressed attention maps for mapflow) and the bindings that
decide who may use it: the sender's exact weights and tokenizer, and the tenant that owns it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctxrelay import tensorfile
from ctxrelay.models.spec import LoadedModel

STATE_FORMAT = 1


class BindingError(PermissionError):
    """A state or artifact was offered to a model, tokenizer or tenant it is not bound to."""


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
    maps: dict[str, torch.Tensor] = field(default_factory=dict)  # compressed maps (mapflow layout)
    maps_meta: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def content_hash(self) -> str:
        return content_hash(self.text)

    def has(self, what: str) -> bool:
        return {"kv": self.keys_pre_rope is not None and self.values is not None, "maps": bool(self.maps)}[what]

    def nbytes(self) -> int:
        ts = [self.tokens, self.offsets, self.keys_pre_rope, self.values, *self.maps.values()]
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
        tensors.update({f"maps.{k}": v for k, v in self.maps.items()})
        manifest = {
            "kind": "context_state",
            "format": STATE_FORMAT,
            "text": self.text,
            "binding": vars(self.binding),
            "maps_meta": self.maps_meta,
            "meta": self.meta,
        }
        return tensors, manifest

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], manifest: dict, what: str = "state") -> ContextState:
        if manifest.get("kind") != "context_state" or manifest.get("format") != STATE_FORMAT:
            raise tensorfile.TensorFileError(
                f"{what} is not a ctxrelay context state (format {STATE_FORMAT}); "
                f"it says kind={manifest.get('kind')!r} format={manifest.get('format')!r}"
            )
        return ContextState(
            text=manifest["text"],
            tokens=tensors["tokens"],
            offsets=tensors["offsets"],
            binding=Binding(**manifest["binding"]),
            keys_pre_rope=tensors.get("keys_pre_rope"),
            values=tensors.get("values"),
            maps={k[5:]: v for k, v in tensors.items() if k.startswith("maps.")},
            maps_meta=manifest.get("maps_meta", {}),
            meta=manifest.get("meta", {}),
        )

    def to_bytes(self) -> bytes:
        return tensorfile.to_bytes(*self.to_tensors())

    @staticmethod
    def from_bytes(data: bytes, what: str = "state") -> ContextState:
        return ContextState.from_tensors(*tensorfile.from_bytes(data, what), what=what)

    def save(self, path: str | Path) -> Path:
        return tensorfile.write(path, *self.to_tensors())

    @staticmethod
    def load(path: str | Path) -> ContextState:
        return ContextState.from_tensors(*tensorfile.read(path), what=str(path))


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenize_with_offsets(m: LoadedModel, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids as the model's tokenizer gives them (special tokens included) and char spans.

    Added special tokens (BOS) get the empty span (0, 0).
    """
    enc = m.tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).view(-1, 2)
    return ids, offsets


def capture_state(
    m: LoadedModel, text: str, tenant: str, *, kv: bool = True, capture=None, meta: dict | None = None
) -> tuple[ContextState, object]:
    """Native sender prefill of `text` that records what transports need.

    `capture` (a runner.Capture) may carry an attention-probability callback (mapflow's
    compressor); kv=True records pre-RoPE keys and values. Returns the state and the forward output.
    """
    from ctxrelay.models import runner

    ids, offsets = tokenize_with_offsets(m, text)
    cap = capture or runner.Capture()
    cap.keys_pre_rope = cap.keys_pre_rope or kv
    cap.values = cap.values or kv
    t0 = time.perf_counter()
    out = runner.forward(m, ids, capture=cap)
    state = ContextState(
        text=text,
        tokens=ids,
        offsets=offsets,
        binding=Binding.of(m, tenant),
        keys_pre_rope=torch.stack(cap.keys) if kv else None,
        values=torch.stack(cap.vals) if kv else None,
        meta={"sender": m.spec.name, "prefill_s": time.perf_counter() - t0, **(meta or {})},
    )
    return state, out
