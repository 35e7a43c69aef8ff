"""Per-layer affine maps from sender K/V features to receiver pre-RoPE keys and values.

Receiver layer j reads the head-flattened pre-RoPE keys (or values) of three sender layers
(align.layer_sources), concatenated: x in R^{3 * Hkv_S * d_S}. Its map is one affine function
y = x W + b with y in R^{Hkv_R * d_R}: calibration folds every correction into W and b. W is kept
either dense or as factors U [dx, r] @ V [r, dy], which makes artifacts small and translation
cheaper; either way it is one fixed affine map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("k", "v")


@dataclass
class AffineMap:
    bias: torch.Tensor  # [dy]
    weight: torch.Tensor | None = None  # [dx, dy] dense, or
    u: torch.Tensor | None = None  # [dx, r] and
    vt: torch.Tensor | None = None  # [r, dy] factors

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return torch.addmm(self.bias, x, self.weight)
        return torch.addmm(self.bias, x @ self.u, self.vt)

    def blocks(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """The map applied to the concatenation of `xs` without building it (row blocks of W)."""
        y, r0 = None, 0
        lead = self.weight if self.weight is not None else self.u
        for x in xs:
            part = x @ lead[r0 : r0 + x.shape[1]]
            y = part if y is None else y.add_(part)
            r0 += x.shape[1]
        if self.weight is None:
            y = y @ self.vt
        return y.add_(self.bias)

    def dense(self) -> torch.Tensor:
        return self.weight if self.weight is not None else self.u @ self.vt

    @property
    def rank(self) -> int | None:
        return None if self.u is None else self.u.shape[1]

    def factored(
        self, rank: int | None, mean: torch.Tensor | None = None, cov: torch.Tensor | None = None
    ) -> AffineMap:
        """A rank-`rank` version; None or a rank >= min(dx, dy) keeps it dense.

        With the input's mean and covariance, W is projected on the top principal directions of
        its OUTPUT (x - mean) W (the rank-r map closest in expected squared error) and the bias
        keeps the mean's full image; without them, the truncated SVD of W.
        """
        w = self.dense()
        if rank is None or rank >= min(w.shape):
            return AffineMap(self.bias, weight=w)
        if cov is None:
            u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
            root = s[:rank].sqrt()
            return AffineMap(self.bias, u=(u[:, :rank] * root).to(w.dtype), vt=(root[:, None] * vh[:rank]).to(w.dtype))
        wd = w.double()
        _, evecs = torch.linalg.eigh(wd.T @ cov.double() @ wd)
        top = evecs[:, -rank:]  # [dy, r]
        u = wd @ top
        bias = self.bias.double() + (mean.double() @ (wd - u @ top.T) if mean is not None else 0.0)
        return AffineMap(bias.to(w.dtype), u=u.to(w.dtype), vt=top.T.contiguous().to(w.dtype))

    def to(self, dtype: torch.dtype) -> AffineMap:
        c = lambda t: None if t is None else t.to(dtype)
        return AffineMap(c(self.bias), c(self.weight), c(self.u), c(self.vt))


@dataclass
class FoldMaps:
    """All maps of one sender -> receiver pair: sources[j] are the sender layers receiver layer j reads."""

    sources: list[list[int]]
    maps: dict[str, list[AffineMap]]  # role -> one map per receiver layer

    @property
    def num_layers(self) -> int:
        return len(self.sources)

    def to_tensors(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        out = {}
        for role in ROLES:
            for j, m in enumerate(self.maps[role]):
                m = m.to(dtype)
                out[f"{role}.{j}.bias"] = m.bias
                if m.weight is not None:
                    out[f"{role}.{j}.weight"] = m.weight
                else:
                    out[f"{role}.{j}.u"], out[f"{role}.{j}.vt"] = m.u, m.vt
        return out

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], sources: list[list[int]]) -> FoldMaps:
        maps: dict[str, list[AffineMap]] = {}
        f = lambda key: None if key not in tensors else tensors[key].float()
        for role in ROLES:
            maps[role] = [
                AffineMap(f(f"{role}.{j}.bias"), f(f"{role}.{j}.weight"), f(f"{role}.{j}.u"), f(f"{role}.{j}.vt"))
                for j in range(len(sources))
            ]
        return FoldMaps([list(s) for s in sources], maps)

    @staticmethod
    def identity(sources: list[list[int]], dim: int, middle: int = 1) -> FoldMaps:
        """Maps that copy the middle source layer: a model transferring to itself (exactness check)."""
        n = len(sources[0])
        w = torch.zeros(n * dim, dim)
        w[middle * dim : (middle + 1) * dim] = torch.eye(dim)
        ident = AffineMap(torch.zeros(dim), weight=w)
        return FoldMaps([list(s) for s in sources], {r: [ident] * len(sources) for r in ROLES})

    def nbytes(self, dtype: torch.dtype = torch.float16) -> int:
        return sum(t.numel() * t.element_size() for t in self.to_tensors(dtype).values())


def layer_features(sender: torch.Tensor, layers: list[int], rows: torch.Tensor) -> torch.Tensor:
    """[L_S, T_S, Hkv, d] sender K or V -> [len(rows), len(layers) * Hkv * d] features of `rows`."""
    picked = sender[layers][:, rows]  # [n, R, Hkv, d]
    return picked.permute(1, 0, 2, 3).reshape(rows.shape[0], -1)


@torch.inference_mode()
def translate(
    maps: FoldMaps,
    send_keys: torch.Tensor,
    send_values: torch.Tensor,
    src: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receiver pre-RoPE keys and values [L_R, T_R, Hkv_R, d_R]; rows where src < 0 stay zero."""
    t_r = src.shape[0]
    rows = src.clamp(min=0)
    out = {}
    for role, send in (("k", send_keys), ("v", send_values)):
        flat = send.reshape(send.shape[0], send.shape[1], -1).to(dtype)  # [L_S, T_S, Hkv*d], a view when fp32
        # map the sender's rows once, then pick the aligned rows (dy <= dx: cheaper than gathering x)
        result = torch.empty(maps.num_layers, t_r, kv_heads * head_dim, dtype=dtype)
        for j, layers in enumerate(maps.sources):
            y = maps.maps[role][j].blocks([flat[layer] for layer in layers])
            torch.index_select(y, 0, rows, out=result[j])
        result[:, src < 0] = 0.0
        out[role] = result.view(maps.num_layers, t_r, kv_heads, head_dim)
    return out["k"], out["v"]
