"""Attention over the paged KV pool.

Pool layout per layer: ``kv[layer]``: [2, num_blocks + 1, block_size, Hkv, D]; the extra last block is
a trash block that padding tokens write to, so padding never touches a live block. Block tables are
padded with the trash block id and masked out by length.

Paths (measured numbers in docs/NATIVE_ENGINE.md):
- prefill, padded: the prompt's own K/V are attended directly with causal SDPA (right padding: a real query
  only sees earlier, real keys), then scattered into the pool; only used when every prompt of the step
  starts at position 0 (no prefix-cache hit, no earlier chunk).
- prefill, packed (varlen): prompts back to back in one row, one causal SDPA per prompt: no padding
  compute at all (the default on CPU, where padding costs FLOPs linearly). A chunk that starts after
  cached K/V (an earlier chunk, or blocks from the prefix cache) attends to them through the pool; every
  chunk's K/V is written before any attention of the layer, so sequences of one step may share blocks.
- decode, ``kernel`` (CPU default): the C kernel of cpu_kernel.py reads K/V in place through the
  block table (no copy), one pass over K and one over V.
- ``paged_attention`` (the torch path: ``--no-native-kernel``, CUDA; decode and, for batch invariance,
  every prompt token of a prefill too): tiles of TILE consecutive positions of one sequence, K/V gathered
  from the pool in fixed splits of SPLIT tokens; every matmul has a fixed per-item shape (below).
- ``decode_attention_gather``: index_select the sequence's blocks into a dense [B, Hkv, T, D] view and run
  SDPA with a length mask (the reference the C kernel is tested against; no longer an engine path).
- ``paged_attention`` on CUDA (where Triton is importable: triton_support.py): the same tiles and fixed splits in
  Triton kernels that read K/V in place through the block table (triton_attention.py); the torch code below is
  its reference and its fallback.
- decode on NPU: torch_npu's paged attention (``npu_incre_flash_attention`` with a block table),
  chosen at runtime; untested (no NPU available here).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchfleet.worker.engine.native import triton_support

# Positions per query tile, and keys per split of the torch paged attention. Fixed (not per batch) so that
# every bmm item has one shape whatever the step holds: [TILE * G, D] x [D, SPLIT] and [TILE * G, SPLIT] x
# [SPLIT, D] (G query heads per KV head). torch's CPU matmul gives a row other bits when the number of rows
# changes (MKL fp32 at 1, 4, 5, 7, ... rows), but a bmm item the same bits at any item count (measured).
# Sizes measured on CPU (bench shapes, 8 x 400-token prefill and 32 x 300 decode): tile 8 with splits of 16-32
# fastest (4: more K/V copies; 16: 2x the decode waste; splits of 64+: slower bmm items). On other devices a
# split of 256 keys: every split is a few kernel launches per layer.
TILE = 8
SPLIT = 32
SPLIT_DEVICE = 256
GROUP = 64  # tiles per pass (memory: scores [GROUP * Hkv, TILE * G, context] fp32)


def write_kv(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """pool: [2, NB + 1, bs, Hkv, D]; slots: [N] flat slot ids; k, v: [N, Hkv, D]."""
    flat = pool.view(2, -1, *pool.shape[-2:])  # [2, (NB + 1) * bs, Hkv, D]
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, S, H, D], k/v: [B, S, Hkv, D] right-padded prompts -> [B, S, H * D]."""
    B, S, H, D = q.shape
    gqa = k.shape[2] != H
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale, enable_gqa=gqa)  # [B, H, S, D]
    return o.transpose(1, 2).reshape(B, S, H * D)


