"""A CPU decode step's small ops in C (decode_ops.c): the fused RoPE + KV write is bit-identical to the
torch ops it replaces (NativeModel.rope, then attention.write_kv), in fp32 and bf16, MHA and GQA; RMSNorm
and SiLU * up are within ~1 ulp of theirs; the engine uses them and its greedy output does not change."""

from __future__ import annotations

import types

import pytest
import torch

from batchfleet.worker.engine.native import attention as A
from batchfleet.worker.engine.native import cpu_kernel, small_ops
from batchfleet.worker.engine.native.model import NativeModel

ops = small_ops.load_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="no C compiler")


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 4, 4, 64), (9, 8, 2, 32), (3, 6, 1, 128), (33, 4, 4, 8)])
def test_rope_kv_is_bit_identical_to_rope_then_write_kv(dtype, shape):
    B, H, Hkv, D = shape
    g = torch.Generator().manual_seed(B * 100 + D)
    P, bs, nb = 64, 4, 20
    # tables as NativeModel builds them: cos / sin with rotate-half's sign folded into its first half
    ang = torch.rand(P, D // 2, generator=g) * 40
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype).contiguous()
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    sin_rot = torch.cat((-sin[:, : D // 2], sin[:, D // 2 :]), -1).contiguous()
    qkv = (torch.randn(B, 1, (H + 2 * Hkv) * D, generator=g) * 3).to(dtype)
    pos = torch.randint(0, P, (B,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:B]
    pool_ref = torch.randn(2, nb, bs, Hkv, D, generator=g).to(dtype)
    pool = pool_ref.clone()

    model = types.SimpleNamespace(fused=None)  # NativeModel.rope reads only whether the CUDA kernels are in use
    view = qkv.view(B, 1, H + 2 * Hkv, D)
    qk = NativeModel.rope(model, view[:, :, : H + Hkv], cos[pos].view(B, 1, 1, D), sin_rot[pos].view(B, 1, 1, D))
    A.write_kv(pool_ref, slots, qk[:, 0, H:], view[:, 0, H + Hkv :])

    q = small_ops.rope_kv(ops, qkv, cos, sin_rot, pos, slots, pool, H)
    assert torch.equal(q, qk[:, 0, :H].contiguous())
    assert torch.equal(pool, pool_ref)  # the written slots, and nothing else touched


@needs_ops
def test_engine_decodes_through_the_c_ops_and_matches_the_torch_ops(tmp_path):
    from tests.helpers.native import build_model, make_engine, prompt, request, run_all

    model = build_model("qwen2", tmp_path)  # GQA, q/k/v biases
    fused, plain = make_engine(model), make_engine(model)
    plain.runner.ops = None  # RMSNorm, RoPE + KV write, SiLU * up as torch ops
    assert fused.runner.describe()["decode_small_ops"] == "C: rms_norm rope_kv silu_mul argmax"
    outs = []
    for engine in (fused, plain):
        reqs = [request(i, prompt(i, n), 12) for i, n in enumerate((6, 3, 37))]
        done = run_all(engine, [reqs])
        outs.append({k: c.token_ids for k, c in done.items()})
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0].values())


def _recording(step, logits: list):
    """``step`` (a runner's _prefill or _decode) that also keeps a copy of each step's logits."""
    def run(batch):
        logits.append(step(batch).clone())
        return logits[-1]
    return run


@needs_ops
def test_reused_step_buffers_give_every_step_the_bits_of_fresh_tensors(tmp_path, monkeypatch):
    # StepOps' outputs, RopeKV's q and the kernel's out are overwritten layer after layer: the forward must consume
    # each before the op runs again. Every prefill's and decode step's logits against a run with fresh tensors.
    from tests.helpers.native import build_model, make_engine, prompt, request, run_all

    model = build_model("qwen2", tmp_path)
    rope, decode = small_ops.RopeKV.__call__, cpu_kernel.paged_decode
    runs = []
    for fresh in (False, True):
        with monkeypatch.context() as mp:
            if fresh:
                mp.setattr(small_ops.StepOps, "_out", lambda self, key, like, shape: like.new_empty(shape))
                mp.setattr(small_ops.RopeKV, "__call__", lambda self, qkv, pool: rope(self, qkv, pool).clone())
                mp.setattr(cpu_kernel, "paged_decode", lambda *args: decode(*args[:7]))  # no out: a fresh one
            engine, logits = make_engine(model), []
            for name in ("_prefill", "_decode"):
                mp.setattr(engine.runner, name, _recording(getattr(engine.runner, name), logits))
            run_all(engine, [[request(i, prompt(i, n), 8) for i, n in enumerate((6, 3, 37, 20))]])
            runs.append(logits)
    assert len(runs[0]) == len(runs[1]) > 8 and all(torch.equal(a, b) for a, b in zip(*runs))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 1, 768), (3, 1, 20), (1, 1, 4096)])
