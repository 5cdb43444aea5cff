"""The native engine's Triton kernels (worker/engine/native/triton_attention.py, triton_ops.py: the CUDA path)
run on CPU under Triton's interpreter against the torch path they replace: paged attention for decode steps
(GQA and MHA, scattered blocks, contexts across several fixed splits) and prefill chunks (with and without
cached prefix blocks), each query's bits independent of what shares the call; the small ops; and a tiny
model's greedy tokens through the whole engine, Triton path against torch path.

TRITON_INTERPRET is set while triton and the kernel modules are imported (``triton.jit`` reads it when it
decorates, triton's own tl.max/tl.sum included) and while each test runs (the interpreter reads it when a kernel
calls a jitted helper), then restored; the tests add "cpu" to ``triton_support.DEVICES`` for their own duration
only. Sizes are tiny: the interpreter runs each program in numpy."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton: its interpreter runs the kernels on CPU)",
                allow_module_level=True)
_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # while triton and the kernels are decorated (triton.jit reads it) and run
try:
    import torch
    import triton.language.standard

    from batchfleet.worker.engine.native import attention as A
    from batchfleet.worker.engine.native import triton_attention, triton_ops, triton_support
    from tests.helpers.native import build_model, make_engine, prompt, request, run_all
finally:  # other tests (workers this process starts later) see the environment as it was
    os.environ.pop("TRITON_INTERPRET") if _before is None else os.environ.update(TRITON_INTERPRET=_before)
if not all(type(f).__name__ == "InterpretedFunction"
           for f in (triton_attention._tile_kernel, triton_ops._rope_kernel, triton.language.standard.max)):
    pytest.skip("triton was imported before this module without TRITON_INTERPRET: run this file on its own",
                allow_module_level=True)

pytestmark = pytest.mark.integration
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    """The interpreter also reads TRITON_INTERPRET when a kernel calls another @triton.jit function."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def on_cpu(monkeypatch):
    """The Triton kernels used for CPU tensors (under the interpreter) while the test runs."""
    monkeypatch.setattr(triton_support, "DEVICES", {"cuda", "cpu"})


def _pool(dtype: torch.dtype, Hkv: int, D: int, blocks: int = 40, bs: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, blocks + 1, bs, Hkv, D, generator=g).to(dtype)  # the last block: trash


def _both(q: torch.Tensor, pool: torch.Tensor, layout: A.TileLayout, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch path, Triton path) of A.paged_attention."""
    ref = A.paged_attention(q, pool, layout, q.shape[-1] ** -0.5)
    with monkeypatch.context() as m:
        m.setattr(triton_support, "DEVICES", {"cuda", "cpu"})
        out = A.paged_attention(q, pool, layout, q.shape[-1] ** -0.5)
    return ref, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 32), (2, 2, 16)])
def test_triton_decode_attention_reads_scattered_blocks_like_the_torch_path(dtype, H, Hkv, D, monkeypatch):
    """Contexts of 1, 17 and 300 tokens (300: two splits of SPLIT_DEVICE, one program each, merged), block tables
    out of order and trash-padded; and a query alone gives the bits it gets beside the others (the short ones
    alone: a table of one split, so one program per tile instead of the split programs)."""
    pool, trash = _pool(dtype, Hkv, D), 40
    tables = [[9], [14, 2], [3, 7, 1, 12, 5, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]
    starts = [0, 16, 299]
    q = torch.randn(3, H, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref, out = _both(q, pool, A.tile_layout(tables, starts, [1, 1, 1], trash), monkeypatch)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    for b in range(3):
        _, alone = _both(q[b:b + 1], pool, A.tile_layout([tables[b]], [starts[b]], [1], trash), monkeypatch)
        assert torch.equal(alone, out[b:b + 1]), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_attention_with_and_without_cached_prefix_matches_the_torch_path(dtype, monkeypatch):
    """Packed chunks: one from position 0, one after 260 cached tokens (crossing a split), one after 3; causal
    within each; and the chunk's rows are the bits of the same queries decoded one at a time."""
    H, Hkv, D = 4, 2, 32
    pool, trash = _pool(dtype, Hkv, D), 40
    tables = [[4, 6], [3, 7, 1, 12, 5, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32], [9]]
    starts, lens = [0, 260, 3], [20, 17, 9]
    q = torch.randn(sum(lens), H, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref, out = _both(q, pool, A.tile_layout(tables, starts, lens, trash), monkeypatch)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    for n, p in ((20, 260), (36, 276)):  # rows of the second chunk
        _, alone = _both(q[n:n + 1], pool, A.tile_layout([tables[1]], [p], [1], trash), monkeypatch)
        assert torch.equal(alone, out[n:n + 1]), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_small_ops_round_like_the_torch_ops(dtype, tmp_path, on_cpu):
    """RMSNorm (alone and after the residual add), RoPE on a strided q/k view and SiLU * up against
    NativeModel's torch ops: fp32 within float rounding (RoPE and the add exact); bf16 within an ulp (the
    interpreter truncates fp32 -> bf16 where a GPU rounds)."""
    model = make_engine(build_model("qwen2", tmp_path), decode="gather").runner.model
    model.fused = None  # the torch ops as reference
    g = torch.Generator().manual_seed(4)
    x, res = (torch.randn(5, 3, 64, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=g).to(dtype)
    close = TOL[dtype] if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, model.eps), model.rms_norm(x, w), **close)
    h, normed = triton_ops.add_rms_norm(x, res, w, model.eps)
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(h, res + x, **exact)
    torch.testing.assert_close(normed, model.rms_norm(res + x, w), **close)
    qkv = torch.randn(2, 3, 4 + 2 * 2, 16, generator=g).to(dtype)  # [B, S, H + 2 Hkv, D]
    pos = torch.tensor([[0, 5, 9], [1, 2, 100]])
    cos, sin = model.cos[pos].unsqueeze(2).to(dtype), model.sin_rot[pos].unsqueeze(2).to(dtype)
    torch.testing.assert_close(triton_ops.rope(qkv[:, :, :6], cos, sin), model.rope(qkv[:, :, :6], cos, sin), **exact)
    gate_up = torch.randn(7, 2 * 48, generator=g).to(dtype) * 4
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), model.act_mul(gate_up), **close)


