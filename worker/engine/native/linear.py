"""Linear layers whose per-row result does not depend on the row count, on the fastest kernel that allows it.

**Batch invariance** (the default, ``auto``): a row's output must be the same bits whatever else is in the
matmul, or a request's tokens would depend on its neighbours. oneDNN with the weight prepacked gives a row the
same bits at every row count >= 2 in fp32 and bf16 (Zen 4, torch 2.13; at 1 row it takes another path, so a
single row is computed as two, the second dropped); MKL's fp32 ``F.linear`` does not. Not on every CPU: with
AMX, oneDNN's bf16 kernels change above 32 rows, so ``auto`` checks each weight shape once at load
(``invariant_block``: every row of every call of 2 to 64 rows against that row alone) and cuts larger calls
into blocks of the largest row count that held; there bf16 weights run on amx.py's kernel instead, invariant at
every row count. ``tests/test_batch_invariance.py`` checks every row of every row count of the engine's shapes.

On x86 CPUs torch's default ``F.linear`` leaves much of the machine unused at a decode step's row counts
(33 against oneDNN's 74 GFLOP/s on an AVX2 EPYC's lm_head shape at 32 rows). Other choices: ``fastest``
(measured per weight shape and row count at load: not batch-invariant, MKL and oneDNN differ in fp32),
``default`` (``F.linear`` everywhere) and ``onednn`` (the same as ``auto``). A missing oneDNN op, a non-CPU
device or a reorder that fails leaves the layer on ``F.linear``; bf16 where oneDNN has no bf16 kernel (x86
without AVX-512 or AVX-NE-CONVERT) runs in fp32 on oneDNN (``WidenedLinear``). docs/NATIVE_ENGINE.md: more.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from batchfleet.worker.engine.native import amx
from batchfleet.worker.engine.native.kernel_cache import KernelChoices, entry_key

log = logging.getLogger(__name__)

KERNELS = ("default", "onednn")
CHOICES = ("auto", "fastest", *KERNELS)
# row counts measured at load (decode: rows = sequences; prefill: tokens); others take the nearest (log scale)
PROBE_ROWS = (1, 4, 16, 64, 256, 1024)
PROBE_MAX_FLOP = 2e9  # skip probes costlier than this (larger row counts take the largest probe's choice)
PROBE_REPS = 3  # timed calls per (kernel, rows) after one warm-up; the minimum is kept (noise only adds)
_MAX_BITS = 64
BLOCK_PROBE_ROWS = 64  # invariant_block checks every call of 2 .. this many rows
# what this process measured (a second engine reuses it), where the worker passes no KernelChoices of its own
_PROCESS_CHOICES: list[KernelChoices] = []


def process_choices() -> KernelChoices:
    if not _PROCESS_CHOICES:
        _PROCESS_CHOICES.append(KernelChoices())
    return _PROCESS_CHOICES[0]


def valid_block(value: object) -> bool:
    """What ``invariant_block`` returns: None, or a row count 1 .. BLOCK_PROBE_ROWS - 1."""
    return value is None or (type(value) is int and 1 <= value < BLOCK_PROBE_ROWS)


def onednn_available() -> bool:
    """Whether this torch has the oneDNN linear ops (CPU builds with MKLDNN)."""
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def prepack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``w`` [out, in], or None where it cannot be made here."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return None
    try:
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
    except RuntimeError as exc:  # e.g. bf16 without avx512bw/vl/dq or avx_ne_convert
        log.info("oneDNN prepack unavailable for %s %s: %s", tuple(w.shape), w.dtype, exc)
        return None


@dataclass
class Plan:
    """The kernel chosen for each row-count bucket of one weight shape, and what was measured."""

    by_probe: dict[int, str]  # probe rows -> kernel
    gflops: dict[int, dict[str, float]] = field(default_factory=dict)  # probe rows -> kernel -> GFLOP/s

    def to_json(self) -> dict:
        return {"by_probe": {str(r): k for r, k in self.by_probe.items()},
                "gflops": {str(r): g for r, g in self.gflops.items()}}

    @staticmethod
    def from_json(doc: dict) -> Plan:
        """The plan ``to_json`` wrote; ValueError (or TypeError, KeyError) for anything else."""
        by_probe = {int(r): k for r, k in doc["by_probe"].items()}
        if not by_probe or not set(by_probe) <= set(PROBE_ROWS) or not set(by_probe.values()) <= set(KERNELS):
            raise ValueError(f"not a plan: {doc!r}")
        return Plan(by_probe, {int(r): dict(g) for r, g in doc.get("gflops", {}).items()})

    def table(self) -> list[str]:
        """Kernel per ``rows.bit_length()`` (index 0..64): the nearest probe in log scale."""
        probes = sorted(self.by_probe)
        out = []
        for bits in range(_MAX_BITS + 1):
            mid = 2 ** max(bits - 1, 0) * 1.5 if bits else 1  # middle of [2^(bits-1), 2^bits)
            nearest = min(probes, key=lambda p: abs(math.log2(p / mid)))
            out.append(self.by_probe[nearest])
        return out


def best_times(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Minimum seconds of each of ``fns`` over ``reps`` rounds (interleaved, so a burst of load elsewhere
    hits every candidate alike), after one warm-up call each."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


@torch.inference_mode()
def measure(w: torch.Tensor, packed: torch.Tensor, rows: Iterable[int] = PROBE_ROWS,
            reps: int = PROBE_REPS) -> Plan:
    """Time ``default`` against ``onednn`` for ``w`` [out, in] at each probe row count; return the faster
    per row count (with the GFLOP/s each reached)."""
    n_out, n_in = w.shape
    by_probe: dict[int, str] = {}
    gflops: dict[int, dict[str, float]] = {}
    for r in rows:
        flop = 2.0 * r * n_in * n_out
        if by_probe and flop > PROBE_MAX_FLOP:
            break
        x = torch.randn(r, n_in, dtype=w.dtype, device=w.device)
        t_def, t_one = best_times([partial(F.linear, x, w),
                                    partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")],
                                   reps)
        by_probe[r] = "onednn" if t_one < t_def else "default"
        gflops[r] = {"default": round(flop / t_def / 1e9, 1), "onednn": round(flop / t_one / 1e9, 1)}
    return Plan(by_probe, gflops)


class Linear:
    """``y = x @ weight.T + bias`` on the kernel chosen for ``x``'s row count. x: [..., in] -> [..., out].
    ``block``: at most this many rows per kernel call (None: any), so that a row's bits do not depend on the
    row count where the kernel's do (``invariant_block``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan | None = None,
                 packed: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias  # [out, in], [out]
        self.packed = packed if plan is not None and "onednn" in plan.by_probe.values() else None
        self.plan = plan
        kinds = plan.table() if self.packed is not None else ["default"] * (_MAX_BITS + 1)
        self._fns: list[Callable[[torch.Tensor], torch.Tensor]] = [
            self._onednn if k == "onednn" else self._default for k in kinds]
        self._add_fns: list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = [
            self._onednn_add if k == "onednn" else self._default_add for k in kinds]
        self.n_in = weight.shape[1]
        self.block: int | None = None

    def _default(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _default_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(x, self.weight, self.bias)

    def _onednn_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # the residual add as oneDNN's binary post-op on the fp32 result: bit-identical to the add after the
        # matmul (tested), one pass over the output fewer
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.n_in
        if self.block is not None and rows > self.block:
            flat, b = x.reshape(rows, self.n_in), self.block
            return torch.cat([self(flat[s:s + b]) for s in range(0, rows, b)]).view(*x.shape[:-1], -1)
        if rows == 1:  # as one of two rows: the bits every other row count gives (module docstring)
            return self._fns[2](x.reshape(1, -1).expand(2, -1).contiguous())[:1].view(*x.shape[:-1], -1)
        return self._fns[rows.bit_length()](x)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; residual: [..., out], contiguous, same leading shape as x."""
        rows = x.numel() // self.n_in
        if self.block is not None and rows > self.block:
            flat, res, b = x.reshape(rows, self.n_in), residual.reshape(rows, -1), self.block
            return torch.cat([self.add_to(flat[s:s + b], res[s:s + b]) for s in range(0, rows, b)]).view(
                residual.shape)
        if rows == 1:
            two = self._add_fns[2](x.reshape(1, -1).expand(2, -1).contiguous(),
                                   residual.reshape(1, -1).expand(2, -1).contiguous())
            return two[:1].view(residual.shape)
        return self._add_fns[rows.bit_length()](x, residual)

    def kernel_for(self, rows: int) -> str:
        """Which kernel runs ``rows`` rows."""
        return "onednn" if self._fns[max(rows, 2).bit_length()] == self._onednn else "default"


class WidenedLinear(Linear):
    """A bf16 layer whose matmuls run in fp32 on oneDNN (``packed``: the weight widened, prepacked), for CPUs
    where oneDNN has no bf16 kernel and torch's is scalar (AVX2 EPYC: 18-21 against 76-116 GFLOP/s at 32 rows).
    A bf16 GEMM's arithmetic is fp32 anyway (bf16 products are exact in fp32, the output is rounded once), so
    this is one with another summation order. Memory: the packed fp32 copy, 2x the bf16 weight's bytes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> None:
        super().__init__(weight, bias, Plan(dict.fromkeys(PROBE_ROWS, "onednn")), packed)
        self.bias32 = None if bias is None else bias.float()

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias32, "none", [], "").to(x.dtype)

    def _onednn_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self._onednn(x)  # as bf16's default kernel: the matmul rounded, then a bf16 add


