"""Weight matmuls on the kernel chosen at load (worker/engine/native/linear.py): every choice computes
F.linear's result at every row count, falls back where oneDNN cannot run, shows in the engine's stats,
and keeps greedy output token-identical to transformers' generate (fp32)."""

from __future__ import annotations

from types import ModuleType

import pytest

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig

# linear.CHOICES, spelled out: collecting imports no torch (checked below)
CHOICES = ("auto", "fastest", "default", "onednn")


@pytest.fixture(scope="module")
def L() -> ModuleType:
    from batchfleet.worker.engine.native import linear

    return linear


def _weights(n_out=48, n_in=40, dtype=None, bias=True):
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_out, n_in, generator=g).to(dtype or torch.float32)
    return w, (torch.randn(n_out, generator=g).to(dtype or torch.float32) if bias else None)


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("bias", [True, False])
def test_every_choice_computes_f_linear_at_every_row_count(L, choice, bias):
    import torch
    import torch.nn.functional as F

    assert set(CHOICES) == set(L.CHOICES)
    w, b = _weights(bias=bias)
    lin = L.LinearFactory(choice)(w, b)
    with torch.inference_mode():
        for rows in (0, 1, 3, 17, 64, 300, 1500):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
            assert lin.kernel_for(rows) in L.KERNELS
        x3 = torch.randn(2, 5, 40)  # [B, S, in] as the forward calls it; and a strided row view
        torch.testing.assert_close(lin(x3), F.linear(x3, w, b), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin(x3[:, -1]), F.linear(x3[:, -1], w, b), atol=1e-5, rtol=1e-5)


def test_fastest_measures_each_shape_once_and_describes_it(L):
    make = L.LinearFactory("fastest")
    w, b = _weights()
    a, c = make(w, b), make(w.clone(), None)
    assert a.plan is c.plan or not L.onednn_available()
    desc = make.describe()
    assert list(desc) == ["40->48 float32"]
    if L.onednn_available():
        plan = make.plans[(48, 40, "float32")]
        assert set(plan.by_probe) <= set(L.PROBE_ROWS) and 1 in plan.by_probe
        assert all(set(g) == set(L.KERNELS) and min(g.values()) >= 0 for g in plan.gflops.values())
        assert desc["40->48 float32"].startswith("1:")
    else:
        assert desc["40->48 float32"] == "default"


def test_default_never_packs_and_bf16_runs_in_fp32_where_onednn_has_no_bf16_kernel(L):
    import torch
    import torch.nn.functional as F

    w, b = _weights()
    assert L.LinearFactory("default")(w, b).packed is None
    # bf16 prepacking needs AVX512 (bw/vl/dq) or AVX-NE-CONVERT: where it fails (AVX2-only x86) the layer
    # computes in fp32 on oneDNN (WidenedLinear) instead of torch's scalar bf16 fallback
    wb, bb = w.bfloat16(), b.bfloat16()
    lin = L.LinearFactory("onednn")(wb, bb)
    assert isinstance(lin, L.WidenedLinear) == (L.prepack(wb) is None and L.onednn_available())
    x = torch.randn(7, 40).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(lin(x).float(), F.linear(x, wb, bb).float(), atol=0.1, rtol=0.02)
    with pytest.raises(ValueError, match="linear kernel"):
        L.LinearFactory("quickest")


def test_a_widened_bf16_layer_is_a_bf16_gemm_with_fp32_sums_and_rows_independent_of_the_row_count(L):
    """WidenedLinear on any CPU oneDNN runs fp32 on: bf16 in and out, the sums of the exact fp32 products rounded
    to bf16 once (within one bf16 rounding of the float64 result), every row the bits it gets alone, and
    ``add_to`` as torch adds the rounded matmul to a bf16 residual."""
    import torch

    if not L.onednn_available():
        pytest.skip("this torch has no oneDNN linear ops")
    w, b = _weights(96, 200, torch.bfloat16)
    lin = L.WidenedLinear(w, b, L.prepack(w.float()))
    assert lin.kernel_for(5) == "onednn" and lin.bias32.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 200, generator=g).bfloat16()
    res = torch.randn(70, 96, generator=g).bfloat16()
    with torch.inference_mode():
        out = lin(x)
        exact = x.double() @ w.double().T + b.double()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=2 ** -8)
        assert torch.equal(torch.cat([lin(x[j:j + 1]) for j in range(70)]), out)
        assert L.invariant_block(lin) is None
        assert torch.equal(lin.add_to(x, res), res + out)


def test_plan_table_picks_the_nearest_probe_in_log_scale(L):
    plan = L.Plan({1: "default", 4: "onednn", 16: "onednn", 64: "default"})
    table = plan.table()
    assert [table[r.bit_length()] for r in (1, 2, 3, 5, 12, 20, 40, 100, 5000)] == [
        "default", "onednn", "onednn", "onednn", "onednn", "onednn", "default", "default", "default"]


