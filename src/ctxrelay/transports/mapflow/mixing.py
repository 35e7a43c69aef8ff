"""Head-mixing weights W [Hs, Hr] on the simplex (each receiver head a convex mix of sender heads).

Two ways to get them: a closed-form-ish diagnostic fit (least squares on the simplex, from Gram
matrices of sampled map rows, scored by TV distance) and the end-to-end trained parametrisation
`SimplexW` (softmax over sender heads, so W stays on the simplex without projection).
"""

from __future__ import annotations

import torch


def identity_w(heads: int) -> torch.Tensor:
    return torch.eye(heads)


def uniform_w(hs: int, hr: int) -> torch.Tensor:
    return torch.full((hs, hr), 1.0 / hs)


def one_hot_w(assign: list[int] | torch.Tensor, hs: int) -> torch.Tensor:
    """Receiver head h copies sender head assign[h]."""
    assign = torch.as_tensor(assign, dtype=torch.long)
    w = torch.zeros(hs, len(assign))
    w[assign, torch.arange(len(assign))] = 1.0
    return w


def proportional_heads(hs: int, hr: int) -> list[int]:
    """Sender head at the same relative index (the IAM-style mapping without learned mixing)."""
    return [round(h * (hs - 1) / max(1, hr - 1)) for h in range(hr)]


def check_simplex(w: torch.Tensor, atol: float = 1e-4) -> None:
    if (w < -atol).any() or not torch.allclose(w.sum(0), torch.ones(w.shape[1], dtype=w.dtype), atol=atol):
        raise ValueError("mixing weights must be nonnegative with columns summing to 1 (convex mixes of sender heads)")


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each column of v [n, m] onto the probability simplex (Duchi et al.)."""
    n = v.shape[0]
    u, _ = torch.sort(v, dim=0, descending=True)
    css = u.cumsum(0) - 1.0
    ind = torch.arange(1, n + 1, dtype=v.dtype)[:, None]
    cond = (u - css / ind) > 0
    rho = cond.to(v.dtype).cumsum(0).argmax(0)  # last index where cond holds (cond is a prefix)
    theta = css.gather(0, rho[None]) / (rho[None] + 1).to(v.dtype)
    return (v - theta).clamp_min(0)


def fit_simplex_lsq(gram: torch.Tensor, cross: torch.Tensor, iters: int = 300) -> torch.Tensor:
    """argmin_W sum_h ||A_S^T w_h - a_h||^2 with w_h on the simplex, given G = A_S A_S^T [Hs, Hs] and
    C = A_S A_R^T [Hs, Hr] (accelerated projected gradient; the problem is small and convex)."""
    g, c = gram.double(), cross.double()
    hs, hr = c.shape
    step = 1.0 / float(torch.linalg.eigvalsh(g).max().clamp_min(1e-12))
    w = torch.full((hs, hr), 1.0 / hs, dtype=torch.float64)
    y, t = w.clone(), 1.0
    for _ in range(iters):
        w_next = project_simplex(y - step * (g @ y - c))
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        y = w_next + ((t - 1) / t_next) * (w_next - w)
        w, t = w_next, t_next
    return w.float()


def tv_distance(w: torch.Tensor, sender_rows: torch.Tensor, receiver_rows: torch.Tensor) -> torch.Tensor:
    """Per receiver head mean TV between the mixed sender rows and the receiver's rows.

    sender_rows [Hs, N, S], receiver_rows [Hr, N, S] (N attention rows, each summing to 1).
    Returns [Hr]; L1 distance is twice TV.
    """
    mixed = torch.einsum("kh,kns->hns", w.to(sender_rows.dtype), sender_rows)
    return 0.5 * (mixed - receiver_rows).abs().sum(-1).mean(-1)


class SimplexW(torch.nn.Module):
    """Trainable W for several receiver layers: W[j] = softmax(logits[j], over sender heads)."""

    def __init__(self, init: dict[int, torch.Tensor], floor: float = 1e-4):
        super().__init__()
        self.layers = sorted(init)
        self.logits = torch.nn.ParameterDict(
            {str(j): torch.nn.Parameter(init[j].float().clamp_min(floor).log()) for j in self.layers}
        )

    def forward(self) -> dict[int, torch.Tensor]:
        return {j: torch.softmax(self.logits[str(j)], dim=0) for j in self.layers}

    def weights(self) -> dict[int, torch.Tensor]:
        with torch.no_grad():
            return {j: w.detach().clone() for j, w in self.forward().items()}
