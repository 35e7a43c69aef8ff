"""Transferability diagnosis: how well can each receiver layer's maps be rebuilt from a sender layer?

For every (receiver layer j, sender layer l) we fit simplex head-mixing weights by least squares on
sampled attention rows of a calibration set (from Gram matrices, so the whole grid is cheap) and
score them by the mean total-variation (TV) distance to the receiver's own rows (L1 = 2 TV). A
second score is what guided mode needs: the share of the receiver's own attention mass that falls
inside the key blocks the sender's map (mixed by those weights) would select ("coverage").

From the grid: the layer mapping (suffix alignment m(j) = j + L_S - L_R, or the best-fitting sender
layer per receiver layer), r (leading receiver layers recomputed natively: those before the first
layer that fits), and refusal of a pair with no reliable reuse region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctxrelay.transports.mapflow.guided import guided_pattern
from ctxrelay.transports.mapflow.mixing import fit_simplex_lsq, tv_distance
from ctxrelay.transports.mapflow.sparse import BlockMaps


class RowSampler:
    """Keeps chosen query rows of every layer's attention probabilities: [L, H, R, T] once done."""

    def __init__(self, rows: torch.Tensor, num_layers: int, dtype: torch.dtype = torch.float16):
        self.rows = rows.long().sort().values
        self.dtype = dtype
        self.parts: dict[int, list[torch.Tensor]] = {i: [] for i in range(num_layers)}

    def on_probs(self, layer: int, row0: int, probs: torch.Tensor) -> None:
        sel = self.rows[(self.rows >= row0) & (self.rows < row0 + probs.shape[1])] - row0
        if sel.numel():
            self.parts[layer].append(probs[:, sel].to(self.dtype))

    def result(self) -> torch.Tensor:
        return torch.stack([torch.cat(self.parts[i], dim=1) for i in sorted(self.parts)])