@pytest.mark.parametrize("choice", ["onednn", "auto", "fastest"])
def test_prepacked_greedy_matches_transformers(L, tmp_path, choice):
    from batchfleet.worker.engine.native.engine import NativeEngine
    from tests.helpers.native import build_model, hf_greedy, prompt, request, run_all

    loaded = build_model("qwen2", tmp_path)  # GQA + qkv bias: every linear kind, with and without bias
    reqs = [request(i, prompt(200 + i, n), m) for i, (n, m) in enumerate([(5, 12), (30, 9), (70, 14), (120, 6)])]
    refs = {r.id: hf_greedy(loaded, r.prompt, r.params.max_new_tokens) for r in reqs}
    batching = DynamicBatchingConfig(max_batch_size=4, max_seq_len=256, buckets=(16, 32, 64, 128))
    engine = NativeEngine(loaded, batching, EngineConfig(engine="native", kv_cache_gb=0.01, linear=choice),
                          max_running=4)
    packed = [x.packed is not None for lw in engine.runner.model.layers for x in (lw.qkv_l, lw.o_l, lw.down_l)]
    if choice in ("onednn", "auto"):  # every layer prepacked wherever oneDNN exists (batch invariance)
        assert all(packed) == L.onednn_available()
    else:  # measured: packed only where oneDNN won at some row count
        assert not any(packed) or L.onednn_available()
    done = run_all(engine, [reqs])
    assert {k: v.token_ids for k, v in done.items()} == refs
    stats = engine.stats()
    assert "64->320 float32" in stats["linear_kernels"]  # lm_head: hidden 64 -> vocab 320
    assert stats["decode_attention"].split()[0] in ("kernel", "gather")


def test_a_kernel_whose_rows_change_above_some_row_count_gets_its_calls_cut_there(L):
    """invariant_block finds the largest row count whose calls give every row its bits alone, and calls past it
    are cut into blocks of that many rows (what AMX's bf16 kernels need above 32 rows, here made on purpose:
    rows of calls over 5 rows computed in float64, another rounding)."""
    import torch
    import torch.nn.functional as F

    w, b = _weights()
    lin = L.Linear(w, b)

    def per_row(x: torch.Tensor) -> torch.Tensor:  # each row alone: the same bits at every row count
        return (x.reshape(-1, 1, 40) * w).sum(-1).view(*x.shape[:-1], -1) + b

    lin._fns = [per_row] * len(lin._fns)
    lin._add_fns = [lambda x, r: r + per_row(x)] * len(lin._add_fns)
    assert L.invariant_block(lin) is None

    def varies(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // 40
        return F.linear(x.double(), w.double(), b.double()).float() if rows > 5 else per_row(x)

    lin._fns = [varies] * len(lin._fns)
    lin._add_fns = [lambda x, r: r + varies(x)] * len(lin._add_fns)
    assert L.invariant_block(lin) == 5
    lin.block = 5
    x = torch.randn(23, 40)
    alone = torch.cat([lin(x[j:j + 1]) for j in range(23)])
    assert torch.equal(lin(x), alone) and torch.equal(lin(x.view(1, 23, 40)).view(23, -1), alone)
    res = torch.randn(23, 48)
    assert torch.equal(lin.add_to(x, res), torch.cat([lin.add_to(x[j:j + 1], res[j:j + 1]) for j in range(23)]))


def test_the_amx_kernel_gives_every_row_its_bits_alone_at_every_row_count(L):
    """amx.py (bf16 on CPUs with AMX, ``auto``'s kernel there): one call of any row count, any row position, gives
    each row the bits it gets alone, within bf16 rounding of the fp32 product; ``add_to`` rounds as torch adds two
    bf16 tensors; ``onednn`` and shapes it cannot take (bias, a dimension not a multiple of 32) stay on oneDNN."""
    import torch

    from batchfleet.worker.engine.native import amx

    if amx.library() is None:
        pytest.skip("this CPU or kernel has no AMX-BF16 tiles")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    lin = L.LinearFactory("auto")(w)
    assert isinstance(lin, amx.AmxLinear) and lin.kernel_for(7) == amx.KERNEL and lin.block is None
    x = torch.randn(150, 64, generator=g).bfloat16()
    res = torch.randn(150, 96, generator=g).bfloat16()
    with torch.inference_mode():
        alone = torch.cat([lin(x[j:j + 1]) for j in range(150)])
        for start, rows in ((0, 150), (1, 33), (17, 16), (40, 100), (149, 1), (3, 0)):
            assert torch.equal(lin(x[start:start + rows]), alone[start:start + rows])
        torch.testing.assert_close(alone.float(), x.float() @ w.float().T, atol=0.05, rtol=0.01)
        assert torch.equal(lin.add_to(x, res), res + alone)
        assert torch.equal(lin(x.view(3, 50, 64)).view(150, -1), alone)
    assert not isinstance(L.LinearFactory("onednn")(w), amx.AmxLinear)
    assert not isinstance(L.LinearFactory("auto")(w, torch.zeros(96).bfloat16()), amx.AmxLinear)
    assert not isinstance(L.LinearFactory("auto")(torch.randn(96, 48).bfloat16()), amx.AmxLinear)
