"""Build (once, cached) and call the C decode attention kernel of a CPU step (``paged_decode.c``); the build
is shared with the step's small ops (``small_ops.py``) and the AMX matmuls (``amx.py``).

The kernel reads K/V in place from the block pool, so a decode step never copies the cache. It is a
plain C shared library built with the system C compiler in about a second and called through ctypes
(no torch headers, no torch.compile). It links the libgomp torch already loaded (same soname), so
there is one OpenMP runtime. If no compiler is found or the build fails, ``load()`` returns None and
the runner falls back to gather + SDPA (and ``small_ops.load_ops()`` to the torch ops). Disable both with
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

from batchfleet.common.startup import PHASES
from batchfleet.worker.engine.native.attention import write_kv

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros"]
_DTYPES = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


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
            with PHASES.phase("compile", "compiling %s for this CPU (once; kept in %s)", source.name, target.parent):
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
                 scale: float, num_threads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D] contiguous; pool: [2, NB + 1, bs, Hkv, D]; tables: [B, M] int64; ctx: [B] int64
    -> out [B, H, D] (written into ``out`` where given: a decode step reuses one buffer layer after layer).
    All on CPU, contiguous. ``lib``: what ``load`` returned."""
    assert q.is_contiguous() and pool.is_contiguous()
    assert tables.dtype == torch.int64 and ctx.dtype == torch.int64 and tables.is_contiguous()
    B, H, D = q.shape
    bs, Hkv = pool.shape[2], pool.shape[3]
    if out is None:
        out = torch.empty_like(q)
    elif (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or not out.is_cpu
          or out.data_ptr() == q.data_ptr()):  # the kernel reads q while it writes out
        raise ValueError(f"paged decode: out {tuple(out.shape)} {out.dtype} for q {tuple(q.shape)} {q.dtype}")
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