@torch.inference_mode()
def invariant_block(lin: Linear | amx.AmxLinear, rows: int = BLOCK_PROBE_ROWS) -> int | None:
    """None when every row of every call of 2 .. ``rows`` rows of ``lin`` is the bits that row gets alone (as
    one of two rows, as ``Linear`` computes a single row); else the largest m for which calls of 2 .. m rows
    are (1: none is; each row is then computed alone). A fixed random input; the plain calls and ``add_to``'s
    fused residual add both checked."""
    g = torch.Generator().manual_seed(0)
    dtype = lin.weight.dtype
    x = torch.randn(rows, lin.n_in, generator=g).to(dtype)
    res = torch.randn(rows, lin.weight.shape[0], generator=g).to(dtype)
    alone = torch.cat([lin(x[j:j + 1]) for j in range(rows)])
    alone_add = torch.cat([lin.add_to(x[j:j + 1], res[j:j + 1]) for j in range(rows)])
    for m in range(2, rows + 1):
        if not (torch.equal(lin(x[:m]), alone[:m]) and torch.equal(lin.add_to(x[:m], res[:m]), alone_add[:m])):
            return m - 1
    return None


class LinearFactory:
    """Builds ``Linear`` layers, measuring each distinct (out, in, dtype) shape once.

    choice: ``auto`` or ``onednn`` (prepacked everywhere it can be, default where it cannot: batch-invariant),
    ``fastest`` (measure per shape and row count) or ``default`` (F.linear everywhere).
    ``choices``: where measurements are looked up first and kept (kernel_cache.py; default: this process's)."""

    def __init__(self, choice: str = "auto", choices: KernelChoices | None = None) -> None:
        if choice not in CHOICES:
            raise ValueError(f"linear kernel must be one of {CHOICES}, not {choice!r}")
        self.choice = choice
        self.choices = choices if choices is not None else process_choices()
        self.plans: dict[tuple[int, int, str], Plan | None] = {}  # None: default only (no oneDNN here)
        self.blocks: dict[tuple[int, int, str], int | None] = {}  # auto/onednn: rows per call (invariant_block)
        self.seconds = 0.0  # spent measuring

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear | amx.AmxLinear:
        if self.choice == "default":
            return Linear(weight, bias)
        if self.choice == "auto" and (tiled := self._amx(weight, bias)) is not None:
            return tiled
        packed = prepack(weight)
        key = (weight.shape[0], weight.shape[1], str(weight.dtype).removeprefix("torch."))
        if packed is None:
            # bf16 where oneDNN has no bf16 kernel: fp32 on oneDNN (widened only where it could run there)
            widen = weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and onednn_available()
            p32 = prepack(weight.float()) if widen else None
            wide = None if p32 is None else WidenedLinear(weight, bias, p32)
            self.plans.setdefault(key, None if wide is None else wide.plan)
            return self._blocked(key, wide or Linear(weight, bias))
        if key not in self.plans:
            if self.choice in ("auto", "onednn"):
                self.plans[key] = Plan({r: "onednn" for r in PROBE_ROWS})
            else:
                self.plans[key] = self._plan(key, weight, packed)
        return self._blocked(key, Linear(weight, bias, self.plans[key], packed))

    def _amx(self, weight: torch.Tensor, bias: torch.Tensor | None) -> amx.AmxLinear | None:
        """The AMX kernel's layer (amx.py: bf16 on CPUs with AMX, invariant at every row count), checked once per
        shape like ``_blocked`` checks oneDNN's; None where it cannot run here."""
        if not amx.fits(weight, bias) or (lib := amx.library()) is None:
            return None
        key = (weight.shape[0], weight.shape[1], "bfloat16")
        lin = amx.AmxLinear(weight, lib)
        # never seen: the sums do not depend on the row count by construction
        if self._block(f"block-{amx.KERNEL}", key, lin) is not None:
            log.warning("AMX linear %s: rows change with the row count; oneDNN instead", key)
            return None
        self.plans[key], self.blocks[key] = Plan({r: amx.KERNEL for r in PROBE_ROWS}), None
        return lin

    def _blocked(self, key: tuple[int, int, str], lin: Linear) -> Linear:
        """``lin`` with its rows per call, where batch invariance is asked for (auto, onednn) on the CPU."""
        if self.choice not in ("auto", "onednn") or lin.weight.device.type != "cpu":
            return lin
        lin.block = self.blocks[key] = self._block("block", key, lin)
        return lin

    def _block(self, kind: str, key: tuple[int, int, str], lin: Linear | amx.AmxLinear) -> int | None:
        """``invariant_block(lin)``, measured once per shape and thread count (then found in ``choices``)."""
        name = entry_key(kind, *key, torch.get_num_threads())
        found, block = self.choices.get(name, valid_block)
        if not found:
            t = time.perf_counter()
            block = invariant_block(lin)
            self.seconds += time.perf_counter() - t
            self.choices.measured += 1
            self.choices.put(name, block)
            if block is not None:
                log.info("weight %s: a row's bits change with the row count above %d rows here; calls cut into "
                         "blocks of %d rows (batch invariance)", key, block, block)
        return block

    def _plan(self, key: tuple[int, int, str], weight: torch.Tensor, packed: torch.Tensor) -> Plan:
        """``measure``'s plan for ``fastest``, measured once per shape and thread count (then found in ``choices``)."""
        name = entry_key("plan", *key, torch.get_num_threads())
        found, doc = self.choices.get(name, Plan.from_json)
        if found:
            return Plan.from_json(doc)
        t = time.perf_counter()
        plan = measure(weight, packed)
        self.seconds += time.perf_counter() - t
        self.choices.measured += 1
        self.choices.put(name, plan.to_json())
        return plan

    def describe(self) -> dict[str, str]:
        """Per shape ``"in->out dtype"``: the kernel per probed row count, e.g. ``"1:default 4:onednn ..."``."""
        out = {}
        for (n_out, n_in, dt), plan in sorted(self.plans.items()):
            name = f"{n_in}->{n_out} {dt}"
            out[name] = "default" if plan is None else " ".join(f"{r}:{k}" for r, k in sorted(plan.by_probe.items()))
            if self.blocks.get((n_out, n_in, dt)) is not None:
                out[name] += f" (at most {self.blocks[(n_out, n_in, dt)]} rows per call)"
        return out
