"""The C decode kernel's instruction-set paths (portable, AVX2 + FMA, AVX-512) all match gather +
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
    cpu_kernel.set_isa(lib, "avx512")


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
                                   (4, 16, 2, 64, 16), (3, 7, 1, 64, 16), (3, 6, 3, 32, 16)])
def test_every_isa_path_matches_gather_sdpa(capped, level, dtype, shape):
    # D = 24: AVX2 but not AVX512 vectors; D = 12: portable only. The AVX-512 PV pass groups query heads by
    # their KV head: 8 (G = 8), 4 (G = 4), 2 (G = 6, D = 64), 1 x 4 column chunks (G = 7, D = 64), 1 (G = 2, D = 32)
    B, H, Hkv, D, bs = shape
    capped(level)
    taken = cpu_kernel.isa(lib, dtype, D)
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
    assert cpu_kernel.isa(lib, torch.float32) == best
    assert cpu_kernel.isa(lib, torch.float32, 24) == ("avx2" if has_avx2 else "portable")  # 24 % 16 != 0
    capped("portable")
    assert cpu_kernel.isa(lib, torch.float32) == cpu_kernel.isa(lib, torch.bfloat16) == "portable"
