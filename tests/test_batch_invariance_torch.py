"""Batch invariance of the native engine's torch path (``--no-native-kernel``: what CUDA and NPU run), bf16
and fp32, with both prefill layouts (``packed``, the CPU default; ``padded``, the CUDA/NPU default).

The same flood as tests/test_batch_invariance.py (background requests, a third seeded sampling, all with
logprobs, under waves of interactive ones; prefill chunks of 24 tokens, a pool that forces preemptions, a
shared system prompt), through the engine's real scheduler, each request compared with itself alone, token
and logprob. Also the torch paged attention alone: a query's output is the same bits whatever else is in the
call (other sequences, the table width, the tile it shares)."""

from __future__ import annotations

import pytest
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.worker.engine.models import LoadedModel
from batchfleet.worker.engine.native import attention as A
from batchfleet.worker.engine.native.engine import NativeEngine
from tests.test_batch_invariance import BUCKETS, DTYPES, _loaded, assert_flood_leaves_batch_requests_as_alone, model_dir

pytestmark = pytest.mark.integration
__all__ = ["model_dir"]  # the module-scoped tiny Llama (head dim 64, GQA 2:1) of test_batch_invariance


def _engine(loaded: LoadedModel, prefill: str, **kw) -> NativeEngine:
    batching = DynamicBatchingConfig(max_batch_size=8, max_seq_len=256, buckets=BUCKETS)
    cfg = EngineConfig(engine="native", mode="continuous", block_size=16, kv_cache_gb=0.01, native_kernel=False)
    return NativeEngine(loaded, batching, cfg, prefill=prefill, **kw)


@pytest.mark.parametrize("prefill", ["packed", "padded"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_batch_requests_under_a_flood_match_them_alone(model_dir, dtype, prefill):
    loaded = _loaded(model_dir, dtype)

    def fresh(**kw) -> NativeEngine:
        engine = _engine(loaded, prefill, **kw)
        assert engine.runner.describe()["decode_attention"] == "gather" and engine.runner.ops is None  # torch path
        return engine

    assert_flood_leaves_batch_requests_as_alone(fresh, f"{dtype}, {prefill}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_gives_a_query_the_same_bits_whatever_shares_the_call(dtype, monkeypatch):
    """One sequence's queries (positions 40..69 of a 70-token context) computed together as a prefill chunk,
    one by one as decode steps, beside other sequences with wider tables, and one tile per pass: the same
    bits; and the attention itself (SDPA over the same cache as reference)."""
    g = torch.Generator().manual_seed(0)
    bs, Hkv, D, H = 16, 2, 64, 4
    pool = torch.randn(2, 21, bs, Hkv, D, generator=g).to(dtype)  # 20 blocks + the trash block
    trash = 20
    table = [3, 7, 1, 12, 5]  # 5 blocks: 80 slots, 70 used
    q = torch.randn(70, H, D, generator=g).to(dtype)
    chunk = A.paged_attention(q[40:], pool, A.tile_layout([table], [40], [30], trash), D**-0.5)
    ref = torch.cat([A.decode_attention_gather(q[p:p + 1].float(), pool.float(), torch.tensor([table]),
                                               A.decode_mask(torch.tensor([p + 1]), 80), D**-0.5)
                     for p in range(40, 70)])
    torch.testing.assert_close(chunk.float(), ref, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    others = [[2, 4, 6, 8, 9, 10, 11, 13], [14]]
    for p in range(40, 70):
        alone = A.paged_attention(q[p:p + 1], pool, A.tile_layout([table], [p], [1], trash), D**-0.5)
        assert torch.equal(alone, chunk[p - 40:p - 39]), p
        qs = torch.cat([torch.randn(1, H, D, generator=g).to(dtype), q[p:p + 1], q[:3]])
        mixed = A.paged_attention(qs, pool, A.tile_layout([others[0], table, others[1]], [100, p, 0], [1, 1, 3],
                                                          trash, width=8), D**-0.5)
        assert torch.equal(mixed[1:2], chunk[p - 40:p - 39]), p
    monkeypatch.setattr(A, "GROUP", 1)
    assert torch.equal(A.paged_attention(q[40:], pool, A.tile_layout([table], [40], [30], trash), D**-0.5), chunk)


def test_fp32_silu_is_the_same_bits_in_the_vector_body_and_the_scalar_tail(model_dir):
    """torch's elementwise kernels run a contiguous range's body on vectors and its tail (where a thread's range
    ends mid-vector, which depends on the row count) on scalars; the torch path's SiLU * up must agree in both.
    A strided view takes the scalar loop everywhere."""
    model = _engine(_loaded(model_dir, "float32"), "packed").runner.model
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(300, 2 * 1024, generator=g) * 4  # gate_up of 1024 = 2 x 512, every other column taken
    with torch.inference_mode():
        assert torch.equal(model.act_mul(wide[:, ::2]), model.act_mul(wide[:, ::2].contiguous()))