def packed_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                             scale: float, pool: torch.Tensor | None = None,
                             prefixes: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Varlen prefill: q: [1, N, H, D], k/v: [1, N, Hkv, D] holding the chunks back to back
    (lengths ``lens``, sum N) -> [1, N, H * D]. A chunk without a prefix attends causally to itself;
    a chunk whose ``prefixes[j]`` holds the pool slots of its positions [0, start + n) (chunked prefill:
    its K/V already written to ``pool``: [2, NB + 1, bs, Hkv, D]) attends to all of them, causally."""
    _, N, H, D = q.shape
    gqa = k.shape[2] != H
    qt, kt, vt = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [heads, N, D]
    outs, start = [], 0
    for j, n in enumerate(lens):
        end = start + n
        slots = prefixes[j] if prefixes is not None else None
        if slots is None:
            o = F.scaled_dot_product_attention(qt[None, :, start:end], kt[None, :, start:end],
                                               vt[None, :, start:end], is_causal=True, scale=scale,
                                               enable_gqa=gqa)  # [1, H, n, D]
        else:
            assert pool is not None
            flat = pool.view(2, -1, *pool.shape[-2:])  # [2, slots, Hkv, D]
            T = slots.numel()  # prefix + chunk
            kp = flat[0].index_select(0, slots).transpose(0, 1)[None]  # [1, Hkv, T, D]
            vp = flat[1].index_select(0, slots).transpose(0, 1)[None]
            # query i sits at position T - n + i and sees keys 0 .. T - n + i
            mask = torch.ones(n, T, dtype=torch.bool, device=q.device).tril(T - n)
            o = F.scaled_dot_product_attention(qt[None, :, start:end], kp, vp, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)  # [1, H, n, D]
        outs.append(o[0].transpose(0, 1))  # [n, H, D]
        start = end
    return torch.cat(outs).view(1, N, H * D)


def decode_mask(ctx_lens: torch.Tensor, num_slots: int) -> torch.Tensor:
    """ctx_lens: [B] tokens in cache incl. the current one -> bool [B, 1, 1, T], True = attend."""
    pos = torch.arange(num_slots, device=ctx_lens.device)
    return (pos[None, :] < ctx_lens[:, None])[:, None, None, :]


def decode_attention_gather(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                            mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D]; pool: [2, NB + 1, bs, Hkv, D]; block_tables: [B, M] -> [B, H * D]."""
    B, H, D = q.shape
    bs, Hkv = pool.shape[2], pool.shape[3]
    M = block_tables.shape[1]
    idx = block_tables.reshape(-1)
    # k, v: [B, Hkv, M * bs, D] (strided views of one gathered copy each)
    k = pool[0].index_select(0, idx).view(B, M * bs, Hkv, D).transpose(1, 2)
    v = pool[1].index_select(0, idx).view(B, M * bs, Hkv, D).transpose(1, 2)
    qg = q.view(B, Hkv, H // Hkv, D)  # one KV group's query heads along the query axis
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G, D]
    return o.reshape(B, H * D)


def decode_attention_npu(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                         ctx_lens: list[int], scale: float) -> torch.Tensor:  # pragma: no cover
    """torch_npu paged decode attention (untested: no NPU here). q: [B, H, D] -> [B, H * D]."""
    import torch_npu

    B, H, D = q.shape
    nb1, bs, Hkv = pool.shape[1], pool.shape[2], pool.shape[3]
    k = pool[0].view(nb1, bs, Hkv * D)  # BSH layout expected by the op
    v = pool[1].view(nb1, bs, Hkv * D)
    o = torch_npu.npu_incre_flash_attention(
        q.view(B, 1, H * D), k, v, num_heads=H, num_key_value_heads=Hkv, scale_value=scale,
        input_layout="BSH", block_table=block_tables.to(torch.int32), block_size=bs,
        actual_seq_lengths=ctx_lens,
    )
    return o.view(B, H * D)


@dataclass
class TileLayout:
    """Where the queries of one step sit in tiles of TILE consecutive positions of one sequence.

    idx: [N] flat row (tile * TILE + position % TILE) of each query; tables: [B, M] the sequences' block
    tables (trash-padded); seq: [R] each tile's sequence; ctx: [R, TILE] keys each row sees (its position + 1;
    1 for an empty row); reach: the largest ctx of each tile, tiles ordered by it, longest first (so the tiles
    that reach a split are a prefix: later splits run on fewer items)."""

    idx: torch.Tensor
    tables: torch.Tensor
    seq: torch.Tensor
    ctx: torch.Tensor
    reach: list[int]

    def to(self, device: torch.device) -> TileLayout:
        return TileLayout(self.idx.to(device), self.tables.to(device), self.seq.to(device), self.ctx.to(device),
                          self.reach)


