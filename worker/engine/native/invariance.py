"""Batch-invariant mode on CUDA (``--batch-invariant``): a request's tokens and logprobs must not depend on what runs
beside it. CPU keeps its default, which already is (linear.py: row-invariant matmuls; attention.py: fixed splits).

What changes a row's bits on CUDA with the batch: cuBLAS picks its GEMM kernel (tile shape, split-K) from the
shape, so a decode step of 24 rows and one of 32 sum a row's products in other orders. The mode runs every weight
matmul of the engine in chunks of exactly ``ROWS`` rows (the last one zero-padded): one shape, one kernel, and a
GEMM's row depends only on that row and the weight. It also sets what vLLM's batch-invariant mode sets on the
device: fp32 accumulation of bf16/fp16 reductions inside cuBLAS (no reduced-precision split-K), no TF32, a fixed
cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``; read when the first cuBLAS handle is made, so set it in the
environment before the process touches CUDA to be sure). Not torch's deterministic algorithms: they address
run-to-run atomics, not the batch, and some of their kernels sync with the host, which a captured decode cannot.
vLLM goes further, replacing aten's mm/bmm/softmax with persistent Triton kernels; here the torch paged
attention keeps its fixed split of ``attention.SPLIT_DEVICE`` keys, whose bmm item counts still vary with the step.

Cost: a decode step of n < ROWS rows computes ROWS (memory-bound: the weights are read once either way); a prefill
of N tokens reads the weights ceil(N / ROWS) times. Unmeasured (no GPU lent while it was written): off by default
until scripts/bench_gpu.sh measures it (the issue's rule: on by default if it costs <= 10% throughput).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

ROWS = 128  # rows per weight matmul in the mode: a 7B decode step's GEMMs stay memory-bound at this size (H100)
WORKSPACE = ":4096:8"  # vLLM's CUBLAS_WORKSPACE_CONFIG in its batch-invariant mode


class FixedRowsLinear:
    """A linear layer (linear.py's ``Linear`` interface: ``__call__``, ``add_to``) whose every kernel call has
    exactly ``rows`` rows. x: [..., in] -> [..., out]."""

    def __init__(self, inner, rows: int = ROWS) -> None:
        self.inner, self.rows = inner, rows
        self.weight, self.bias, self.n_in = inner.weight, inner.bias, inner.n_in

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.n_in
        flat = x.reshape(n, self.n_in)
        padded = -(-n // self.rows) * self.rows
        if padded != n:
            flat = torch.cat([flat, flat.new_zeros(padded - n, self.n_in)])
        out = torch.cat([self.inner(flat[a:a + self.rows]) for a in range(0, padded, self.rows)])
        return out[:n].view(*x.shape[:-1], -1)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self(x)  # as F.linear's path: the matmul rounded to the dtype, then the add

    def kernel_for(self, rows: int) -> str:
        return f"{self.inner.kernel_for(self.rows)} ({self.rows} rows per call)"


def enable(model) -> bool:
    """Batch-invariant mode for ``model`` (a NativeModel) on its device; True where anything changed (CUDA)."""
    if model.device.type != "cuda":
        return False  # CPU: the default already is; NPU: not implemented (vllm-ascend's Triton/AscendC kernels)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", WORKSPACE)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    model.lm_head_l = FixedRowsLinear(model.lm_head_l)
    for lw in model.layers:
        lw.qkv_l, lw.o_l = FixedRowsLinear(lw.qkv_l), FixedRowsLinear(lw.o_l)
        lw.gate_up_l, lw.down_l = FixedRowsLinear(lw.gate_up_l), FixedRowsLinear(lw.down_l)
    log.info("batch-invariant mode: weight matmuls in calls of %d rows, cuBLAS workspace %s, no reduced-precision "
             "reductions", ROWS, os.environ["CUBLAS_WORKSPACE_CONFIG"])
    return True
