"""Fused mix-and-apply on CUDA (Triton), the paper's Algorithm 2; `apply.replace_attention` is its reference.

One program per (query block i, receiver head h). It walks query-block row i of the stored BSR map
(col = key_block * Hs + sender_head, so the sender heads of one key block are contiguous), adds
W[hs, h] * tile / row_mass into a B x B register block for the current key block, and when the key
block is done multiplies that block with the receiver's V block of h's kv group into the output
accumulator. The mixed receiver map exists only one B x B block at a time, in registers.

The reuse path imports this module only for CUDA tensors; without triton it imports cleanly and
`available()` is False. NOTE: written without a GPU at hand (never run); its test
(tests/test_mapflow_triton.py) compares it with the torch operator and is skipped where CUDA is absent.
"""

import torch  # no `from __future__ import annotations`: triton.jit reads the tl.constexpr annotations

from ctxrelay.transports.mapflow.sparse import BlockMaps

try:  # the kernel needs triton's names as module globals (triton.jit resolves them there)
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: kernel_inputs and available() still work
    triton = tl = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _mix_apply(
        run_crow,  # [nqb + 1] runs of query-block row i are run_crow[i] .. run_crow[i+1]
        run_start,  # [n_runs + 1] tiles of run r are run_start[r] .. run_start[r+1]
        run_kb,  # [n_runs] key block of run r
        col,  # [nnz] int32, kb * HS + hs
        tiles,  # [nnz, B, B] (fp16/fp32)
        inv_mass,  # [HS, T] fp32
        w,  # [HS, HR] fp32
        v,  # [HKV, T, D]
        out,  # [HR, T, D] fp32
        T,
        HS: tl.constexpr,
        HR: tl.constexpr,
        GROUP: tl.constexpr,
        B: tl.constexpr,
        D: tl.constexpr,
    ):
        i = tl.program_id(0)
        h = tl.program_id(1)
        g = h // GROUP
        offs_b = tl.arange(0, B)
        offs_d = tl.arange(0, D)
        rows = i * B + offs_b
        row_ok = rows < T
        acc = tl.zeros((B, D), dtype=tl.float32)
        r0 = tl.load(run_crow + i)
        r1 = tl.load(run_crow + i + 1)
        for r in range(r0, r1):
            kb = tl.load(run_kb + r)
            n0 = tl.load(run_start + r)
            n1 = tl.load(run_start + r + 1)
            blk = tl.zeros((B, B), dtype=tl.float32)
            for n in range(n0, n1):  # the sender heads of key block kb: one W-weighted B x B block
                hs = tl.load(col + n) % HS
                wv = tl.load(w + hs * HR + h)
                inv = tl.load(inv_mass + hs * T + rows, mask=row_ok, other=0.0)
                base = n.to(tl.int64) * B * B
                tile = tl.load(tiles + base + offs_b[:, None] * B + offs_b[None, :]).to(tl.float32)
                blk += tile * (wv * inv)[:, None]
            keys = kb * B + offs_b
            vblk = tl.load(v + g * T * D + keys[:, None] * D + offs_d[None, :], mask=(keys < T)[:, None], other=0.0)
            acc += tl.dot(blk, vblk.to(tl.float32))
        tl.store(out + h * T * D + rows[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])


def kernel_inputs(bm: BlockMaps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of equal key block within each BSR row: (run_crow [nqb+1], run_start [runs+1], run_kb [runs])."""
    nb = bm.num_row_blocks
    qb, kb, _ = bm.coords()
    new_run = torch.ones(bm.nnz, dtype=torch.bool)
    if bm.nnz > 1:
        new_run[1:] = (kb[1:] != kb[:-1]) | (qb[1:] != qb[:-1])
    starts = new_run.nonzero(as_tuple=True)[0]
    run_start = torch.cat([starts, torch.tensor([bm.nnz])])
    run_kb = kb[starts]
    run_crow = torch.zeros(nb + 1, dtype=torch.int64)
    run_crow[1:] = torch.bincount(qb[starts], minlength=nb).cumsum(0)
    return run_crow.int(), run_start.int(), run_kb.int()


def replace_attention_triton(bm: BlockMaps, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Same contract as apply.replace_attention: [1, Hr, T, d] from the sender map, W [Hs, Hr], V [1, Hkv, T, d]."""
    if not available():
        raise RuntimeError("the Triton mix-and-apply kernel needs CUDA and triton; use apply.replace_attention")
    dev = v.device
    _, hkv, t, d = v.shape
    hs, hr = w.shape
    run_crow, run_start, run_kb = (x.to(dev) for x in kernel_inputs(bm))
    inv = (1.0 / bm.row_mass.float().clamp_min(1e-30)).to(dev).contiguous()
    out = torch.empty(hr, t, d, device=dev, dtype=torch.float32)
    grid = (bm.num_row_blocks, hr)
    _mix_apply[grid](
        run_crow,
        run_start,
        run_kb,
        bm.col.to(dev),
        bm.tiles.to(dev).contiguous(),
        inv,
        w.float().to(dev).contiguous(),
        v[0].contiguous(),
        out,
        t,
        HS=hs,
        HR=hr,
        GROUP=hr // hkv,
        B=bm.block,
        D=d,
    )
    return out.unsqueeze(0).to(v.dtype)
