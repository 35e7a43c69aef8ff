"""Which sender layers each receiver layer's map reads (`--set source_select=`).

offsets (the default): the depth-aligned sender layer and the layers 4 above and below it
(align.layer_sources). greedy: per receiver layer, `source_layers` sender layers chosen one at a time,
each the one that most lowers the ridge map's error on the validation texts (keys and values, each
relative to its own variance), as Heo et al. (arXiv 2608.03893) read the top-k most predictive source
layers. The choice needs no map trained per candidate: one pass over the data gathers the second
moments of all sender layers against all receiver layers (training and validation texts apart), and
every candidate's ridge fit and validation error are closed forms of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.heterofold.align import layer_sources
from ctxrelay.transports.heterofold.calibration import text_cache
from ctxrelay.transports.heterofold.kv_maps import ROLES

RULES = ("offsets", "greedy")
MAX_CACHED = 16  # longest greedy choice looked for in the cache


@dataclass
class Sums:
    """Running sums over aligned rows of x (all sender layers) and y (all receiver layers), float64.

    Not recolor.Moments: that one multiplies in fp64 and keeps the whole Cyy, which over every layer of a 1.5B
    sender (7168 features) costs minutes more, and the validation error needs only Cyy's diagonal."""

    n: int
    sx: torch.Tensor  # [Dx]
    sy: torch.Tensor  # [Dy]
    sxx: torch.Tensor  # [Dx, Dx]
    sxy: torch.Tensor  # [Dx, Dy]
    syy_diag: torch.Tensor  # [Dy]: only each target's own variance is needed

    @staticmethod
    def zeros(dx: int, dy: int) -> Sums:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)
        return Sums(0, z(dx), z(dy), z(dx, dx), z(dx, dy), z(dy))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        # products of one text in fp32 (a few hundred rows), accumulated over texts in fp64
        x, y = x.float(), y.float()
        self.n += x.shape[0]
        self.sx += x.sum(0).double()
        self.sy += y.sum(0).double()
        self.sxx += (x.T @ x).double()
        self.sxy += (x.T @ y).double()
        self.syy_diag += y.pow(2).sum(0).double()

    def centred(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """mu_x, mu_y, Cxx, Cxy, diag(Cyy)."""
        if self.n < 2:
            raise ValueError("need at least two aligned token pairs to choose source layers; give more text")
        mx, my = self.sx / self.n, self.sy / self.n
        return (
            mx,
            my,
            self.sxx / self.n - torch.outer(mx, mx),
            self.sxy / self.n - torch.outer(mx, my),
            self.syy_diag / self.n - my.pow(2),
        )


def gather(
    sender: LoadedModel,
    receiver: LoadedModel,
    pairs: list[tuple[text_cache.SenderText, text_cache.ReceiverText]],
    pairing: str,
    desc: str,
) -> dict[str, Sums]:
    dx = sender.spec.num_layers * sender.spec.num_kv_heads * sender.spec.head_dim
    dy = receiver.spec.num_layers * receiver.spec.num_kv_heads * receiver.spec.head_dim
    sums = {r: Sums.zeros(dx, dy) for r in ROLES}
    for role, send, recv, src, keep in text_cache.aligned_rows(sender, receiver, pairs, pairing, desc):
        x = send[:, src].permute(1, 0, 2, 3).reshape(keep.numel(), -1)
        y = recv[:, keep].permute(1, 0, 2, 3).reshape(keep.numel(), -1)
        sums[role].add(x, y)
    return sums


class Scorer:
    """Validation error of the ridge map from any set of sender layers to one receiver layer."""

    def __init__(self, train: Sums, val: Sums, fx: int, fy: int, alpha: float):
        self.t = train.centred()
        self.v = val.centred()
        self.fx, self.fy, self.alpha = fx, fy, alpha

    def rel_error(self, layers: list[int], j: int) -> float:
        """E_val |y - x W - b|^2 / tr(Cov_val y) for receiver layer j, W, b the ridge fit on training."""
        idx = torch.cat([torch.arange(li * self.fx, (li + 1) * self.fx) for li in layers])
        cols = slice(j * self.fy, (j + 1) * self.fy)
        mx, my, cxx, cxy, _ = self.t
        c = cxx[idx][:, idx]
        c = c + self.alpha * (torch.trace(c) / c.shape[0]) * torch.eye(c.shape[0], dtype=c.dtype)
        w = torch.linalg.solve(c, cxy[idx, cols])
        b = my[cols] - mx[idx] @ w
        vmx, vmy, vxx, vxy, vyy = self.v
        bias = vmy[cols] - vmx[idx] @ w - b
        var = vyy[cols].sum()
        err = var - 2 * (w * vxy[idx, cols]).sum() + ((vxx[idx][:, idx] @ w) * w).sum() + bias.pow(2).sum()
        return float(err / var.clamp_min(1e-12))


def greedy(scorers: dict[str, Scorer], sender_layers: int, receiver_layers: int, k: int) -> tuple[list, list]:
    """Per receiver layer: sender layers added one at a time by the summed relative error of keys and
    values; returns the layers in the order chosen and each step's error (what the artifact records)."""
    order, errors = [], []
    for j in tqdm(range(receiver_layers), desc="source layers", unit="layer", leave=False):
        chosen: list[int] = []
        steps: list[float] = []
        for _ in range(k):
            scored = [
                (sum(s.rel_error([*chosen, c], j) for s in scorers.values()), c)
                for c in range(sender_layers)
                if c not in chosen
            ]
            err, best = min(scored)
            chosen.append(best)
            steps.append(round(err, 5))
        order.append(chosen)
        errors.append(steps)
    return order, errors


def offsets_error(scorers: dict[str, Scorer], sources: list[list[int]]) -> list[float]:
    return [round(sum(s.rel_error(layers, j) for s in scorers.values()), 5) for j, layers in enumerate(sources)]


def choose(
    sender: LoadedModel,
    receiver: LoadedModel,
    rule: str,
    k: int,
    train_pairs,
    val_pairs,
    pairing: str,
    alpha: float,
    cache: Path,
) -> tuple[list[list[int]], dict]:
    """The sources of every receiver layer, and a record of the choice (kept in the artifact's params).

    `train_pairs` / `val_pairs` are called only when the choice is not cached: `cache` is the path of a JSON
    file whose name holds "{k}", filled with the number of layers chosen.
    """
    default = layer_sources(sender.spec.num_layers, receiver.spec.num_layers)
    if rule not in RULES:
        raise ValueError(f"unknown source_select {rule!r}; use one of {', '.join(RULES)}")
    if rule == "offsets":
        if k != len(default[0]):
            raise ValueError(f"source_select=offsets reads {len(default[0])} layers; source_layers={k} needs greedy")
        return default, {"rule": "offsets"}
    if not 1 <= k <= sender.spec.num_layers:
        raise ValueError(f"source_layers must be 1..{sender.spec.num_layers} ({sender.name}'s layers), got {k}")
    # a greedy choice of k layers is the first k of any longer choice made on the same data
    name = lambda n: cache.with_name(cache.name.replace("{k}", str(n)))
    for n in range(k, MAX_CACHED + 1):
        if name(n).exists():
            longer = json.loads(name(n).read_text())
            return _record(longer["order"], longer["val_rel_error_steps"], longer["val_rel_error_offsets"], k)
    fx = sender.spec.num_kv_heads * sender.spec.head_dim
    fy = receiver.spec.num_kv_heads * receiver.spec.head_dim
    train = gather(sender, receiver, train_pairs(), pairing, "source moments (train)")
    val = gather(sender, receiver, val_pairs(), pairing, "source moments (validation)")
    scorers = {r: Scorer(train[r], val[r], fx, fy, alpha) for r in ROLES}
    del train, val
    order, steps = greedy(scorers, sender.spec.num_layers, receiver.spec.num_layers, k)
    record = _record(order, steps, offsets_error(scorers, default), k)[1]
    name(k).write_text(json.dumps(record))
    return record["sources"], record


def _record(order: list[list[int]], steps: list[list[float]], offsets: list[float], k: int) -> tuple[list, dict]:
    sources = [sorted(o[:k]) for o in order]
    return (
        sources,
        {
            "rule": "greedy",
            "k": k,
            "sources": sources,
            "order": [o[:k] for o in order],
            "val_rel_error": [s[k - 1] for s in steps],  # keys + values, each relative to its variance
            "val_rel_error_steps": [s[:k] for s in steps],
            "val_rel_error_offsets": offsets,  # today's fixed offsets, on the same data
        },
    )
