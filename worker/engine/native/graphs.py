"""Graph-captured decode: one decode step captured per padded batch size and replayed each step, with persistent
input buffers (as vLLM and SGLang do with CUDA graphs), so that a step costs one launch instead of every layer's
kernels launched one by one from Python.

A step of n sequences runs as the bucket (B, W): B the smallest of ``batch_sizes(max_rows)`` >= n, W the block-table
width, a power of two >= the longest table (capped at the widest table a sequence can have). The bucket's inputs
live in one flat int64 buffer on the device (tokens [B], positions [B], block tables [B, W]), filled from the host
with one copy; padding rows read token 0 at position 0 through a table of trash blocks, so they write and read the
trash block only. Everything else (KV slots, context lengths, the attention's layout) is computed from these inside
the step. The step's outputs, fp32 logits [B, V] and their argmax [B] (greedy sampling, in the graph), are the
graph's own tensors: the next replay of any bucket overwrites them (graphs share one memory pool), so the runner
reads them before the next step.

What a captured step may do: no host sync (``.item()``, ``.tolist()``, ``.cpu()``), no shape or Python branch taken
from a tensor's values, no host list read as data (torch_npu's ``npu_incre_flash_attention`` reads its
``actual_seq_lengths`` from one: the NPU's graphs run the torch paged attention instead, see docs/NATIVE_ENGINE.md);
the KV pool, weights and the bucket's inputs are its only outside tensors.

``capture`` is what turns a step function into a replay function: ``DeviceCapture`` through the device's graph API
(torch.cuda.CUDAGraph on CUDA; torch.npu.NPUGraph on an Ascend NPU, torch_npu's ACL graphs, whose Python API mirrors
CUDA's), ``eager_capture`` (the function itself, called each step) elsewhere, so that the bucket choice, the buffer
filling and the padded step run, and are tested, on CPU. A capture that raises surfaces as ``CaptureFailed``: the
runner then decodes eagerly (runner.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

Outputs = tuple[torch.Tensor, torch.Tensor]  # logits [B, V] fp32, greedy tokens [B] int64
Replay = Callable[[], Outputs]
Capture = Callable[[Callable[[], Outputs]], Replay]
MODES = ("auto", "off", "captured", "eager")  # the runner's ``graph`` argument
WARMUP = 2  # eager runs on a side stream before a capture (lazy cuBLAS/Triton/ACL init happens outside the graph)
GRAPH_CLASSES = {"cuda": "CUDAGraph", "npu": "NPUGraph"}  # device type -> graph class of torch.<device type>


def graph_module(device_type: str) -> str | None:
    """The torch module (``torch.<name>``) whose graph API captures decode steps on ``device_type``: "cuda", "npu"
    (torch.npu, which torch_npu adds: imported wherever a model sits on an NPU), None where there is none (CPU)."""
    return device_type if device_type in GRAPH_CLASSES else None


class CaptureFailed(RuntimeError):
    """A bucket's capture raised (an op the device cannot capture, an old driver): ``__cause__`` says why."""


def batch_sizes(max_rows: int) -> tuple[int, ...]:
    """Padded batch sizes up to ``max_rows``: 1, 2, 4, 8, then every 8 to 32, every 16 to 64, every 32 beyond,
    and ``max_rows`` itself (the waste per step stays under a third of the rows above 8)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, not {max_rows}")
    sizes = [1, 2, 4, 8, *range(16, 33, 8), 48, 64]
    size = 96
    while sizes[-1] < max_rows:
        sizes.append(size)
        size += 32
    out = [s for s in sizes if s < max_rows] + [max_rows]
    return tuple(out)


@dataclass
class StepInputs:
    """One bucket's persistent inputs: views of ``flat`` (int64, on the device), written before each replay.
    tokens, positions: [B, 1]; tables: [B, W] block ids (trash-padded)."""

    flat: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    staging: torch.Tensor | None  # pinned host copy of ``flat`` (CUDA): the upload runs asynchronously;
    # elsewhere (NPU: pinning through torch_npu never tried) one synchronous copy

    @classmethod
    def empty(cls, rows: int, width: int, device: torch.device) -> StepInputs:
        flat = torch.zeros(rows * (2 + width), dtype=torch.int64, device=device)
        staging = torch.empty_like(flat, device="cpu").pin_memory() if device.type == "cuda" else None
        return cls(flat, flat[:rows].view(rows, 1), flat[rows:2 * rows].view(rows, 1),
                   flat[2 * rows:].view(rows, width), staging)


def eager_capture(fn: Callable[[], Outputs]) -> Replay:
    """No graph: each replay runs the step's ops as they are (CPU; the logic of the captured path, eagerly)."""
    return fn


