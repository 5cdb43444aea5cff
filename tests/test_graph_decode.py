"""Graph-captured decode (worker/engine/native/graphs.py) run eagerly on CPU: the padded buckets, the persistent
inputs and the step a CUDA graph captures, with the capture replaced by a plain call (``graph="eager"``), give the
unpadded eager path's tokens and logprobs, bit for bit. The capture itself (torch.cuda.CUDAGraph, torch.npu.NPUGraph)
needs the device: scripts/bench_gpu.sh checks it on a GPU; here, a capture that raises turns the graphs off with the
eager path's tokens. Also the batch-invariant mode's fixed-row matmul and the options' checks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.wire.params import Params
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.native.engine import NativeEngine
from batchfleet.worker.engine.native.graphs import (
    CaptureFailed,
    DecodeGraphs,
    DeviceCapture,
    Outputs,
    Replay,
    StepInputs,
    batch_sizes,
    eager_capture,
    graph_module,
)
from batchfleet.worker.engine.native.invariance import FixedRowsLinear
from batchfleet.worker.engine.native.linear import Linear
from tests.helpers.native import build_model

pytestmark = pytest.mark.integration
BUCKETS = (16, 32, 64)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("graphs"))  # GQA 2:1, qkv bias, fp32


def _engine(loaded, graph: str, **cfg) -> NativeEngine:
    batching = DynamicBatchingConfig(max_batch_size=8, max_seq_len=128, buckets=BUCKETS)
    config = EngineConfig(engine="native", mode="continuous", block_size=8, kv_cache_gb=0.01, native_kernel=False,
                          max_running=12, **cfg)
    return NativeEngine(loaded, batching, config, graph=graph)


def _requests() -> list[GenRequest]:
    out = []
    for i in range(11):
        n = 3 + 5 * i % 50
        prompt = [1] + [(7 * i + 13 * j) % 300 + 4 for j in range(n - 1)]
        extra = dict(temperature=0.9, top_p=0.9, seed=i) if i % 4 == 3 else {}
        out.append(GenRequest(id=f"r{i}", prompt=prompt, bucket=next(b for b in BUCKETS if b >= n),
                              params=Params(max_new_tokens=6 + 3 * i % 17, logprobs=2, **extra)))
    return out


def _drain(engine: NativeEngine) -> dict:
    """Requests added in waves between steps (decode steps of 1..11 rows: most padded to a bucket)."""
    reqs, done, steps = _requests(), {}, 0
    waves = [reqs[:1], reqs[1:3], reqs[3:7], reqs[7:]]
    while engine.has_work() or waves:
        if waves and steps % 3 == 0:
            engine.add([replace(r) for r in waves.pop(0)])
        for c in engine.step():
            assert c.error is None, c.error
            done[c.id] = (c.token_ids, c.logprobs)
        steps += 1
    return done


def test_batch_sizes_are_the_padded_buckets_up_to_the_limit():
    assert batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert batch_sizes(12) == (1, 2, 4, 8, 12)
    assert batch_sizes(200)[-4:] == (128, 160, 192, 200) and batch_sizes(1) == (1,)


def test_a_bucket_holds_the_step_inputs_and_trash_padding():
    seen = []

    def step(inp: StepInputs) -> torch.Tensor:
        seen.append((inp.tokens.clone(), inp.positions.clone(), inp.tables.clone()))
        return inp.tokens.float().expand(-1, 3) * torch.tensor([1.0, 2.0, 0.5])  # logits [B, 3]

    graphs = DecodeGraphs(step, max_rows=12, max_width=16, trash=99, device=torch.device("cpu"), capture=eager_capture)
    assert graphs.bucket(3, 3) == (4, 4) and graphs.bucket(9, 16) == (12, 16) and not graphs.fits(13)
    logits, greedy = graphs.run([5, 6, 7], [10, 0, 20], [[1, 2], [3], [4, 5, 6]])
    tokens, positions, tables = seen[-1]
    assert tokens.view(-1).tolist() == [5, 6, 7, 0] and positions.view(-1).tolist() == [10, 0, 20, 0]
    assert tables.tolist() == [[1, 2, 99, 99], [3, 99, 99, 99], [4, 5, 6, 99], [99] * 4]
    assert logits.shape == (3, 3) and greedy.tolist() == [1, 1, 1]
    graphs.run([8], [1], [[7]])  # the next step of one row reuses a bucket of its own
    assert sorted(graphs.buckets) == [(1, 1), (4, 4)]


def test_eager_graph_decode_gives_the_unpadded_paths_tokens_and_logprobs(loaded):
    """The graph path (buckets of 1, 2, 4, 8, 12 rows, tables padded to powers of two, every row's attention over
    all W blocks, greedy argmax inside the step) against the eager path of exactly n rows: identical greedy and
    seeded-sampled tokens and identical logprobs, in fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        model = replace(loaded, model=loaded.model.to(dtype), dtype=dtype)
        eager, graphed = _engine(model, "off"), _engine(model, "eager")
        assert eager.runner.graphs is None and graphed.runner.describe()["decode_graphs"]["rows"] == [1, 2, 4, 8, 12]
        want, got = _drain(eager), _drain(graphed)
        assert set(got) == set(want) == {f"r{i}" for i in range(11)}
        for rid in want:
            assert got[rid] == want[rid], f"{rid} ({dtype}) differs between the graph path and the eager path"
        shapes = graphed.stats()["decode_shapes"]
        assert any(int(s.split("x")[0]) in (4, 8, 12) for s in shapes), shapes  # padded rows really ran
        assert len(graphed.runner.graphs.buckets) >= 3 and set(graphed.runner.graphs.sizes) >= {4, 8}
    loaded.model.to(torch.float32)


