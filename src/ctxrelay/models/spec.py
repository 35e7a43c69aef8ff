"""A uniform view over a Hugging Face causal LM: shape facts, family row, identity hashes."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ctxrelay.models.families import Family, family_of


@dataclass
class ModelSpec:
    """What a transport needs to know about a model, nothing more."""

    name: str
    family: Family
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    attn_scale: float
    softcap: float | None
    sliding_windows: list[int | None]  # per layer; None = full attention
    layer_types: list[str]  # per layer; selects the RoPE table on families that have several
    weights_hash: str
    tokenizer_hash: str
    context_window: int | None = None  # positions the model was trained for (None: not stated)


@dataclass
class LoadedModel:
    """A model ready to run: HF module (weights), tokenizer and its spec."""

    hf: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    source: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def in_dtype(self, dtype: torch.dtype) -> LoadedModel:
        """This model computing in `dtype` (itself where it already does): the same weights rounded, so the
        same spec and binding (a state or artifact bound to the model serves both); the copy's weights are
        its own (the relay's bf16 compute beside an fp32 model, ModelPool.relay_model)."""
        if dtype == self.dtype:
            return self
        # the parameters in `dtype`, buffers as they are (RoPE's inverse frequencies stay fp32, as in a model
        # loaded in bf16); each parameter copied once, already rounded, so tied weights stay tied
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in self.hf.parameters()}
        hf = copy.deepcopy(self.hf, memo)
        return LoadedModel(hf, self.tokenizer, self.spec, self.source, dict(self.extra))


def hash_state_dict(model: torch.nn.Module) -> str:
    """sha256 over parameter names, shapes, dtypes and bytes (tied weights counted once)."""
    h = hashlib.sha256()
    seen: set[int] = set()
    for name, t in sorted(model.state_dict().items()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def hash_tokenizer(tok: PreTrainedTokenizerBase) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # padding/truncation are call-time settings, not identity
        cfg = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
        payload = json.dumps(cfg, sort_keys=True)
    else:  # slow tokenizers: vocabulary + special tokens are what decide the ids
        payload = repr(sorted(tok.get_vocab().items())) + repr(tok.all_special_tokens)
    return hashlib.sha256(payload.encode()).hexdigest()


def build_spec(
    hf: PreTrainedModel, tok: PreTrainedTokenizerBase, name: str, weights_hash: str | None = None
) -> ModelSpec:
    cfg = hf.config
    fam = family_of(cfg.model_type)
    n_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scale_base = getattr(cfg, fam.attn_scale_field) if fam.attn_scale_field else head_dim
    softcap = getattr(cfg, fam.softcap_field, None) if fam.softcap_field else None
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers)
    windows: list[int | None] = [None] * n_layers
    if fam.sliding_window_from_layer_types and getattr(cfg, "sliding_window", None):
        windows = [cfg.sliding_window if t == "sliding_attention" else None for t in layer_types]
    return ModelSpec(
        name=name,
        family=fam,
        num_layers=n_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        attn_scale=float(scale_base) ** -0.5,
        softcap=softcap,
        sliding_windows=windows,
        layer_types=layer_types,
        weights_hash=weights_hash or hash_state_dict(hf),
        tokenizer_hash=hash_tokenizer(tok),
        context_window=getattr(cfg, "max_position_embeddings", None),
    )


def wrap(hf: PreTrainedModel, tok: PreTrainedTokenizerBase, name: str, weights_hash: str | None = None) -> LoadedModel:
    hf.eval()
    hf.requires_grad_(False)
    return LoadedModel(hf=hf, tokenizer=tok, spec=build_spec(hf, tok, name, weights_hash), source=name)
