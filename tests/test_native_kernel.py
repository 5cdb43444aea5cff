"""The C paged-decode kernel against gather + SDPA (fp32 and bf16, MHA and GQA), and the fallback."""

from __future__ import annotations

import pytest
import torch

from batchfleet.worker.engine.native import attention as A
from batchfleet.worker.engine.native import cpu_kernel

needs_kernel = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler")


def case(B, H, Hkv, D, bs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 70, (B,), generator=g)
    M = int((ctx.max() + bs - 1) // bs)
    nb = B * M + 3
    pool = torch.randn(2, nb + 1, bs, Hkv, D, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: B * M].view(B, M).contiguous()
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, pool, tables, ctx


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 4, 16, 16), (9, 8, 2, 32, 4), (5, 6, 1, 64, 16), (33, 4, 4, 8, 8)])
def test_kernel_matches_gather_sdpa(dtype, shape):
    B, H, Hkv, D, bs = shape
    q, pool, tables, ctx = case(B, H, Hkv, D, bs, dtype)
    scale = D**-0.5
    ref = A.decode_attention_gather(q.float(), pool.float(), tables, A.decode_mask(ctx, tables.shape[1] * bs), scale)
    for threads in (1, 2):
        out = cpu_kernel.paged_decode(cpu_kernel.load(), q, pool, tables, ctx, scale, threads)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float().view(B, -1), ref, atol=tol, rtol=tol)


@needs_kernel
def test_kernel_writes_into_a_given_out_buffer_and_refuses_one_it_cannot_use():
    q, pool, tables, ctx = case(5, 4, 2, 32, 8, torch.bfloat16)
    lib = cpu_kernel.load()
    out = torch.full_like(q, float("nan"))
    assert cpu_kernel.paged_decode(lib, q, pool, tables, ctx, 0.125, 2, out) is out
    assert torch.equal(out, cpu_kernel.paged_decode(lib, q, pool, tables, ctx, 0.125, 2))
    for bad in (q, torch.empty(5, 4, 16, dtype=q.dtype), torch.empty_like(q, dtype=torch.float32),
                torch.empty(5, 32, 4, dtype=q.dtype).transpose(1, 2)):
        with pytest.raises(ValueError, match="out"):  # q itself: the kernel would read what it writes
            cpu_kernel.paged_decode(lib, q, pool, tables, ctx, 0.125, 2, bad)


def test_runner_falls_back_to_gather_without_kernel(monkeypatch, tmp_path):
    from tests.helpers.native import build_model, make_engine

    monkeypatch.setattr(cpu_kernel, "load", lambda _dir: None)
    engine = make_engine(build_model("llama", tmp_path))
    assert engine.runner.decode_mode == "gather"
    with pytest.raises(ValueError):
        make_engine(build_model("llama", tmp_path), decode="kernel")


def test_unsupported_model_type_is_refused():
    from transformers import AutoModelForCausalLM, Qwen3Config

    from batchfleet.worker.engine.native.model import NativeModel

    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=50)
    with pytest.raises(NotImplementedError, match="qwen3"):
        NativeModel(AutoModelForCausalLM.from_config(cfg), 64)


@needs_kernel
def test_bf16_engine_runs_both_decode_paths(tmp_path):
    from batchfleet.worker.engine.models import load_model
    from tests.helpers.native import build_model, make_engine, prompt, request, run_all

    path = build_model("qwen2", tmp_path).path
    loaded = load_model(path, "cpu", "bfloat16")
    reqs = [request(i, prompt(i, 10 + 20 * i), 12) for i in range(4)]
    outs = []
    for decode, c_ops in (("kernel", False), ("gather", False), ("kernel", True)):
        engine = make_engine(loaded, decode=decode)
        if not c_ops:  # the attention paths alone differ: both with the torch small ops
            engine.runner.ops = None
        done = run_all(engine, [reqs])
        assert all(c.error is None and 1 <= len(c.token_ids) <= 12 for c in done.values())
        outs.append({k: v.token_ids for k, v in done.items()})
    same = sum(outs[0][k] == outs[1][k] for k in outs[0])
    assert same >= 2  # bf16 rounding may flip a near-tie, but not everywhere


@pytest.mark.parametrize(("cpuinfo", "bf16"), [
    ("vendor_id : GenuineIntel\nflags : avx512_bf16 amx_bf16 amx_tile", True),  # Sapphire Rapids and later
    ("vendor_id : GenuineIntel\nflags : avx512f avx512_bf16", False),  # no AMX: fp32 measured faster (issue 34)
    ("vendor_id : AuthenticAMD\nflags : avx512f avx512_bf16", True),  # Zen 4/5 (BENCHMARKS_HISTORY 7, 13c)
    ("vendor_id : AuthenticAMD\nflags : avx2 fma", False),  # Zen 3: no bf16 arithmetic (linear.WidenedLinear)
    ("", False),  # /proc/cpuinfo unreadable
])
def test_default_cpu_dtype_follows_what_was_measured_per_cpu_kind(cpuinfo, bf16):
    from batchfleet.worker.engine.models import cpu_prefers_bf16

    assert cpu_prefers_bf16(cpuinfo) is bf16