@pytest.mark.parametrize("prefill", ["packed", "padded"])
def test_tiny_model_greedy_tokens_are_the_same_through_triton_and_torch(prefill, tmp_path, monkeypatch):
    """The engine's torch path (what CUDA ran before) against its Triton path (attention and small ops), fp32:
    three prompts (GQA 2:1), one sharing the others' first block (a prefix-cache hit on the second wave), 6
    greedy tokens each."""
    loaded = build_model("qwen2", tmp_path)
    shared = prompt(0, 20)
    toks = [shared, prompt(1, 9), shared[:16] + prompt(2, 6)]

    def tokens() -> dict[str, list[int]]:
        engine = make_engine(loaded, decode="gather", prefill=prefill)
        waves = [[request(0, toks[0], 6), request(1, toks[1], 6)], [request(2, toks[2], 6)]]
        return {k: c.token_ids for k, c in run_all(engine, waves).items()}

    ref = tokens()
    monkeypatch.setattr(triton_support, "DEVICES", {"cuda", "cpu"})
    engine = make_engine(loaded, decode="gather", prefill=prefill)
    assert engine.runner.model.fused is triton_ops
    assert tokens() == ref


def test_graph_decode_on_triton_gives_the_eager_steps_tokens(tmp_path, monkeypatch):
    """The CUDA graph's decode step (graphs.py: rows padded to a bucket, tables to a power-of-two width, layout and
    slots computed from the persistent inputs), run eagerly on the Triton kernels, against the eager Triton decode
    of exactly n rows: the same greedy tokens (fp32) and logprobs. What the device replays, short of the capture."""
    loaded = build_model("qwen2", tmp_path)
    monkeypatch.setattr(triton_support, "DEVICES", {"cuda", "cpu"})
    toks = [prompt(0, 20), prompt(1, 9), prompt(2, 35)]

    def tokens(graph: str) -> dict:
        engine = make_engine(loaded, decode="gather", prefill="packed", max_batch_size=4)
        engine.runner.graphs = engine.runner._graphs(graph, 4)
        waves = [[request(0, toks[0], 5, logprobs=1), request(1, toks[1], 5, logprobs=1)],
                 [request(2, toks[2], 5, logprobs=1)]]
        out = {k: (c.token_ids, c.logprobs) for k, c in run_all(engine, waves, join_every=2).items()}
        assert engine.runner.model.fused is triton_ops and (graph == "off" or engine.runner.graphs.buckets)
        return out

    assert tokens("eager") == tokens("off")
