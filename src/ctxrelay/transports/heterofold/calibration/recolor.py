"""Closed-form maps from second moments: KV Ridge (baseline) and Recolor.

Both are functions of the same statistics of aligned pairs (x = sender features, y = receiver
target) per receiver layer and role. With the whitened cross-covariance
    M = Cxx^-1/2 Cxy Cyy^-1/2 = U diag(rho) V^T   (rho = canonical correlations)
every fit here is  W = Cxx^-1/2 U diag(f(rho)) V^T Cyy^1/2,  b = mu_y - mu_x W:
  ridge (regression)   f(rho) = rho        least squares; shrinks y toward its mean where x says little
  recolor (the paper)  f(rho) = 1          whiten, Procrustes (U V^T), restore the receiver covariance
  recolor, gamma       f(rho) = rho^gamma  in between: gamma=0 is recolor, gamma=1 is regression
Shrinkage eps adds eps * mean eigenvalue to both covariances before whitening; without it the
whitening of near-null sender directions amplifies noise, which is why plain Recolor can lose to
ridge (measured in the calibration's init search, recorded in each artifact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Moments:
    """Running sums of aligned pairs, float64."""

    n: int
    sx: torch.Tensor  # [dx]
    sy: torch.Tensor  # [dy]
    sxx: torch.Tensor  # [dx, dx]
    sxy: torch.Tensor  # [dx, dy]
    syy: torch.Tensor  # [dy, dy]

    @staticmethod
    def zeros(dx: int, dy: int) -> Moments:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)
        return Moments(0, z(dx), z(dy), z(dx, dx), z(dx, dy), z(dy, dy))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y
        self.syy += y.T @ y

    def stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Means and covariances (mu_x, mu_y, Cxx, Cxy, Cyy)."""
        if self.n < 2:
            raise ValueError("need at least two aligned token pairs to fit a map; give more calibration text")
        mx, my = self.sx / self.n, self.sy / self.n
        cxx = self.sxx / self.n - torch.outer(mx, mx)
        cxy = self.sxy / self.n - torch.outer(mx, my)
        cyy = self.syy / self.n - torch.outer(my, my)
        return mx, my, cxx, cxy, cyy

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.{k}": getattr(self, k) for k in ("sx", "sy", "sxx", "sxy", "syy")}
        out[f"{prefix}.n"] = torch.tensor([self.n], dtype=torch.int64)
        return out

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor], prefix: str) -> Moments:
        g = lambda k: t[f"{prefix}.{k}"]
        return Moments(int(g("n")[0]), g("sx"), g("sy"), g("sxx"), g("sxy"), g("syy"))


def _shrunk(c: torch.Tensor, eps: float) -> torch.Tensor:
    c = (c + c.T) / 2
    return c + eps * (torch.trace(c) / c.shape[0]) * torch.eye(c.shape[0], dtype=c.dtype)


def _powers(c: torch.Tensor, floor: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """(C^-1/2, C^1/2) of a symmetric PSD matrix by eigendecomposition."""
    evals, evecs = torch.linalg.eigh(c)
    evals = evals.clamp_min(floor * float(evals.max().clamp_min(floor)))
    return (evecs * evals.rsqrt()) @ evecs.T, (evecs * evals.sqrt()) @ evecs.T


def fit_ridge(m: Moments, alpha: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """W [dx, dy], b [dy] minimising |x W + b - y|^2 + lambda |W|^2, lambda = alpha * mean eigenvalue of Cxx."""
    mx, my, cxx, cxy, _ = m.stats()
    w = torch.linalg.solve(_shrunk(cxx, alpha), cxy)
    return w.float(), (my - mx @ w).float()


def fit_recolor(m: Moments, gamma: float = 0.0, eps: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Whiten, align by orthogonal Procrustes, re-colour to the receiver covariance (see module doc)."""
    mx, my, cxx, cxy, cyy = m.stats()
    wx, _ = _powers(_shrunk(cxx, eps))
    wy_inv, wy = _powers(_shrunk(cyy, eps))
    u, rho, vh = torch.linalg.svd(wx @ cxy @ wy_inv, full_matrices=False)
    f = rho.clamp(0, 1) ** gamma if gamma else torch.ones_like(rho)
    w = wx @ (u * f) @ vh @ wy
    return w.float(), (my - mx @ w).float()


def canonical_correlations(m: Moments, eps: float = 1e-3) -> torch.Tensor:
    _, _, cxx, cxy, cyy = m.stats()
    wx, _ = _powers(_shrunk(cxx, eps))
    wy_inv, _ = _powers(_shrunk(cyy, eps))
    return torch.linalg.svdvals(wx @ cxy @ wy_inv).float()
