"""Sender-like random block maps: operator tests and the GPU check time and compare kernels on them."""

from __future__ import annotations

import torch

from ctxrelay.transports.mapflow.sparse import BlockMaps


def random_maps(tokens: int, heads: int, block: int, extra: int, seed: int = 0) -> BlockMaps:
    """Sender-like sparse map: per (head, query block) the sink, the diagonal and `extra` random blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-tokens // block)
    keep = torch.zeros(nb, nb, heads, dtype=torch.bool)  # [qb, kb, head]
    for i in range(nb):
        keep[i, 0] = keep[i, i] = True
        if i > 1:
            pick = torch.randint(1, i, (heads, extra), generator=g)
            keep[i].scatter_(0, pick.t(), True)
    qb, kb, hd = keep.nonzero(as_tuple=True)  # row-major: per row ascending (kb, head) = ascending col
    tiles = torch.rand(len(qb), block, block, generator=g)
    qpos = qb[:, None, None] * block + torch.arange(block)[None, :, None]
    kpos = kb[:, None, None] * block + torch.arange(block)[None, None, :]
    tiles = (tiles * ((kpos <= qpos) & (qpos < tokens) & (kpos < tokens))).half().float()  # stored precision
    row_mass = torch.zeros(heads, nb, block).index_put_((hd, qb), tiles.sum(-1), accumulate=True)
    crow = torch.zeros(nb + 1, dtype=torch.int32)
    crow[1:] = torch.bincount(qb, minlength=nb).cumsum(0)
    return BlockMaps(
        crow=crow,
        col=(kb * heads + hd).to(torch.int32),
        tiles=tiles.to(torch.float16),
        mass=tiles.sum((1, 2)) / block,
        row_mass=row_mass.view(heads, -1)[:, :tokens].contiguous(),
        heads=heads,
        block=block,
    )


def simplex_w(hs: int, hr: int, seed: int = 0) -> torch.Tensor:
    """Random mixing weights W [Hs, Hr], each receiver head's column on the simplex (as calibration keeps them)."""
    from ctxrelay.transports.mapflow.mixing import project_simplex

    g = torch.Generator().manual_seed(seed)
    return project_simplex(torch.randn(hs, hr, generator=g))
