"""Token and layer alignment between a sender and a receiver with different tokenizers and depths.

Token alignment (TA) pairs a receiver token with the sender token whose character span ENDS at the
same character of the text. A receiver token whose end is no sender boundary takes the sender
token of the latest preceding shared boundary (forward fill). Nothing is averaged.

Byte-level tokenizers split one character into several byte pieces that all report the character's
span. Such a run of tokens with the same end gets boundaries (end, k), k = pieces still to come:
k = 0 is the complete character, so a receiver token covering the whole character is paired with
the sender's LAST piece (the one that has read all of it), and two tokenizers that cut a character
alike pair piece by piece (a model transferring to itself pairs every token with itself).

Some receiver positions are never translated: the attention sink (position 0), special tokens
(BOS, chat-template markers) and leading tokens with no usable sender boundary before them. The
receiver computes those natively. Sender sinks (position 0 and special tokens) are never sources:
their states are outliers that mean nothing to another model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Pairing = Literal["ta", "same-index"]


@dataclass
class Alignment:
    src: torch.Tensor  # [T_R] long: sender index per receiver token, -1 where the receiver computes natively
    native: list[int]  # receiver positions computed natively (sorted; always holds 0)
    exact: int  # receiver tokens whose end matched a sender end exactly
    char_mismatch: float  # mean |receiver end - source end| in characters over translated tokens

    @property
    def translated(self) -> torch.Tensor:
        return (self.src >= 0).nonzero().view(-1)


def special_mask(ids: torch.Tensor, offsets: torch.Tensor, special_ids: set[int]) -> np.ndarray:
    """Tokens that are special (by id) or cover no text (added BOS/EOS have the span (0, 0))."""
    ids_np = ids.numpy()
    span = (offsets[:, 1] - offsets[:, 0]).numpy()
    return np.isin(ids_np, list(special_ids)) | (span <= 0)


def special_ids_of(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return ids


def char_ends(offsets: torch.Tensor) -> np.ndarray:
    # running max: ends are non-decreasing for every tokenizer we know; enforce it for searchsorted
    ends = offsets[:, 1].numpy().astype(np.int64)
    return np.maximum.accumulate(ends) if ends.size else ends


def boundary_keys(ends: np.ndarray) -> np.ndarray:
    """Sortable boundary (end, k) -> end * 256 - k, k = later tokens with the same end (byte pieces)."""
    n = ends.size
    if not n:
        return ends
    idx = np.arange(n)
    new_run = np.r_[True, ends[1:] != ends[:-1]]
    run_end = np.r_[idx[1:][new_run[1:]] - 1, n - 1]  # last index of each run
    run_id = np.cumsum(new_run) - 1
    k = run_end[run_id] - idx
    return ends * 256 - np.minimum(k, 255)


def align_tokens(
    recv_offsets: torch.Tensor,
    send_offsets: torch.Tensor,
    recv_special: np.ndarray,
    send_special: np.ndarray,
    pairing: Pairing = "ta",
) -> Alignment:
    """Sender source index for every receiver token (see module docstring)."""
    t_r, t_s = recv_offsets.shape[0], send_offsets.shape[0]
    r_end, s_end = char_ends(recv_offsets), char_ends(send_offsets)
    valid = ~send_special.astype(bool)
    valid[:1] = False  # the sender's sink
    if pairing == "ta":
        r_key, s_key = boundary_keys(r_end), boundary_keys(s_end)
        v_idx = np.nonzero(valid)[0]
        # keys are non-decreasing: the last valid sender boundary <= the receiver's, kept only if equal
        pos = np.searchsorted(s_key[v_idx], r_key, side="right") - 1
        cand = np.where(pos >= 0, v_idx[np.clip(pos, 0, None)], -1)
        hit = (pos >= 0) & (s_key[np.clip(cand, 0, None)] == r_key)
        matched = np.where(hit, cand, -1)
        src = np.maximum.accumulate(matched) if t_r else matched  # forward fill from the last shared boundary
        exact = int(hit.sum())
    elif pairing == "same-index":
        src = np.minimum(np.arange(t_r), t_s - 1)
        src = np.where(valid[src], src, -1)
        exact = int((s_end[np.clip(src, 0, None)] == r_end)[src >= 0].sum())
    else:
        raise ValueError(f"unknown token pairing {pairing!r}: use 'ta' or 'same-index'")
    src = src.copy()
    src[recv_special.astype(bool)] = -1
    src[:1] = -1  # the receiver's own sink is always computed natively
    native = np.nonzero(src < 0)[0].tolist()
    done = src >= 0
    mismatch = float(np.abs(r_end[done] - s_end[src[done]]).mean()) if done.any() else 0.0
    return Alignment(torch.from_numpy(src.astype(np.int64)), native, exact, mismatch)


def align_ids(
    recv_ids: torch.Tensor,
    recv_offsets: torch.Tensor,
    recv_special_ids: set[int],
    send_ids: torch.Tensor,
    send_offsets: torch.Tensor,
    send_special_ids: set[int],
    pairing: Pairing = "ta",
) -> Alignment:
    """Alignment from both sides' ids, offsets and special-token ids."""
    r_sp = special_mask(recv_ids, recv_offsets, recv_special_ids)
    s_sp = special_mask(send_ids, send_offsets, send_special_ids)
    return align_tokens(recv_offsets, send_offsets, r_sp, s_sp, pairing)


def layer_sources(sender_layers: int, receiver_layers: int, offsets: tuple[int, ...] = (-4, 0, 4)) -> list[list[int]]:
    """Receiver layer j reads sender layers round(j * (L_S-1)/(L_R-1)) + offsets, clamped."""
    out = []
    for j in range(receiver_layers):
        c = round(j * (sender_layers - 1) / max(receiver_layers - 1, 1))
        out.append([min(max(c + o, 0), sender_layers - 1) for o in offsets])
    return out
