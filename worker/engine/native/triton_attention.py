"""Paged attention in Triton that reads K/V in place from the pool through the block table (no gather copy):
the CUDA path of ``attention.paged_attention``, for prefill chunks (packed or padded, with cached prefix blocks)
and decode steps alike, on the same tiles (``attention.TileLayout``: TILE consecutive positions of one sequence).

Pool: [2, NB + 1, bs, Hkv, D] (any block size; one token's K/V found at table[pos // bs], slot pos % bs).
Program: one (tile, KV head): its TILE positions x the G query heads of the group as the rows of one matrix
(G padded to GP, a power of two, and the rows to >= 16 for ``tl.dot``), so each K/V block is loaded once for
the whole group. Keys are taken in splits of SPLIT at absolute positions (0, SPLIT, 2 SPLIT, ...), each split
with an online softmax over BLOCK_N keys at a time, splits merged in split order. Every float op is fp32 (K/V
upcast from the pool's dtype, ``tl.dot`` in IEEE fp32: no TF32, no bf16 P), so a row's bits depend only on
its q and the keys of positions 0..p:

- a split or a key block past a row's position adds exact zeros (its max is -inf: rescale factor exp(0) = 1,
  weights exp(-inf) = 0), so what the tile's other rows reach, and the batch, change nothing;
- decode (one tile per sequence, ``split_grid``): each split is its own program writing (max, sum, acc)
  partials and a second kernel merges them in split order with the same formula as the in-program loop of a
  prefill tile, so a decode step's parallelism grows with the context without changing any bits.

Checked on CPU under ``TRITON_INTERPRET=1`` against the torch path (tests/test_triton_kernels.py); never run on
a GPU yet (no device lent when written): speed unmeasured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # keys per inner step (a multiple of 16 for tl.dot; SPLIT must be a multiple of it)


@triton.jit
def _split(q, pos, Pool, Tables, b, h, lo, hi, s_kv, s_blk, s_tok, s_kh, s_tb,
           BS: tl.constexpr, DP: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of sequence b, KV head h, for rows q [ROWS, DP] (scaled, fp32) at positions pos [ROWS]
    -> (max [ROWS], sum [ROWS], acc [ROWS, DP]) of an online softmax (max -inf, sum 0: the row sees none)."""
    dd = tl.arange(0, DP)
    d_ok = dd < D
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DP], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)  # absolute key positions
        k_ok = kp < hi
        blk = tl.load(Tables + b * s_tb + kp // BS, mask=k_ok, other=0)
        off = blk.to(tl.int64) * s_blk + (kp % BS) * s_tok + h * s_kh  # [BLOCK_N] element offsets in the pool
        kv_ok = k_ok[:, None] & d_ok[None, :]
        k = tl.load(Pool + off[:, None] + dd[None, :], mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK_N, DP]
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, BLOCK_N]
        seen = (kp[None, :] <= pos[:, None]) & k_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(Pool + s_kv + off[:, None] + dd[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    return m, l_sum, acc


@triton.jit
def _merge(M, L, ACC, m, l_sum, acc):
    """Fold one split's (m, l_sum, acc) into the running (M, L, ACC); a split the row does not reach
    (m = -inf, l_sum = 0, acc = 0) leaves them exactly as they were."""
    m_new = tl.maximum(M, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(M - m_safe)
    c = tl.exp(m - m_safe)
    return m_new, L * a + l_sum * c, ACC * a[:, None] + acc * c[:, None]


@triton.jit
def _tile_kernel(Q, Pool, Tables, Seq, Ctx, Out, Mp, Lp, Ap, scale,
                 s_qr, s_qh, s_kv, s_blk, s_tok, s_kh, s_tb, s_or, n_rows, H,
                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                 TILE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_GRID: tl.constexpr):
    """Program (tile r, KV head h[, split c]). Q: [R * TILE, H, D]; Seq: [R]; Ctx: [R, TILE] (position + 1);
    Out: [R * TILE, H * D] (SPLIT_GRID: partials Mp, Lp: [splits, R * TILE, H], Ap: [splits, R * TILE, H, DP])."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    ROWS: tl.constexpr = TILE * GP
    ri = tl.arange(0, ROWS)
    t = ri // GP  # position in the tile
    g = ri % GP  # query head in the group
    row_ok = g < G
    qrow = r * TILE + t
    qhead = h * G + g
    pos = tl.load(Ctx + qrow) - 1  # [ROWS]
    reach = tl.max(pos, 0) + 1  # keys the tile's longest row sees
    b = tl.load(Seq + r)
    dd = tl.arange(0, DP)
    d_ok = dd < D
    io = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + qrow[:, None] * s_qr + qhead[:, None] * s_qh + dd[None, :], mask=io, other=0.0)
    q = q.to(tl.float32) * scale
    if SPLIT_GRID:
        c = tl.program_id(2)
        lo = c * SPLIT
        m, l_sum, acc = _split(q, pos, Pool, Tables, b, h, lo, tl.minimum(lo + SPLIT, reach), s_kv, s_blk, s_tok,
                               s_kh, s_tb, BS, DP, D, ROWS, BLOCK_N)
        part = (c * n_rows + qrow) * H + qhead  # [ROWS]
        tl.store(Mp + part, m, mask=row_ok)
        tl.store(Lp + part, l_sum, mask=row_ok)
        tl.store(Ap + part[:, None] * DP + dd[None, :], acc, mask=row_ok[:, None])
    else:
        M = tl.full([ROWS], float("-inf"), tl.float32)
        L = tl.zeros([ROWS], tl.float32)
        ACC = tl.zeros([ROWS, DP], tl.float32)
        for lo in range(0, reach, SPLIT):
            m, l_sum, acc = _split(q, pos, Pool, Tables, b, h, lo, tl.minimum(lo + SPLIT, reach), s_kv, s_blk,
                                   s_tok, s_kh, s_tb, BS, DP, D, ROWS, BLOCK_N)
            M, L, ACC = _merge(M, L, ACC, m, l_sum, acc)
        o = ACC / tl.where(L == 0, 1.0, L)[:, None]  # L = 0: a padding head of the group (not stored)
        tl.store(Out + qrow[:, None] * s_or + qhead[:, None] * D + dd[None, :], o.to(Out.dtype.element_ty), mask=io)


@triton.jit
def _merge_kernel(Ctx, Out, Mp, Lp, Ap, s_or, n_rows, H,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, TILE: tl.constexpr,
                  SPLIT: tl.constexpr):
    """Program (tile r, KV head h): the split partials of its rows merged in split order (as ``_tile_kernel``'s
    loop does) -> Out."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    ROWS: tl.constexpr = TILE * GP
    ri = tl.arange(0, ROWS)
    t = ri // GP
    g = ri % GP
    row_ok = g < G
    qrow = r * TILE + t
    qhead = h * G + g
    pos = tl.load(Ctx + qrow) - 1
    reach = tl.max(pos, 0) + 1
    dd = tl.arange(0, DP)
    d_ok = dd < D
    M = tl.full([ROWS], float("-inf"), tl.float32)
    L = tl.zeros([ROWS], tl.float32)
    ACC = tl.zeros([ROWS, DP], tl.float32)
    for lo in range(0, reach, SPLIT):
        c = lo // SPLIT
        part = (c * n_rows + qrow) * H + qhead
        ok = row_ok & (lo <= pos)  # a split past the row's position: what _split returns for it
        m = tl.load(Mp + part, mask=ok, other=float("-inf"))
        l_sum = tl.load(Lp + part, mask=ok, other=0.0)
        acc = tl.load(Ap + part[:, None] * DP + dd[None, :], mask=ok[:, None], other=0.0)
        M, L, ACC = _merge(M, L, ACC, m, l_sum, acc)
    o = ACC / tl.where(L == 0, 1.0, L)[:, None]  # L = 0: a padding head of the group (not stored)
    io = row_ok[:, None] & d_ok[None, :]
    tl.store(Out + qrow[:, None] * s_or + qhead[:, None] * D + dd[None, :], o.to(Out.dtype.element_ty), mask=io)


def tiles(qt: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor, ctx: torch.Tensor,
          scale: float, split: int, split_grid: bool) -> torch.Tensor:
    """``attention._tiles`` in Triton. qt: [R * TILE, H, D]; pool: [2, NB + 1, bs, Hkv, D]; tables: [B, M];
    seq: [R]; ctx: [R, TILE] (position + 1; 1 for an empty row); split: keys per split (a multiple of BLOCK_N);
    split_grid: one program per split the table width holds, merged by a second kernel (decode: few tiles, long
    contexts; the same bits as one program per tile) -> [R * TILE, H * D] in qt's dtype. Nothing here reads a
    tensor's values on the host: the launches depend only on the shapes (what a captured CUDA graph needs)."""
    R, TILE = ctx.shape
    H, D = qt.shape[1:]
    bs, Hkv = pool.shape[2], pool.shape[3]
    G = H // Hkv
    assert split % BLOCK_N == 0 and pool.is_contiguous() and tables.is_contiguous() and ctx.is_contiguous()
    qt = qt.contiguous()
    GP = max(triton.next_power_of_2(G), triton.next_power_of_2(-(-16 // TILE)))  # rows TILE * GP >= 16
    DP = max(16, triton.next_power_of_2(D))
    n_rows = R * TILE
    out = torch.empty(n_rows, H * D, dtype=qt.dtype, device=qt.device)
    strides = (qt.stride(0), qt.stride(1), pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
               tables.stride(0), out.stride(0), n_rows, H)
    dims = dict(G=G, GP=GP, D=D, DP=DP, BS=bs, TILE=TILE, SPLIT=split, BLOCK_N=BLOCK_N)
    splits = -(-tables.shape[1] * bs // split)  # a program past its tile's context loops over nothing
    if split_grid and splits > 1:
        f32 = dict(dtype=torch.float32, device=qt.device)
        mp, lp = torch.empty(splits, n_rows, H, **f32), torch.empty(splits, n_rows, H, **f32)
        ap = torch.empty(splits, n_rows, H, DP, **f32)
        _tile_kernel[(R, Hkv, splits)](qt, pool, tables, seq, ctx, out, mp, lp, ap, scale, *strides, **dims,
                                       SPLIT_GRID=True)
        _merge_kernel[(R, Hkv)](ctx, out, mp, lp, ap, out.stride(0), n_rows, H, G=G, GP=GP, D=D, DP=DP, TILE=TILE,
                                SPLIT=split)
    else:
        _tile_kernel[(R, Hkv)](qt, pool, tables, seq, ctx, out, out, out, out, scale, *strides, **dims,
                               SPLIT_GRID=False)
    return out
