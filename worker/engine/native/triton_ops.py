"""A step's small ops in Triton for CUDA (``NativeModel`` uses them where triton_support.runs_on its device):
RMSNorm, the residual add fused with the next RMSNorm, RoPE and SiLU * up, each one kernel where the torch
ops launch 3-8 (a 7B decode step runs them 32 x 5 times).

Each rounds where the torch op of ``NativeModel`` rounds (math in fp32, the result rounded to the model dtype
at the same points), so RoPE and the residual add give the torch ops' bits on a GPU and RMSNorm and SiLU are
within an ulp (another summation order, another exp). Checked on CPU under ``TRITON_INTERPRET=1``
(tests/test_triton_kernels.py; the interpreter's fp32 -> bf16 conversion truncates instead of rounding, so bf16
is compared within an ulp there); never run on a GPU yet (no device lent when written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program of the elementwise ops


@triton.jit
def _rms_norm_row(h, W, eps, cols, ok, N: tl.constexpr):
    """LlamaRMSNorm of one row h [NP] (fp32, already in the model dtype's values) -> fp32 values of the result in
    the model dtype (w * (h * rsqrt(mean(h^2) + eps)).to(dtype))."""
    var = tl.sum(h * h, 0) / N
    y = (h * tl.rsqrt(var + eps)).to(W.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    return w * y


@triton.jit
def _rms_norm_kernel(X, W, Y, eps, N: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, NP)
    ok = cols < N
    h = tl.load(X + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, _rms_norm_row(h, W, eps, cols, ok, N).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(X, R, W, H, Y, eps, N: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, NP)
    ok = cols < N
    x = tl.load(X + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    h = (r + x).to(H.dtype.element_ty)  # the residual stream, rounded as torch's add rounds it
    tl.store(H + row * N + cols, h, mask=ok)
    y = _rms_norm_row(h.to(tl.float32), W, eps, cols, ok, N)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(GU, Y, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(GU + row * 2 * N + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GU + row * 2 * N + N + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)  # F.silu rounds here
    tl.store(Y + row * N + cols, (act * up).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, s_xt, s_xh, heads, D: tl.constexpr, DP: tl.constexpr):
    """Program (token, head): y = x * cos + rotate_half(x) * sin_rot, each product and the sum rounded to the
    model dtype as the torch ops round them."""
    tok = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)
    dd = tl.arange(0, DP)
    ok = dd < D
    half = D // 2
    src = X + tok * s_xt + hd * s_xh
    x = tl.load(src + dd, mask=ok, other=0.0).to(tl.float32)
    rot = tl.load(src + (dd + half) % D, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(COS + tok * D + dd, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(SIN + tok * D + dd, mask=ok, other=0.0).to(tl.float32)
    ty = Y.dtype.element_ty
    y = (x * c).to(ty).to(tl.float32) + (rot * s).to(ty).to(tl.float32)
    tl.store(Y + (tok * heads + hd) * D + dd, y.to(ty), mask=ok)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``NativeModel.rms_norm``: x [..., n], w [n] -> [..., n]."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm_kernel[(x.numel() // n,)](x, w, y, eps, N=n, NP=triton.next_power_of_2(n))
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = residual + x: the residual add and the next RMSNorm in one pass.
    x, residual: [..., n]; w: [n]."""
    x, residual = x.contiguous(), residual.contiguous()
    n = x.shape[-1]
    h, y = torch.empty_like(residual), torch.empty_like(residual)
    _add_rms_norm_kernel[(x.numel() // n,)](x, residual, w, h, y, eps, N=n, NP=triton.next_power_of_2(n))
    return h, y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection [..., 2 n] (gate, then up) -> [..., n]."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    y = gate_up.new_empty(*gate_up.shape[:-1], n)
    _silu_mul_kernel[(gate_up.numel() // (2 * n), triton.cdiv(n, BLOCK))](gate_up, y, N=n, BLOCK=BLOCK)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """``NativeModel.rope``: x [B, S, heads, D] (a view into qkv: tokens and heads strided, D contiguous);
    cos/sin_rot: [B, S, 1, D] -> [B, S, heads, D], contiguous."""
    B, S, heads, D = x.shape
    if x.stride(3) != 1 or x.stride(0) != S * x.stride(1):
        x = x.contiguous()
    cos, sin_rot = cos.contiguous(), sin_rot.contiguous()
    y = torch.empty(B, S, heads, D, dtype=x.dtype, device=x.device)
    _rope_kernel[(B * S, heads)](x, cos, sin_rot, y, x.stride(1), x.stride(2), heads, D=D,
                                 DP=triton.next_power_of_2(D))
    return y