def tile_layout(block_tables: list[list[int]], starts: list[int], lens: list[int], trash: int,
                width: int | None = None) -> TileLayout:
    """Queries at positions [starts[b], starts[b] + lens[b]) of sequence b (block table ``block_tables[b]``),
    in that order; ``width``: the tables' width (default: the longest table)."""
    width = width or max(len(t) for t in block_tables)
    first = torch.tensor([a // TILE for a in starts])
    counts = torch.tensor([(a + n - 1) // TILE - a // TILE + 1 for a, n in zip(starts, lens)])
    base = counts.cumsum(0) - counts  # first tile of each sequence
    pos = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens)])  # [N]
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # [N]
    tile = base[seq] + pos // TILE - first[seq]  # [N]
    R = int(counts.sum())
    ctx = torch.ones(R, TILE, dtype=torch.long)
    ctx[tile, pos % TILE] = pos + 1
    reach, order = ctx.amax(1).sort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(R)
    tables = torch.tensor([t + [trash] * (width - len(t)) for t in block_tables])  # [B, width]
    tile_seq = torch.repeat_interleave(torch.arange(len(lens)), counts)  # [R] before the sort
    return TileLayout(rank[tile] * TILE + pos % TILE, tables, tile_seq[order], ctx[order], reach.tolist())


def paged_attention(q: torch.Tensor, pool: torch.Tensor, layout: TileLayout, scale: float) -> torch.Tensor:
    """Batch-invariant attention over the paged pool, in torch. q: [N, H, D] (queries placed by ``layout``);
    pool: [2, NB + 1, bs, Hkv, D] -> [N, H * D] in q's dtype.

    A query's bits depend only on its q and the cached K/V of its positions 0..p, never on the step: the
    same function for a prefill's tokens and a decode step's; K/V read from the pool (the stored dtype) and
    computed in fp32; scores per split of SPLIT keys at absolute positions (bmm items of one shape); one
    softmax over the row, where keys past the row's context are -inf (exp 0: a wider table, or a split
    another row of the tile reaches, adds exact zeros to the row's SIMD lanes); P @ V split by split, summed in
    split order (a split past the row's context adds 0, so skipping it for a tile that does not reach it
    changes nothing). At most GROUP tiles per pass bound the memory (an item's bits do not depend on the
    item count)."""
    N, H, D = q.shape
    R = layout.ctx.shape[0]
    qt = q.new_zeros(R * TILE, H, D)
    qt[layout.idx] = q
    if triton_support.runs_on(q.device):
        from batchfleet.worker.engine.native import triton_attention  # imports triton: only where it runs

        # one tile per sequence (decode): a program per split, so a short batch of long contexts fills the GPU
        return triton_attention.tiles(qt, pool, layout.tables, layout.seq, layout.ctx, scale, SPLIT_DEVICE,
                                      split_grid=R <= layout.tables.shape[0])[layout.idx]
    out = torch.empty(R * TILE, H * D, dtype=torch.float32, device=q.device)
    for a in range(0, R, GROUP):
        b = min(a + GROUP, R)
        out[a * TILE:b * TILE] = _tiles(qt[a * TILE:b * TILE], pool, layout.tables, layout.seq[a:b],
                                        layout.ctx[a:b], layout.reach[a:b], scale)
    return out[layout.idx].to(q.dtype)


def _tiles(qt: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor, ctx: torch.Tensor,
           reach: list[int], scale: float) -> torch.Tensor:
    """qt: [R * TILE, H, D]; tables: [B, M]; seq: [R]; ctx: [R, TILE]; reach: [R] descending
    -> [R * TILE, H * D] fp32."""
    H, D = qt.shape[1:]
    bs, Hkv, G = pool.shape[2], pool.shape[3], H // pool.shape[3]
    R, B = seq.shape[0], tables.shape[0]
    per = max(1, (SPLIT if qt.device.type == "cpu" else SPLIT_DEVICE) // bs)  # blocks per split
    S = per * bs
    splits = -(-reach[0] // S)  # the splits the longest tile reaches
    tables = F.pad(tables, (0, max(0, splits * per - tables.shape[1])), value=pool.shape[1] - 1)
    # [R * Hkv, TILE * G, D]: one item per (tile, KV head), rows (position in tile, query head of the group)
    qe = (qt.float() * scale).view(R, TILE, Hkv, G, D).transpose(1, 2).reshape(R * Hkv, TILE * G, D)
    items = (seq[:, None] * Hkv + torch.arange(Hkv, device=qt.device)).view(-1)  # [R * Hkv] rows of [B * Hkv]
    neg = [-r for r in reach]
    n = [bisect_left(neg, -c * S) * Hkv for c in range(splits)]  # items reaching split c (reach > c S): a prefix
    direct = tables[seq] if R <= B else None  # one tile per sequence (decode): gather in tile order

    def f32(blocks: torch.Tensor) -> torch.Tensor:  # [r * per, bs, Hkv, D] -> [r * Hkv, S, D] fp32, one copy
        r = blocks.shape[0] // per
        out = torch.empty(r, Hkv, S, D, dtype=torch.float32, device=blocks.device)
        return out.copy_(blocks.view(r, S, Hkv, D).transpose(1, 2)).view(r * Hkv, S, D)

    def kv(which: int, c: int) -> torch.Tensor:  # split c of the first n[c] items: [n[c], S, D] fp32
        if direct is not None:
            return f32(pool[which].index_select(0, direct[:n[c] // Hkv, c * per:(c + 1) * per].reshape(-1)))
        return f32(pool[which].index_select(0, tables[:, c * per:(c + 1) * per].reshape(-1))).index_select(
            0, items[:n[c]])

    scores = qe.new_full((R * Hkv, TILE * G, splits * S), float("-inf"))
    for c in range(splits):
        scores[:n[c], :, c * S:(c + 1) * S] = torch.bmm(qe[:n[c]], kv(0, c).transpose(1, 2))
    hidden = torch.arange(splits * S, device=qt.device) >= ctx[:, :, None]  # [R, TILE, T]
    scores.view(R, Hkv, TILE, G, -1).masked_fill_(hidden[:, None, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.bmm(p[:, :, :S], kv(1, 0)) if n[0] == R * Hkv else None
    assert out is not None  # every tile reaches split 0 (ctx >= 1)
    for c in range(1, splits):
        out[:n[c]] += torch.bmm(p[:n[c], :, c * S:(c + 1) * S], kv(1, c))
    return out.view(R, Hkv, TILE, G, D).transpose(1, 2).reshape(R * TILE, H * D)