def test_rms_norm_matches_the_torch_ops(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 5).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    model = types.SimpleNamespace(eps=1e-6, fused=None)
    ref = NativeModel.rms_norm(model, x, w)
    out = small_ops.rms_norm(ops, x, w, 1e-6)
    # the sum of squares in another order: ~1 ulp of fp32 in the scale, at most one bf16 rounding step
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(out, ref, **tol)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_torch_ops(dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(32, 1, 2 * 2048, generator=g) * 6).to(dtype)
    gate_up[0, 0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -90.0])  # range ends and zeros
    model = types.SimpleNamespace(act=torch.nn.functional.silu, hidden_act="silu", fused=None)
    ref = NativeModel.act_mul(model, gate_up)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(small_ops.silu_mul(ops, gate_up), ref, **tol)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_ops_write_one_buffer_per_shape_with_the_bits_of_fresh_calls(dtype):
    g = torch.Generator().manual_seed(2)
    step = small_ops.StepOps(ops, 1e-6, num_threads=2)
    w = torch.randn(64, generator=g).to(dtype)
    xs = [torch.randn(8, 1, 64, generator=g).to(dtype) for _ in range(3)] + [torch.randn(8, 64, generator=g).to(dtype)]
    outs = [step.norm(x, w) for x in xs]
    assert outs[0] is outs[1] is outs[2] and outs[3] is not outs[0]  # per input shape: [B, 1, n] and [B, n]
    assert torch.equal(outs[2], small_ops.rms_norm(ops, xs[2], w, 1e-6, num_threads=1))  # the last call's
    assert torch.equal(outs[3], small_ops.rms_norm(ops, xs[3], w, 1e-6))
    gate_up = torch.randn(8, 1, 128, generator=g).to(dtype)
    a, b = step.act_mul(gate_up), step.act_mul(gate_up * 2)
    assert a is b and torch.equal(b, small_ops.silu_mul(ops, gate_up * 2))
    with pytest.raises(ValueError):
        step.norm(xs[0], w[:32])  # the weight's length differs from the rows'


