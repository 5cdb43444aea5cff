"""bf16 weight matmuls on AMX tiles (``amx_linear.c``), the ``auto`` linear kernel on CPUs with AMX-BF16.

oneDNN's bf16 kernels on AMX give a row other bits in calls of more than 32 rows (linear.py), so batch
invariance cut every larger call into 32-row blocks, at a third of oneDNN's speed on a prefill's rows. This
kernel sums each output element in one fixed order whatever the row count, so one call of any size is
batch-invariant by construction, and it is faster than oneDNN at a decode step's 8-32 rows as well
(docs/BENCHMARKS_HISTORY.md section 13h). It replaces oneDNN only where it can run: a CPU tensor in bf16, no bias,
both dimensions multiples of 32, a CPU with AMX-BF16 whose kernel grants the tile data (Linux >= 5.16) and a C
compiler; anything else stays on linear.py's kernels.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch

from batchfleet.worker.engine.native import cpu_kernel

log = logging.getLogger(__name__)

KERNEL = "amx"
SOURCE = Path(__file__).with_name("amx_linear.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]  # integer and tile ops: no FP flags matter
TILE = 32  # both dimensions of a weight must be multiples of this (a 16 x 32 tile pair per step)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built kernel with the tile permission granted to this process; None where AMX cannot run."""
    flags = cpu_kernel._cpu_key().split()
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(flags):
        return None
    lib = cpu_kernel._build(SOURCE, CFLAGS, cpu_kernel.DEFAULT_KERNEL_DIR)
    if lib is None:
        return None
    cpu_kernel._declare(lib, ["amx_init"], ctypes.c_int, [])
    cpu_kernel._declare(lib, ["amx_pack"], None, [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2)
    cpu_kernel._declare(lib, ["amx_linear"], ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4)
    if lib.amx_init() != 0:
        log.info("AMX tile data not granted by this kernel: bf16 matmuls stay on oneDNN")
        return None
    return lib


def fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this kernel can run ``weight`` [out, in] (and then ``library()`` says whether this CPU can)."""
    return (bias is None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % TILE == 0 and weight.shape[1] % TILE == 0)


class AmxLinear:
    """``y = x @ weight.T`` on AMX tiles at every row count, with linear.Linear's interface (``block`` None: one
    call of any size is invariant). x: [..., in] -> [..., out], bf16."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL) -> None:
        self.weight, self.bias, self.block, self.lib = weight, None, None, lib
        self.n_out, self.n_in = weight.shape
        w = weight.detach().contiguous()
        self.packed = torch.empty(self.n_out * self.n_in, dtype=torch.bfloat16)  # [out/16][in/32][16][32]: tiles
        lib.amx_pack(w.data_ptr(), self.packed.data_ptr(), self.n_out, self.n_in)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or (residual is not None and residual.dtype != torch.bfloat16):
            raise TypeError(f"AMX linear takes bf16 inputs, not {x.dtype}")  # the C side reads raw bf16
        flat = x.reshape(-1, self.n_in).contiguous()
        out = torch.empty(flat.shape[0], self.n_out, dtype=torch.bfloat16)
        if flat.shape[0]:
            res = None if residual is None else residual.reshape(flat.shape[0], self.n_out).contiguous()
            if self.lib.amx_linear(flat.data_ptr(), self.packed.data_ptr(), None if res is None else res.data_ptr(),
                                   out.data_ptr(), flat.shape[0], self.n_out, self.n_in, torch.get_num_threads()):
                raise MemoryError("AMX linear: no memory for the last rows' padded tile")
        return out.view(*x.shape[:-1], self.n_out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, rounded as torch adds two bf16 tensors."""
        return self._run(x, residual)

    def kernel_for(self, rows: int) -> str:
        return KERNEL
