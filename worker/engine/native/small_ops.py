"""The small ops of a CPU step in C (``decode_ops.c``: RMSNorm, RoPE + KV write, SiLU * up, argmax), built like
the decode kernel (``cpu_kernel._build``) and called through ctypes, one call per op instead of several torch
ops whose fixed cost per op dominates at decode sizes.

A step binds them once (``StepOps``, ``RopeKV``): each call then checks only the tensor it is given and writes
into a buffer of the step's own, reused layer after layer, because at a decode step's 32 rows a fresh output
tensor and the full checks cost as much as the op (~8 us a call on 2 cores, ~0.5 ms of a 12-layer step). The
functions below (``rms_norm``, ``silu_mul``, ``rope_kv``, ``argmax``) are the same calls with fresh outputs.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from batchfleet.worker.engine.native import cpu_kernel

OPS_SOURCE = Path(__file__).with_name("decode_ops.c")
# no FMA contraction, no reassociation: each op rounds where torch's does (RoPE + KV write bit-identical;
# RMSNorm and SiLU within ~1 ulp: another summation order, another exp). -fno-trapping-math changes no value
# (the ops never read FP exception flags) but lets gcc turn exp_poly's range checks into selects and rintf into
# a vector round: SiLU * up vectorizes, 5.8x faster in fp32 and 6.8x in bf16 at 32 x 2048 on AVX2, same bits
OPS_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
              "-fno-trapping-math"]
_ROPE_KV = {torch.bfloat16: "rope_kv_bf16", torch.float32: "rope_kv_f32"}
_RMS_NORM = {torch.bfloat16: "rms_norm_bf16", torch.float32: "rms_norm_f32"}
_SILU_MUL = {torch.bfloat16: "silu_mul_bf16", torch.float32: "silu_mul_f32"}
_ARGMAX = {torch.bfloat16: "argmax_bf16", torch.float32: "argmax_f32"}


@lru_cache(maxsize=4)
def load_ops(kernel_dir: Path = cpu_kernel.DEFAULT_KERNEL_DIR) -> ctypes.CDLL | None:
    """The compiled ops, built into ``kernel_dir`` on first use; None when unavailable (the forward then runs
    them as torch ops)."""
    # a compiler without OpenMP: the same ops on the calling thread (same bits; the pragmas are ignored)
    lib = cpu_kernel._build(OPS_SOURCE, OPS_CFLAGS, kernel_dir) or cpu_kernel._build(
        OPS_SOURCE, [f for f in OPS_CFLAGS if f != "-fopenmp"], kernel_dir)
    if lib is None:
        return None
    # the last argument of each: threads (rows split across them above a size; results never depend on it)
    cpu_kernel._declare(lib, _ROPE_KV.values(), ctypes.c_int,
                        [ctypes.c_void_p] * 8 + [ctypes.c_int] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int])
    cpu_kernel._declare(lib, _RMS_NORM.values(), None,
                        [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int])
    cpu_kernel._declare(lib, [*_SILU_MUL.values(), *_ARGMAX.values()], None, [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3)
    return lib


def _threads(num_threads: int | None) -> int:
    """Threads for a small op (default: torch's intra-op count). Each op splits rows across them only above
    a size and computes every element as on one thread, so results never depend on this."""
    n = int(num_threads) if num_threads is not None else torch.get_num_threads()
    _check(n >= 1, f"num_threads must be >= 1, not {n}")  # OpenMP would read -1 as ~4e9 threads
    return n


def _check(ok: bool, what: str) -> None:
    if not ok:  # not assert: these guard raw-pointer writes, also under python -O
        raise ValueError(f"decode_ops: {what}")


class StepOps:
    """RMSNorm and SiLU * up for one forward pass (``NativeModel.forward``'s ``norm`` and ``act_mul``), in C,
    each op's output in a buffer of this object's own per input shape and dtype, overwritten by the op's next
    call. Safe where every output is consumed before the same op runs again: the forward hands each to the
    next matmul, which returns a tensor of its own (never with ``hidden=True``, which returns the final norm's
    output). ``lib``: what ``load_ops`` returned."""

    def __init__(self, lib: ctypes.CDLL, eps: float, num_threads: int | None = None) -> None:
        self.lib, self.eps, self.threads = lib, float(eps), _threads(num_threads)
        self.buffers: dict[tuple, torch.Tensor] = {}

    def _out(self, key: tuple, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        out = self.buffers.get(key)
        if out is None:
            out = self.buffers[key] = like.new_empty(shape)
        return out

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``NativeModel.rms_norm`` in one C call (within ~1 ulp of fp32 in the scale: the sum of squares runs
        in another order). x: [..., n] (float32 or bfloat16, CPU); w: [n], same dtype -> [..., n]."""
        x = x.contiguous()
        n = x.shape[-1]
        _check(w.shape == (n,) and w.dtype == x.dtype and w.is_contiguous() and x.is_cpu and w.is_cpu,
               f"weight {tuple(w.shape)} {w.dtype} for x [..., {n}] {x.dtype}")
        out = self._out(("norm", x.shape, x.dtype), x, x.shape)
        getattr(self.lib, _RMS_NORM[x.dtype])(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // n, n,
                                              self.eps, self.threads)
        return out

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused gate/up projection in one C call (within ~1 ulp of torch's exp).
        gate_up: [..., 2 * n] (gate, then up) -> [..., n]."""
        gate_up = gate_up.contiguous()
        _check(gate_up.shape[-1] % 2 == 0 and gate_up.is_cpu, f"gate_up {tuple(gate_up.shape)}")
        n = gate_up.shape[-1] // 2
        out = self._out(("act", gate_up.shape, gate_up.dtype), gate_up, (*gate_up.shape[:-1], n))
        getattr(self.lib, _SILU_MUL[gate_up.dtype])(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n),
                                                    n, self.threads)
        return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, eps: float,
             num_threads: int | None = None) -> torch.Tensor:
    """``StepOps.norm`` into a fresh tensor."""
    return StepOps(lib, eps, num_threads).norm(x, w)


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``StepOps.act_mul`` into a fresh tensor."""
    return StepOps(lib, 0.0, num_threads).act_mul(gate_up)


class RopeKV:
    """One decode step's RoPE and KV write, layer by layer, bit-identical to ``NativeModel.rope`` followed by
    ``attention.write_kv``. The step's arguments are checked once here, so that a layer's call checks only
    its own tensors (the checks guard raw-pointer writes; a position or slot out of range is checked in C,
    before anything is written, and raises). Each call returns q in this object's buffer, overwritten by the
    next call (the step's attention reads it before the next layer's call).

    cos/sin_rot: [P, D] tables; pos, slots: [B] int64; pool_shape: [2, NB + 1, bs, Hkv, D] of each layer's
    pool. ``lib``: what ``load_ops`` returned."""

    def __init__(self, lib: ctypes.CDLL, cos: torch.Tensor, sin_rot: torch.Tensor, pos: torch.Tensor,
                 slots: torch.Tensor, num_heads: int, pool_shape: torch.Size, num_threads: int | None = None) -> None:
        B, Hkv, D = pos.shape[0], pool_shape[3], pool_shape[4]
        _check(cos.shape == sin_rot.shape and cos.shape[-1] == D and D % 2 == 0 and cos.dtype == sin_rot.dtype
               and cos.is_contiguous() and sin_rot.is_contiguous(), "RoPE tables must be [P, D], contiguous")
        _check(pos.shape == slots.shape == (B,) and pos.dtype == slots.dtype == torch.int64
               and pos.is_contiguous() and slots.is_contiguous(), "pos and slots must be [B] int64, contiguous")
        self.tensors = (cos, sin_rot, pos, slots)  # kept alive for the pointers below
        self.fn = getattr(lib, _ROPE_KV[cos.dtype])
        self.ptrs = (cos.data_ptr(), sin_rot.data_ptr(), pos.data_ptr(), slots.data_ptr())
        # rows split across threads must write distinct slots (padding rows of a static-shape step share
        # the trash slot): otherwise one thread, as before threading, so the last row's write wins
        threads = _threads(num_threads) if slots.unique().numel() == B else 1
        self.dims = (B, num_heads, Hkv, D, cos.shape[0], pool_shape[1] * pool_shape[2], threads)
        self.pool_shape, self.dtype = pool_shape, cos.dtype
        self.numel = B * (num_heads + 2 * Hkv) * D
        self.q = cos.new_empty(B, num_heads, D)

    def __call__(self, qkv: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """qkv: [B, 1, (H + 2 Hkv) * D] before RoPE; pool: one layer's [2, NB + 1, bs, Hkv, D] (written in
        place) -> q [B, H, D] after RoPE (this object's buffer)."""
        qkv = qkv.contiguous()
        _check(qkv.numel() == self.numel and qkv.dtype == pool.dtype == self.dtype and pool.shape == self.pool_shape
               and pool.is_contiguous() and qkv.is_cpu, f"qkv {tuple(qkv.shape)} vs the pool")
        cos, sin, pos, slots = self.ptrs
        kv_bytes = pool.stride(0) * pool.element_size()  # pool[1] starts this far after pool[0]
        bad = self.fn(qkv.data_ptr(), cos, sin, pos, slots, self.q.data_ptr(), pool.data_ptr(),
                      pool.data_ptr() + kv_bytes, *self.dims)
        _check(bad == 0, f"{bad} rows with a position or KV slot out of range")
        return self.q


def rope_kv(lib: ctypes.CDLL, qkv: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor, pos: torch.Tensor,
            slots: torch.Tensor, pool: torch.Tensor, num_heads: int, num_threads: int | None = None) -> torch.Tensor:
    """``RopeKV`` for one layer: qkv [B, 1, (H + 2 Hkv) * D] -> q [B, H, D], k and v written to ``pool``."""
    return RopeKV(lib, cos, sin_rot, pos, slots, num_heads, pool.shape, num_threads)(qkv, pool)


def argmax(lib: ctypes.CDLL, logits: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` in one C call, exactly (the first maximum; the first NaN if any), on fp32
    or bf16 logits [R, V] (bf16 needs no fp32 copy: the conversion keeps order) -> [R] int64."""
    logits = logits.contiguous()
    _check(logits.dim() == 2 and logits.shape[1] > 0 and logits.is_cpu, f"logits {tuple(logits.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    getattr(lib, _ARGMAX[logits.dtype])(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
                                        _threads(num_threads))
    return out