class BlockMassCollector:
    """Per layer [H, nqb, nkb] block masses (mean row mass per tile) of the full, uncompressed map."""

    def __init__(self, num_layers: int, tokens: int, block: int):
        self.block, self.nb = block, -(-tokens // block)
        self.mass: dict[int, torch.Tensor] = {}
        self.num_layers = num_layers

    def on_probs(self, layer: int, row0: int, probs: torch.Tensor) -> None:
        h, rows, s = probs.shape
        b, nb = self.block, self.nb
        p = torch.nn.functional.pad(probs.float(), (0, nb * b - s, 0, (-rows) % b))
        m = p.view(h, -1, b, nb, b).sum((2, 4))  # [H, row blocks in chunk, nkb]
        counts = torch.tensor([min(b, rows - r) for r in range(0, rows, b)], dtype=torch.float32)
        m = m / counts[None, :, None]
        buf = self.mass.setdefault(layer, torch.zeros(h, nb, nb))
        buf[:, row0 // b : row0 // b + m.shape[1]] = m

    def result(self) -> torch.Tensor:
        return torch.stack([self.mass[i] for i in range(self.num_layers)])


def sample_rows(tokens: int, n: int, block: int) -> torch.Tensor:
    """Evenly spaced query rows past the first block (the first rows attend to almost nothing)."""
    lo = min(block, tokens - 1)
    return torch.linspace(lo, tokens - 1, n).round().long().unique()


@dataclass
class Diagnosis:
    tv: torch.Tensor  # [Lr, Ls] mean TV of the simplex-fitted mix
    coverage: torch.Tensor  # [Lr, Ls] receiver mass inside the guided pattern from sender layer l
    w_fit: torch.Tensor  # [Lr, Ls, Hs, Hr]
    suffix_mapping: list[int]
    best_mapping: list[int]
    mapping: list[int] = field(default_factory=list)
    mapping_name: str = "suffix"
    r: int = 0
    refused: bool = False
    reason: str = ""

    def tv_along(self, mapping: list[int]) -> torch.Tensor:
        return self.tv[torch.arange(len(mapping)), torch.tensor(mapping)]

    def coverage_along(self, mapping: list[int]) -> torch.Tensor:
        return self.coverage[torch.arange(len(mapping)), torch.tensor(mapping)]

    def summary(self) -> dict:
        return {
            "mapping": self.mapping_name,
            "r": self.r,
            "refused": self.refused,
            "reason": self.reason,
            "tv_suffix": [round(float(x), 4) for x in self.tv_along(self.suffix_mapping)],
            "tv_best": [round(float(x), 4) for x in self.tv_along(self.best_mapping)],
            "coverage": [round(float(x), 4) for x in self.coverage_along(self.mapping or self.best_mapping)],
            "best_mapping": self.best_mapping,
        }


def fit_grid(sender_rows: list[torch.Tensor], receiver_rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Simplex LSQ fit and TV for every (receiver layer, sender layer).

    sender_rows: per text [Ls, Hs, R, T]; receiver_rows: per text [Lr, Hr, R, T] (same rows, same T
    within a text). Returns (tv [Lr, Ls], w [Lr, Ls, Hs, Hr]).
    """
    ls, hs = sender_rows[0].shape[:2]
    lr, hr = receiver_rows[0].shape[:2]
    gram = torch.zeros(ls, hs, hs, dtype=torch.float64)
    cross = torch.zeros(ls * hs, lr * hr, dtype=torch.float64)
    for s_rows, r_rows in zip(sender_rows, receiver_rows, strict=True):
        a = s_rows.float().reshape(ls, hs, -1)
        b = r_rows.float().reshape(lr * hr, -1)
        gram += torch.bmm(a, a.transpose(1, 2)).double()
        cross += (a.reshape(ls * hs, -1) @ b.t()).double()
    cross = cross.view(ls, hs, lr, hr)
    w = torch.zeros(lr, ls, hs, hr)
    tv = torch.zeros(lr, ls)
    for j in range(lr):
        for sl in range(ls):
            w[j, sl] = fit_simplex_lsq(gram[sl], cross[sl, :, j])
    for s_rows, r_rows in zip(sender_rows, receiver_rows, strict=True):
        for sl in range(ls):
            a = s_rows[sl].float().reshape(hs, -1, s_rows.shape[-1])
            for j in range(lr):
                tv[j, sl] += tv_distance(w[j, sl], a, r_rows[j].float()).mean()
    return tv / len(sender_rows), w


def coverage_grid(
    sender_maps: list[dict[int, BlockMaps]],
    receiver_mass: list[torch.Tensor],
    w: torch.Tensor,
    guided_p: float,
    kv_heads: int,
    unit: str = "group",
) -> torch.Tensor:
    """[Lr, Ls] mean share of the receiver's own attention mass inside the guided pattern."""
    lr, ls = w.shape[:2]
    cov = torch.zeros(lr, ls)
    for maps, mass in zip(sender_maps, receiver_mass, strict=True):  # mass [Lr, Hr, nqb, nkb]
        for sl in range(ls):
            for j in range(lr):
                pat = guided_pattern(maps[sl], w[j, sl], guided_p, kv_heads, unit)
                nb = pat.num_row_blocks
                keep = torch.zeros(pat.units * nb, nb)
                keep[torch.repeat_interleave(torch.arange(pat.units * nb), pat.counts()), pat.kb] = 1.0
                keep = keep.view(pat.units, nb, nb).repeat_interleave(pat.heads_per_unit, 0)
                cov[j, sl] += (mass[j] * keep).sum(-1).mean()
    return cov / len(sender_maps)


def suffix_alignment(ls: int, lr: int) -> list[int]:
    """m(j) = j + L_S - L_R (the paper's default: align the later, more stable layers)."""
    return [max(0, j + ls - lr) for j in range(lr)]


def decide(
    tv: torch.Tensor,
    coverage: torch.Tensor,
    w: torch.Tensor,
    *,
    tv_max: float,
    mapping: str = "auto",
    min_layers: int = 2,
    r: int | None = None,
) -> Diagnosis:
    """Pick the mapping, r and whether to refuse, from the TV grid.

    mapping 'best' = argmin TV per receiver layer; 'suffix' = suffix alignment; 'auto' = best when it
    lowers the mean TV, else suffix. r = first receiver layer whose TV (under the mapping) is at most
    tv_max; refuse when fewer than `min_layers` receiver layers from r on fit within tv_max.
    """
    lr, ls = tv.shape
    suffix = suffix_alignment(ls, lr)
    best = tv.argmin(1).tolist()
    d = Diagnosis(tv, coverage, w, suffix, best)
    if mapping == "auto":
        mapping = "best" if d.tv_along(best).mean() < d.tv_along(suffix).mean() else "suffix"
    if mapping not in ("best", "suffix"):
        raise ValueError(f"unknown layer mapping {mapping!r}: use best, suffix or auto")
    d.mapping_name = mapping
    d.mapping = best if mapping == "best" else suffix
    curve = d.tv_along(d.mapping)
    fits = (curve <= tv_max).nonzero(as_tuple=True)[0]
    d.r = int(fits[0]) if r is None and len(fits) else (lr if r is None else r)
    good = int((curve[d.r :] <= tv_max).sum())
    if good < min_layers:
        d.refused = True
        d.reason = (
            f"only {good} receiver layer(s) from r={d.r} fit within TV {tv_max} (need {min_layers}); "
            f"best TV {float(curve.min()):.3f}: no reliable reuse region, use native prefill"
        )
    return d


def heatmap(d: Diagnosis, path: str | Path, title: str) -> Path:
    """Receiver layer x sender layer TV heatmap, with the chosen mapping and coverage beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
    for ax, grid, name, cmap in (
        (axes[0], d.tv, "TV distance (simplex LSQ fit)", "viridis_r"),
        (axes[1], d.coverage, "guided coverage of receiver mass", "viridis"),
    ):
        im = ax.imshow(grid.numpy(), origin="lower", aspect="auto", cmap=cmap)
        js = list(range(len(d.mapping)))
        ax.plot(d.suffix_mapping, js, "w--", lw=1, label="suffix alignment")
        ax.plot(d.mapping, js, "r.", ms=6, label=f"chosen ({d.mapping_name})")
        ax.axhline(d.r - 0.5, color="orange", lw=1, label=f"r = {d.r}")
        ax.set_xlabel("sender layer")
        ax.set_ylabel("receiver layer")
        ax.set_title(name, fontsize=10)
        fig.colorbar(im, ax=ax)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
