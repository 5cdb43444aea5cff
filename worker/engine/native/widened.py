"""bf16 linears computed in fp32 on CPUs without bf16 arithmetic (x86 with AVX2 but neither AVX-512 nor
AVX-NE-CONVERT: AMD Zen 3 and older, Intel before Ice Lake), for the native engine.

There oneDNN cannot prepack a bf16 weight, and torch's bf16 ``F.linear`` takes a scalar fallback: on an AVX2
EPYC (Zen 3) the bench preset's decode step spent ~10x the fp32 step's time in its matmuls. A bf16 GEMM's
arithmetic is fp32 anyway (a product of two bf16 values is exact in fp32, the sums are fp32 and the output is
rounded to bf16 once), so the layer keeps the weight widened to fp32 in oneDNN's blocked layout, widens the
input (exact), runs the fp32 kernel and rounds the output to bf16: a bf16 GEMM with another summation order,
at fp32 speed. What bf16 still saves there is the KV cache's bytes (half of fp32's), hence the attention's
reads; the weights cost more memory (the packed fp32 copy beside the bf16 weight: 3x the bf16 bytes).

Batch invariance: the fp32 kernel's, checked per weight shape at load like every oneDNN layer's
(``linear.invariant_block``)."""

from __future__ import annotations

import torch

from batchfleet.worker.engine.native.linear import PROBE_ROWS, Linear, Plan, prepack


class WidenedLinear(Linear):
    """``Linear`` over a bf16 ``weight`` whose matmuls run in fp32 on oneDNN (``packed``: the fp32 weight
    prepacked); x and the output are bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> None:
        super().__init__(weight, bias, Plan({r: "onednn" for r in PROBE_ROWS}), packed)
        self.bias32 = None if bias is None else bias.float()

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias32, "none", [], "").to(x.dtype)

    def _onednn_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # as the bf16 default kernel does it: the matmul rounded to bf16, then a bf16 add
        return residual + self._onednn(x)


def widened(weight: torch.Tensor, bias: torch.Tensor | None) -> WidenedLinear | None:
    """The widened layer for a bf16 CPU ``weight`` that oneDNN can run in fp32; None otherwise."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    packed = prepack(weight.float())
    return None if packed is None else WidenedLinear(weight, bias, packed)
