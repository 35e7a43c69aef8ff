"""Calibration data: sender K/V and receiver native targets per text, cached on disk.

Sender side: the sender's pre-RoPE keys and values (a ContextState without tenant meaning).
Receiver side: its own pre-RoPE keys and values (the regression targets) and the post-RoPE
queries of a sample of rows (what the output-aware losses score keys and values with).
Both are expensive (a full prefill, minutes for the 1.5B over a calibration set) and depend only
on (model weights, text), so they are cached under <cache>/heterofold/states/, in fp16.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import tensorfile
from ctxrelay.models import runner
from ctxrelay.models.attention import AttnCall, native_attention
from ctxrelay.models.capture import capture_state
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.transports.heterofold.align import Alignment, align_ids, special_ids_of

STORE = torch.float16


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def model_key(m: LoadedModel) -> str:
    return f"{m.name.replace('/', '_')}-{m.spec.weights_hash[:12]}"


@dataclass
class SenderText:
    ids: torch.Tensor  # [T_S]
    offsets: torch.Tensor  # [T_S, 2]
    keys: torch.Tensor  # [L_S, T_S, Hkv, d] pre-k-norm, pre-RoPE
    values: torch.Tensor


@dataclass
class ReceiverText:
    ids: torch.Tensor  # [T_R]
    offsets: torch.Tensor
    keys: torch.Tensor  # [L_R, T_R, Hkv, d] pre-k-norm, pre-RoPE (targets)
    values: torch.Tensor
    rows: torch.Tensor  # [nq] query positions sampled for the output-aware losses
    queries: torch.Tensor  # [L_R, H, nq, d] post q-norm + RoPE queries of those rows


def cached_file(path: Path, make, load=lambda tensors, manifest: tensors):
    """`load(tensors, manifest)` of the calibration cache file at `path`; where there is none, or it is
    damaged (unreadable, or missing what `load` needs), `make()` -> (tensors, manifest) is written there
    first (atomically) and loaded."""
    if path.exists():
        try:
            return load(*tensorfile.read(path))
        except (tensorfile.TensorFileError, KeyError):
            path.unlink()  # damaged (e.g. interrupted by a crash before atomic writes existed): redo
    tensors, manifest = make()
    tensorfile.write(path, tensors, manifest)
    return load(tensors, manifest)


def _cached(path: Path, make) -> dict[str, torch.Tensor]:
    return cached_file(path, lambda: (make(), {"kind": "heterofold_calibration_cache"}))


def sender_text(m: LoadedModel, text: str, root: Path) -> SenderText:
    def make():
        st = capture_state(m, text, tenant="calibration")
        return {
            "ids": st.tokens,
            "offsets": st.offsets,
            "keys": st.keys_pre_rope.to(STORE),
            "values": st.values.to(STORE),
        }

    t = _cached(root / model_key(m) / f"send-{text_key(text)}.safetensors", make)
    return SenderText(t["ids"], t["offsets"], t["keys"], t["values"])


def sample_rows(t: int, n: int, first: int = 16, seed: int = 0) -> torch.Tensor:
    """`n` query rows spread over [first, t): later rows see long contexts, early ones short."""
    if t <= first:
        return torch.arange(t)
    if t - first <= n:
        return torch.arange(first, t)
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(t - first, generator=g)[:n] + first).values


def receiver_text(m: LoadedModel, text: str, root: Path, n_rows: int = 128) -> ReceiverText:
    def make():
        ids, offsets = tokenize_context(m, text)
        rows = sample_rows(ids.shape[0], n_rows, seed=int(text_key(text)[:6], 16))
        qs: dict[int, torch.Tensor] = {}

        def record(c: AttnCall) -> torch.Tensor:  # keep the queries of the sampled rows, attend natively
            qs[c.layer] = c.q[0, :, rows].clone()
            return native_attention(c)

        cap = runner.Capture(keys_pre_rope=True, values=True)
        hooks = dict.fromkeys(range(m.spec.num_layers), record)
        runner.forward(m, ids, capture=cap, attention=hooks, logits="none")
        return {
            "ids": ids,
            "offsets": offsets,
            "keys": torch.stack(cap.keys).to(STORE),
            "values": torch.stack(cap.vals).to(STORE),
            "rows": rows,
            "queries": torch.stack([qs[i] for i in range(m.spec.num_layers)]).to(STORE),
        }

    t = _cached(root / model_key(m) / f"recv{n_rows}-{text_key(text)}.safetensors", make)
    return ReceiverText(t["ids"], t["offsets"], t["keys"], t["values"], t["rows"], t["queries"])


def pair_alignment(sender: LoadedModel, receiver: LoadedModel, s: SenderText, r: ReceiverText, pairing) -> Alignment:
    return align_ids(
        r.ids,
        r.offsets,
        special_ids_of(receiver.tokenizer),
        s.ids,
        s.offsets,
        special_ids_of(sender.tokenizer),
        pairing,
    )


def aligned_rows(sender: LoadedModel, receiver: LoadedModel, pairs: list, pairing: str, desc: str):
    """Per text with translated tokens: (role, sender K or V, receiver K or V, the sender rows, the receiver
    rows) of its aligned pairs, keys then values: what every fit over aligned pairs reads."""
    for s, r in tqdm(pairs, desc=desc, unit="text", leave=False):
        al = pair_alignment(sender, receiver, s, r, pairing)
        keep = al.translated
        if keep.numel():
            yield "k", s.keys, r.keys, al.src[keep], keep
            yield "v", s.values, r.values, al.src[keep], keep


@dataclass
class NativeTail:
    logp: torch.Tensor  # [n, k] native log-probs of the top-k next tokens at the text's last n positions
    index: torch.Tensor  # [n, k] their token ids


def receiver_tail(m: LoadedModel, text: str, root: Path, n: int = 128, k: int = 64) -> NativeTail:
    """The receiver's native next-token distributions over the last `n` positions, kept as top-k
    (the end-to-end objective's target; a full [n, V] tensor per text would be ~80 MB for Qwen)."""

    def make():
        ids, _ = tokenize_context(m, text)
        logits = runner.tail_logits(m, ids, n)
        top = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
        return {"logp": top.values, "index": top.indices}

    t = _cached(root / model_key(m) / f"tail{n}x{k}-{text_key(text)}.safetensors", make)
    return NativeTail(t["logp"], t["index"])
