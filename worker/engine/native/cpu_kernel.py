"""Build (once, cached) and call the C kernels of a CPU decode step: paged decode attention
(``paged_decode.c``) and the small ops (``decode_ops.c``: RMSNorm, RoPE + KV write, SiLU * up, argmax).

The kernel reads K/V in place from the block pool, so a decode step never copies the cache. It is a
plain C shared library built with the system C compiler in about a second and called through ctypes
(no torch headers, no torch.compile). It links the libgomp torch already loaded (same soname), so
there is one OpenMP runtime. If no compiler is found or the build fails, ``load()`` returns None and
the runner falls back to gather + SDPA (and ``load_ops()`` to the torch ops). Disable both with
``--no-native-kernel`` (EngineConfig.native_kernel).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import torch

from batchfleet.worker.engine.native.attention import write_kv

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros"]
_DTYPES = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
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


DEFAULT_KERNEL_DIR = Path("~/.cache/batchfleet/kernels")


def _cpu_key() -> str:
    try:  # -march=native: a library is only valid for the CPU flags it was built for
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags


def _build(source: Path, flags: list[str], kernel_dir: Path) -> ctypes.CDLL | None:
    """``source`` compiled with ``flags`` into ``kernel_dir`` (once: the file name hashes the source and the
    headers beside it, the flags and this CPU's flags) and loaded; None when no compiler is found or the
    build fails."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: %s unavailable", source.name)
        return None
    digest = hashlib.sha256()
    # the headers beside the source (bf16.h, the kernel's SIMD paths) are part of what is compiled; each
    # file hashed with its name and length, so moving text between files changes the key
    for f in [source, *sorted(source.parent.glob("*.h"))]:
        data = f.read_bytes()
        digest.update(f"{f.name}\0{len(data)}\0".encode() + data)
    digest.update(" ".join(flags).encode() + _cpu_key().encode())
    key = digest.hexdigest()[:16]
    target = Path(kernel_dir).expanduser() / f"{source.stem}-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
            os.close(fd)
            try:
                subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                               timeout=120)
                os.replace(tmp, target)  # atomic: concurrent workers never load a half-written file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable (%s)", source.name, exc)
        return None


def _declare(lib: ctypes.CDLL, names: Iterable[str], restype: type | None, argtypes: list[type]) -> None:
    """Give the C functions ``names`` of ``lib`` their return and argument types (ctypes converts calls)."""
    for name in names:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