@needs_ops
def test_out_of_range_position_or_slot_raises_and_writes_nothing():
    dtype, B, H, Hkv, D = torch.float32, 2, 2, 1, 8
    cos = sin = torch.ones(4, D)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D)
    pool = torch.zeros(2, 3, 2, Hkv, D, dtype=dtype)  # 6 slots
    for pos, slots in (([0, 4], [0, 1]), ([0, -1], [0, 1]), ([0, 1], [0, 6])):
        with pytest.raises(ValueError, match="out of range"):
            small_ops.rope_kv(ops, qkv, cos, sin, torch.tensor(pos), torch.tensor(slots), pool, H)
    flat = pool.view(2, 6, Hkv, D)
    assert torch.equal(flat[:, 1:], torch.zeros_like(flat[:, 1:]))  # only slot 0 (the valid rows') written
    with pytest.raises(ValueError):
        small_ops.rms_norm(ops, torch.randn(2, D).bfloat16(), torch.ones(D), 1e-6)  # weight dtype differs
    with pytest.raises(ValueError):
        small_ops.silu_mul(ops, torch.randn(2, 7))  # odd: not a gate/up pair


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax_exactly(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 1000, generator=g).to(dtype)
    nan, inf = float("nan"), float("inf")
    x[1, 5] = x[1, 700] = 50.0  # a tie: the first wins
    x[2, 600], x[2, 999] = nan, nan  # NaN counts as the maximum, the first one
    x[3] = -inf  # all -inf: index 0
    x[4, 999] = inf  # the very last
    x[5, 0] = 99.0  # the very first
    x[6, 3], x[6, 4] = -0.0, 0.0  # equal zeros as the maximum: the first
    x[6, 5:] = -1.0
    x[6, :3] = -1.0
    x[9, 0] = nan  # a NaN first
    x[10, 13] = nan  # a NaN inside the first SIMD chunk, after the maximum
    x[10, 2] = 80.0
    short = torch.randn(3, 17, generator=g).to(dtype)  # fewer than two 16-wide chunks
    for t in (x, short, x[:, :15]):
        assert torch.equal(small_ops.argmax(ops, t), t.argmax(dim=-1))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops_give_the_same_bits_on_any_thread_count(dtype):
    # sizes above the threading threshold (decode_ops.c PAR_MIN): rows (or row chunks) split across threads
    g = torch.Generator().manual_seed(7)
    x, w = (torch.randn(40, 1, 768, generator=g) * 4).to(dtype), torch.randn(768, generator=g).to(dtype)
    gate_up = (torch.randn(40, 1, 2 * 2050, generator=g) * 6).to(dtype)  # n not a multiple of the chunk
    logits = torch.randn(40, 3001, generator=g).to(dtype)
    logits[17, 2999] = 99.0
    B, H, Hkv, D, P = 40, 4, 2, 64, 64
    cos, sin = torch.randn(P, D, generator=g).to(dtype), torch.randn(P, D, generator=g).to(dtype)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D, generator=g).to(dtype)
    pos, slots = torch.randint(0, P, (B,), generator=g), torch.randperm(200, generator=g)[:B]
    outs = []
    for threads in (1, 2, 3):
        pool = torch.zeros(2, 50, 4, Hkv, D, dtype=dtype)
        q = small_ops.rope_kv(ops, qkv, cos, sin, pos, slots, pool, H, num_threads=threads)
        outs.append((small_ops.rms_norm(ops, x, w, 1e-6, num_threads=threads),
                     small_ops.silu_mul(ops, gate_up, num_threads=threads),
                     small_ops.argmax(ops, logits, num_threads=threads), q, pool))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    assert torch.equal(outs[0][2], logits.argmax(dim=-1))


@needs_ops
def test_rows_sharing_a_slot_write_in_row_order_and_bad_thread_counts_raise():
    # padding rows of a static-shape decode step all write the trash slot: the last row's write wins, as
    # on one thread, whatever the thread count (such a step runs its RoPE + KV write on one thread)
    B, H, Hkv, D = 12, 2, 1, 8
    cos, sin = torch.ones(4, D), torch.zeros(4, D)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D)
    slots = torch.tensor([0, 1, 2, 3] + [5] * (B - 4))  # rows 4.. share slot 5
    pool = torch.zeros(2, 3, 2, Hkv, D)
    small_ops.rope_kv(ops, qkv, cos, sin, torch.zeros(B, dtype=torch.int64), slots, pool, H, num_threads=2)
    last = qkv.view(B, H + 2 * Hkv, D)[-1]
    assert torch.equal(pool.view(2, 6, Hkv, D)[0, 5, 0], last[H]) and torch.equal(pool.view(2, 6, Hkv, D)[1, 5, 0],
                                                                                last[H + Hkv])
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_threads"):
            small_ops.silu_mul(ops, torch.randn(2, 8), num_threads=bad)