def test_enforce_eager_and_cpu_run_decode_without_graphs(loaded):
    assert _engine(loaded, None, enforce_eager=True).runner.graphs is None
    assert _engine(loaded, None).runner.describe()["decode_graphs"] == "off"  # auto: captured on CUDA and NPU only
    with pytest.raises(ValueError, match="need CUDA or an NPU"):
        _engine(loaded, "captured")
    with pytest.raises(ValueError, match="graph must be one of"):
        _engine(loaded, "always")


def test_graphs_are_captured_through_torch_cuda_and_torch_npu_only():
    assert graph_module("cuda") == "cuda" and graph_module("npu") == "npu"
    assert graph_module("cpu") is None and graph_module("mps") is None and graph_module("xpu") is None
    with pytest.raises(ValueError, match="CUDA or NPU only"):
        DeviceCapture("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA")
def test_a_device_capture_that_cannot_run_raises_capture_failed():
    """The real CUDA capture where there is no GPU fails at its first capture, as ``CaptureFailed`` (what the runner
    turns into eager decoding), not when the runner is built."""
    graphs = DecodeGraphs(lambda inp: inp.tokens.float().expand(-1, 3), max_rows=4, max_width=4, trash=9,
                          device=torch.device("cpu"), capture=DeviceCapture("cuda"))
    with pytest.raises(CaptureFailed, match="capture of bucket 1x1 failed: "):
        graphs.run([5], [0], [[1]])
    assert not graphs.buckets


def test_a_failed_capture_turns_the_graphs_off_with_the_eager_paths_tokens(loaded, caplog):
    """The second bucket's capture raises after its warm-up ran the step once (K/V of that step written), as a
    device capture might: one warning naming the error, that step and every later one eager, tokens and logprobs
    those of the eager path."""
    captures: list[int] = []

    def flaky(fn: Callable[[], Outputs]) -> Replay:
        captures.append(1)
        if len(captures) == 1:
            return fn  # the first bucket replays (eagerly) as a captured one would
        fn()
        raise RuntimeError("capture of an op the device cannot record")

    want = _drain(_engine(loaded, "off"))
    graphed = _engine(loaded, "eager")
    graphed.runner.graphs.capture = flaky
    with caplog.at_level(logging.WARNING, logger="batchfleet.worker.engine.native.runner"):
        got = _drain(graphed)
    assert got == want
    assert len(captures) == 2 and graphed.runner.graphs is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: capture of an op the device cannot record" in warnings[0], warnings
    assert graphed.runner.describe()["decode_graphs"].startswith("off (capture of bucket ")


def test_fixed_rows_linear_gives_a_row_its_bits_alone():
    """The batch-invariant mode's matmul: every kernel call has the same row count, so a row's bits do not
    depend on how many rows come with it (CPU's F.linear here; cuBLAS on the device)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    lin = FixedRowsLinear(Linear(w, b), rows=8)
    x, res = torch.randn(19, 32, generator=g), torch.randn(19, 48, generator=g)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(19)])
    assert torch.equal(lin(x), alone) and torch.equal(lin(x.view(1, 19, 32)).view(19, 48), alone)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b))
    assert torch.equal(lin.add_to(x, res), res + alone)