@lru_cache(maxsize=4)
def load(kernel_dir: Path = DEFAULT_KERNEL_DIR) -> ctypes.CDLL | None:
    """The compiled kernel library, built into ``kernel_dir`` on first use; None when unavailable (the
    runner then falls back to gather + SDPA)."""
    lib = _build(SOURCE, CFLAGS, kernel_dir)
    if lib is None:
        return None
    _declare(lib, _DTYPES.values(), ctypes.c_int,
             [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
    _declare(lib, ["paged_decode_isa"], ctypes.c_char_p, [ctypes.c_int] * 3)
    _declare(lib, ["paged_decode_set_isa"], None, [ctypes.c_int])
    _declare(lib, ["paged_decode_init"], ctypes.c_int, [])
    lib.paged_decode_init()  # the AMX path, where built, once this process may use AMX tile data (Linux >= 5.16)
    return lib


@lru_cache(maxsize=4)
def load_ops(kernel_dir: Path = DEFAULT_KERNEL_DIR) -> ctypes.CDLL | None:
    """The decode step's small ops (``decode_ops.c``: RMSNorm, RoPE + KV write, SiLU * up, argmax), built
    like ``load``; None when unavailable (the forward then runs them as torch ops)."""
    # a compiler without OpenMP: the same ops on the calling thread (same bits; the pragmas are ignored)
    lib = _build(OPS_SOURCE, OPS_CFLAGS, kernel_dir) or _build(
        OPS_SOURCE, [f for f in OPS_CFLAGS if f != "-fopenmp"], kernel_dir)
    if lib is None:
        return None
    # the last argument of each: threads (rows split across them above a size; results never depend on it)
    _declare(lib, _ROPE_KV.values(), ctypes.c_int,
             [ctypes.c_void_p] * 8 + [ctypes.c_int] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int])
    _declare(lib, _RMS_NORM.values(), None, [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int])
    _declare(lib, [*_SILU_MUL.values(), *_ARGMAX.values()], None, [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3)
    return lib


# the cap levels, and the level of each path ``isa`` names ("avx512bf16" is bf16's AVX-512 path); TOP_LEVEL:
# no cap (the default: everything this CPU and build have)
ISA_LEVELS = {"portable": 0, "avx2": 1, "avx512": 2, "amx": 3}
PATH_LEVELS = {**ISA_LEVELS, "avx512bf16": 2}
TOP_LEVEL = "amx"


def isa(lib: ctypes.CDLL, dtype: torch.dtype, head_dim: int = 64, group: int = 1) -> str:
    """The instruction-set path the kernel takes here for ``dtype``, ``head_dim`` and ``group`` query heads per
    KV head: "amx" (bf16, 4 <= group <= 16, head_dim % 64 == 0 and <= 256, on CPUs with AMX-BF16 whose kernel grants
    this process the tile data), "avx512bf16" (bf16 on CPUs with AVX512-BF16),
    "avx512" (fp32 on CPUs with AVX512F; the build is -march=native), "avx2" (AVX2 + FMA, checked at runtime) or
    "portable" (the plain C loop)."""
    return lib.paged_decode_isa(int(dtype == torch.bfloat16), head_dim, group).decode()


def set_isa(lib: ctypes.CDLL, level: str) -> None:
    """Cap the path the kernel may take (process-wide, for tests and benchmarks): one of ``ISA_LEVELS``.
    A path the CPU lacks is never taken whatever the cap."""
    lib.paged_decode_set_isa(ISA_LEVELS[level])


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernel handles this dtype."""
    return dtype in _DTYPES


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                 scale: float, num_threads: int) -> torch.Tensor:
    """q: [B, H, D] contiguous; pool: [2, NB + 1, bs, Hkv, D]; tables: [B, M] int64; ctx: [B] int64
    -> out [B, H, D]. All on CPU, contiguous. ``lib``: what ``load`` returned."""
    assert q.is_contiguous() and pool.is_contiguous()
    assert tables.dtype == torch.int64 and ctx.dtype == torch.int64 and tables.is_contiguous()
    B, H, D = q.shape
    bs, Hkv = pool.shape[2], pool.shape[3]
    out = torch.empty_like(q)
    # enough work items for every thread: whole sequences when the batch is big, else head by head
    hc = Hkv if B >= 4 * num_threads else 1
    fn = getattr(lib, _DTYPES[q.dtype])
    failed = fn(q.data_ptr(), pool[0].data_ptr(), pool[1].data_ptr(), tables.data_ptr(), ctx.data_ptr(),
                out.data_ptr(), B, H, Hkv, D, bs, tables.shape[1], float(scale), hc, int(num_threads))
    if failed:
        raise MemoryError(f"paged decode kernel: {failed} work items could not allocate scratch memory")
    return out


def prefill_attention(lib: ctypes.CDLL, kv: torch.Tensor, block_tables: list[list[int]], lens: list[int],
                      positions: torch.Tensor, slots: torch.Tensor, trash: int, scale: float, num_threads: int):
    """Packed prefill attention as decode computes it (batch invariance): every prompt token is one query
    of the paged kernel, reading the K/V of positions [0, its own] from the pool, so a token gets the same
    bits whether it is computed in a prefill (any chunk boundary, any prefix-cache hit, any neighbours) or
    in a decode step (a preempted sequence's recompute). kv: [L, 2, NB + 1, bs, Hkv, D]; chunk b has
    ``lens[b]`` tokens of the sequence with ``block_tables[b]``; positions, slots: [N] -> the ``AttnFn``."""
    width = max(len(t) for t in block_tables)
    rows = torch.tensor([t + [trash] * (width - len(t)) for t in block_tables])  # [B, width]
    tables = rows.repeat_interleave(torch.tensor(lens), dim=0)  # [N, width]: each token its sequence's row
    ctx = (positions + 1).contiguous()  # [N] keys each query sees, itself included

    def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, N, H, D]; k, v: [1, N, Hkv, D]: every chunk's K/V written before any query reads the pool
        write_kv(kv[i], slots, k[0], v[0])
        return paged_decode(lib, q[0].contiguous(), kv[i], tables, ctx, scale, num_threads).view(1, q.shape[1], -1)

    return attn


def _threads(num_threads: int | None) -> int:
    """Threads for a small op (default: torch's intra-op count). Each op splits rows across them only above
    a size and computes every element as on one thread, so results never depend on this."""
    n = int(num_threads) if num_threads is not None else torch.get_num_threads()
    _check(n >= 1, f"num_threads must be >= 1, not {n}")  # OpenMP would read -1 as ~4e9 threads
    return n


def _check(ok: bool, what: str) -> None:
    if not ok:  # not assert: these guard raw-pointer writes, also under python -O
        raise ValueError(f"decode_ops: {what}")


class RopeKV:
    """One decode step's RoPE and KV write, layer by layer, bit-identical to ``NativeModel.rope`` followed by
    ``attention.write_kv``. The step's arguments are checked once here, so that a layer's call checks only
    its own tensors (the checks guard raw-pointer writes; a position or slot out of range is checked in C,
    before anything is written, and raises).

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

    def __call__(self, qkv: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """qkv: [B, 1, (H + 2 Hkv) * D] before RoPE; pool: one layer's [2, NB + 1, bs, Hkv, D] (written in
        place) -> q [B, H, D] after RoPE."""
        qkv = qkv.contiguous()
        _check(qkv.numel() == self.numel and qkv.dtype == pool.dtype == self.dtype and pool.shape == self.pool_shape
               and pool.is_contiguous() and qkv.device.type == "cpu", f"qkv {tuple(qkv.shape)} vs the pool")
        B, H, _, D = self.dims[:4]
        q = qkv.new_empty(B, H, D)
        cos, sin, pos, slots = self.ptrs
        bad = self.fn(qkv.data_ptr(), cos, sin, pos, slots, q.data_ptr(), pool[0].data_ptr(), pool[1].data_ptr(),
                      *self.dims)
        _check(bad == 0, f"{bad} rows with a position or KV slot out of range")
        return q


def rope_kv(lib: ctypes.CDLL, qkv: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor, pos: torch.Tensor,
            slots: torch.Tensor, pool: torch.Tensor, num_heads: int, num_threads: int | None = None) -> torch.Tensor:
    """``RopeKV`` for one layer: qkv [B, 1, (H + 2 Hkv) * D] -> q [B, H, D], k and v written to ``pool``."""
    return RopeKV(lib, cos, sin_rot, pos, slots, num_heads, pool.shape, num_threads)(qkv, pool)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, eps: float,
             num_threads: int | None = None) -> torch.Tensor:
    """``NativeModel.rms_norm`` in one C call (within ~1 ulp of fp32 in the scale: the sum of squares runs in
    another order). x: [..., n] (float32 or bfloat16, CPU); w: [n], same dtype -> [..., n]. ``lib``: what
    ``load_ops`` returned."""
    x = x.contiguous()
    n = x.shape[-1]
    _check(w.shape == (n,) and w.dtype == x.dtype and w.is_contiguous() and x.device.type == w.device.type == "cpu",
           f"weight {tuple(w.shape)} {w.dtype} for x [..., {n}] {x.dtype}")
    out = torch.empty_like(x)
    getattr(lib, _RMS_NORM[x.dtype])(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
                                     _threads(num_threads))
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up projection in one C call (within ~1 ulp of torch's exp).
    gate_up: [..., 2 * n] (gate, then up) -> [..., n]. ``lib``: what ``load_ops`` returned."""
    gate_up = gate_up.contiguous()
    _check(gate_up.shape[-1] % 2 == 0 and gate_up.device.type == "cpu", f"gate_up {tuple(gate_up.shape)}")
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    getattr(lib, _SILU_MUL[gate_up.dtype])(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n,
                                           _threads(num_threads))
    return out


def argmax(lib: ctypes.CDLL, logits: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` in one C call, exactly (the first maximum; the first NaN if any), on fp32
    or bf16 logits [R, V] (bf16 needs no fp32 copy: the conversion keeps order) -> [R] int64."""
    logits = logits.contiguous()
    _check(logits.dim() == 2 and logits.shape[1] > 0 and logits.device.type == "cpu", f"logits {tuple(logits.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    getattr(lib, _ARGMAX[logits.dtype])(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
                                 _threads(num_threads))
    return out
