"""The Triton mix-and-apply kernel against the torch operator (CUDA only; skipped elsewhere)."""

import pytest
import torch

from ctxrelay.transports.mapflow import apply, triton_apply
from ctxrelay.transports.mapflow.synthetic import random_maps
from ctxrelay.transports.mapflow.synthetic import simplex_w as _w


def test_kernel_runs_group_tiles_by_key_block():
    bm = random_maps(200, 4, 16, extra=2)
    run_crow, run_start, run_kb = triton_apply.kernel_inputs(bm)
    assert int(run_crow[-1]) == len(run_kb) and int(run_start[-1]) == bm.nnz
    qb, kb, _ = bm.coords()
    for r in range(len(run_kb)):  # every run is one key block of one query-block row
        lo, hi = int(run_start[r]), int(run_start[r + 1])
        assert (kb[lo:hi] == run_kb[r]).all() and (qb[lo:hi] == qb[lo]).all()


@pytest.mark.skipif(not triton_apply.available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("tokens", [256, 1000])
def test_triton_matches_torch_operator(tokens):
    hs, hr, hkv, d, b = 12, 14, 2, 64, 64
    bm = random_maps(tokens, hs, b, extra=3)
    w = _w(hs, hr)
    v = torch.randn(1, hkv, tokens, d)
    ref = apply.replace_attention(apply.prepare_replace(bm), w, v)
    out = triton_apply.replace_attention_triton(bm, w, v.cuda()).cpu()
    assert (out - ref).abs().max() < 2e-3  # tl.dot may use tf32
