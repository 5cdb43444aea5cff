"""The C decode kernel's instruction-set paths (portable, AVX2 + FMA, AVX-512, AMX) all match gather +
SDPA; the path is chosen at runtime and a path the CPU lacks is never taken (capped or not)."""

from __future__ import annotations

import pytest
import torch

from batchfleet.worker.engine.native import attention as A
from batchfleet.worker.engine.native import cpu_kernel

lib = cpu_kernel.load()
needs_kernel = pytest.mark.skipif(lib is None, reason="no C compiler")


@pytest.fixture
def capped():
    """Set the kernel's ISA cap for one test; restore the default (everything the CPU has) afterwards."""
    yield lambda level: cpu_kernel.set_isa(lib, level)
    cpu_kernel.set_isa(lib, cpu_kernel.TOP_LEVEL)


def _case(B, H, Hkv, D, bs, dtype):
    g = torch.Generator().manual_seed(B * 1000 + D)
    ctx = torch.randint(1, 90, (B,), generator=g)
    ctx[0] = 1  # a sequence of one token
    M = int((ctx.max() + bs - 1) // bs)
    nb = B * M + 3
    pool = torch.randn(2, nb + 1, bs, Hkv, D, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: B * M].view(B, M).contiguous()
    return torch.randn(B, H, D, generator=g).to(dtype), pool, tables, ctx


@needs_kernel
@pytest.mark.parametrize("level", list(cpu_kernel.ISA_LEVELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 4, 4, 64, 16), (9, 8, 2, 32, 4), (10, 6, 1, 24, 16), (5, 4, 2, 12, 8),
                                   (4, 16, 2, 64, 16), (3, 7, 1, 64, 16), (3, 6, 3, 32, 16), (4, 16, 2, 64, 5),
                                   (2, 8, 2, 128, 16)])
def test_every_isa_path_matches_gather_sdpa(capped, level, dtype, shape):
    # D = 24: AVX2 but not AVX512 vectors; D = 12: portable only. The AVX-512 fp32 PV pass groups query heads by
    # their KV head: 8 (G = 8), 4 (G = 4), 2 (G = 6, D = 64), 1 x 4 column chunks (G = 7, D = 64), 1 (G = 2, D = 32);
    # the bf16 one (token pairs) 8, 4, 2 (G = 6, G = 2) or 1 (G = 7, G = 1), odd contexts ending on a half pair;
    # its bf16 QK pass groups them where G % 4 == 0. AMX (bf16, G >= 4, D % 64 == 0): G = 8, 7 and 4 (D = 128), and
    # blocks of 5 tokens (tiles span blocks)
    B, H, Hkv, D, bs = shape
    capped(level)
    taken = cpu_kernel.isa(lib, dtype, D, H // Hkv)
    assert cpu_kernel.PATH_LEVELS[taken] <= cpu_kernel.ISA_LEVELS[level]
    if D % 8:
        assert taken == "portable"
    q, pool, tables, ctx = _case(B, H, Hkv, D, bs, dtype)
    ref = A.decode_attention_gather(q.float(), pool.float(), tables, A.decode_mask(ctx, tables.shape[1] * bs),
                                    D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for threads in (1, 2):  # B >= 4 x threads: whole sequences per work item, else head by head
        out = cpu_kernel.paged_decode(lib, q, pool, tables, ctx, D**-0.5, threads)
        torch.testing.assert_close(out.float().view(B, -1), ref, atol=tol, rtol=tol)


@needs_kernel
def test_isa_reported_is_what_this_cpu_has(capped):
    flags = open("/proc/cpuinfo").read()
    has_avx2 = " avx2" in flags and " fma" in flags
    best = "avx512" if " avx512f" in flags else "avx2" if has_avx2 else "portable"  # the build is -march=native
    assert cpu_kernel.isa(lib, torch.float32) == cpu_kernel.isa(lib, torch.float32, 64, 8) == best
    amx = " amx_bf16" in flags and " avx512_bf16" in flags and lib.paged_decode_init()
    assert (cpu_kernel.isa(lib, torch.bfloat16, 64, 8) == "amx") == bool(amx)
    assert cpu_kernel.isa(lib, torch.bfloat16, 64, 2) != "amx"  # 2-row tiles: AVX-512 is faster
    assert cpu_kernel.isa(lib, torch.float32, 24) == ("avx2" if has_avx2 else "portable")  # 24 % 16 != 0
    capped("portable")
    assert cpu_kernel.isa(lib, torch.float32) == cpu_kernel.isa(lib, torch.bfloat16) == "portable"


@needs_kernel
@pytest.mark.parametrize("level", list(cpu_kernel.ISA_LEVELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_path_gives_a_sequence_the_same_bits_in_any_batch(capped, level, dtype):
    # GQA 16/2 (the AMX path where it runs): each sequence alone on one thread (work items of one KV head) and
    # all ten together on two (items of whole sequences) give the same bits
    B, H, Hkv, D, bs = 10, 16, 2, 64, 16
    capped(level)
    q, pool, tables, ctx = _case(B, H, Hkv, D, bs, dtype)
    together = cpu_kernel.paged_decode(lib, q, pool, tables, ctx, D**-0.5, 2)
    for b in range(B):
        alone = cpu_kernel.paged_decode(lib, q[b:b + 1].contiguous(), pool, tables[b:b + 1].contiguous(),
                                        ctx[b:b + 1].contiguous(), D**-0.5, 1)
        assert torch.equal(alone[0], together[b]), f"sequence {b} ({int(ctx[b])} tokens)"


@needs_kernel
@pytest.mark.parametrize("level", list(cpu_kernel.ISA_LEVELS))
@pytest.mark.parametrize("shape", [(5, 8, 1, 64, 16), (4, 24, 2, 192, 5), (3, 16, 1, 256, 32), (5, 6, 2, 64, 16)])
def test_every_isa_path_ignores_what_lies_past_each_context(capped, level, shape):
    # slots past a sequence's context hold NaN (unwritten memory may), its table entries past the context point
    # far outside the pool (never read), and a context of 0 gives zeros: nothing past the context reaches the output
    B, H, Hkv, D, bs = shape
    capped(level)
    q, pool, tables, ctx = _case(B, H, Hkv, D, bs, torch.bfloat16)
    ctx[1] = 0
    ref = A.decode_attention_gather(q.float(), pool.float(), tables, A.decode_mask(ctx, tables.shape[1] * bs),
                                    D**-0.5).view(B, H, D)
    ref[1] = 0
    live = torch.zeros(pool.shape[1] * bs, dtype=torch.bool)
    for b in range(B):
        slots = tables[b][torch.arange(int(ctx[b])) // bs] * bs + torch.arange(int(ctx[b])) % bs
        live[slots] = True
        tables[b, (int(ctx[b]) + bs - 1) // bs:] = 1 << 40
    pool.view(2, -1, Hkv, D)[:, ~live] = float("nan")
    for threads in (1, 2):
        out = cpu_kernel.paged_decode(lib, q, pool, tables, ctx, D**-0.5, threads).float()
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