class DeviceCapture:
    """A graph per bucket through ``torch.<graph_module(device_type)>``, all in one memory pool (buckets never run
    concurrently). torch_npu mirrors the CUDA names used here (NPUGraph, graph(graph, pool=..., capture_error_mode=...),
    graph_pool_handle, Stream, current_stream, stream); arguments are passed by keyword, as the two ``graph``
    signatures order them differently."""

    def __init__(self, device_type: str) -> None:
        name = graph_module(device_type)
        if name is None:
            raise ValueError(f"no graph capture on {device_type!r} (CUDA or NPU only)")
        self.name = name
        # made at the first capture: a torch_npu (or torch) without graphs fails there, as a capture, not at load
        self.pool: tuple[int, int] | None = None
        self.graphs: list = []  # kept alive with their pool

    def __call__(self, fn: Callable[[], Outputs]) -> Replay:
        mod = getattr(torch, self.name)
        if self.pool is None:
            self.pool = mod.graph_pool_handle()
        # warm-up on a side stream (torch's documented pattern): cuBLAS workspaces, Triton compilation, ACL op
        # setup and the caching allocator's first blocks are made here, not recorded. The step's inputs are already
        # filled, so these runs write this step's K/V, which the replay writes again (the same values to the same
        # slots)
        side = mod.Stream()
        side.wait_stream(mod.current_stream())
        with mod.stream(side):
            for _ in range(WARMUP):
                fn()
        mod.current_stream().wait_stream(side)
        graph = getattr(mod, GRAPH_CLASSES[self.name])()
        # thread_local: device calls of the worker's other threads (metrics, heartbeat) do not break the capture
        with mod.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        self.graphs.append(graph)

        def replay() -> Outputs:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    """Decode steps through captured (or, with ``eager_capture``, eagerly replayed) buckets.

    step: the runner's decode step over a bucket's inputs -> fp32 logits [B, V] (static shapes, no host sync);
    max_rows: the largest bucket (a step with more sequences runs eagerly: ``fits`` is False);
    max_width: the widest block table; trash: the trash block id; capture: ``DeviceCapture(type)`` or
    ``eager_capture``. Buckets are captured on first use (a capture runs the step ``WARMUP`` + 1 times); a capture
    that raises raises ``CaptureFailed`` from ``run``, and the bucket is left uncaptured."""

    def __init__(self, step: Callable[[StepInputs], torch.Tensor], max_rows: int, max_width: int, trash: int,
                 device: torch.device, capture: Capture) -> None:
        self.step, self.sizes, self.max_width, self.trash = step, batch_sizes(max_rows), max_width, trash
        self.device, self.capture = device, capture
        self.buckets: dict[tuple[int, int], tuple[StepInputs, Replay]] = {}

    def fits(self, rows: int) -> bool:
        return rows <= self.sizes[-1]

    def bucket(self, rows: int, width: int) -> tuple[int, int]:
        """(B, W) a step of ``rows`` sequences whose longest table has ``width`` blocks runs at."""
        B = next(s for s in self.sizes if s >= rows)
        return B, min(1 << (width - 1).bit_length(), max(self.max_width, width))

    def fill(self, inputs: StepInputs, tokens: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """Write one step's inputs (n rows) into a bucket's buffer, padding rows after them, in one copy."""
        B, W = inputs.tables.shape
        pad = B - len(tokens)
        values = array("q", tokens)
        values.extend([0] * pad)
        values.extend(positions)
        values.extend([0] * pad)
        for t in tables:
            values.extend(t)
            values.extend([self.trash] * (W - len(t)))
        values.extend([self.trash] * (W * pad))
        host = torch.frombuffer(values, dtype=torch.int64)
        if inputs.staging is None:
            inputs.flat.copy_(host)
            return
        # the previous upload from this staging buffer is done: its step's tokens were read back since
        inputs.staging.copy_(host)
        inputs.flat.copy_(inputs.staging, non_blocking=True)

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> Outputs:
        """One decode step of n = len(tokens) sequences (each row: its last token, its position, its block
        table) -> (logits [n, V] fp32, greedy tokens [n]), views of the bucket's outputs."""
        n = len(tokens)
        key = self.bucket(n, max(len(t) for t in tables))
        entry = self.buckets.get(key)
        if entry is None:
            inputs = StepInputs.empty(*key, self.device)
            self.fill(inputs, tokens, positions, tables)
            try:
                replay = self.capture(lambda: _with_argmax(self.step(inputs)))
            except Exception as e:  # whatever the device's capture raises: the caller decodes without graphs
                raise CaptureFailed(f"capture of bucket {key[0]}x{key[1]} failed: {type(e).__name__}: {e}") from e
            entry = self.buckets[key] = (inputs, replay)
        else:
            self.fill(entry[0], tokens, positions, tables)
        logits, greedy = entry[1]()
        return logits[:n], greedy[:n]


def _with_argmax(logits: torch.Tensor) -> Outputs:
    return logits, logits.argmax(dim=-1)
