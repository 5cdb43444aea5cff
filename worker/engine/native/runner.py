"""The model runner: owns the KV pool and every tensor; turns a ScheduledBatch into sampled tokens."""

from __future__ import annotations

import logging
import math
from array import array
from functools import partial
from pathlib import Path

import torch

from batchfleet.worker.engine.native import attention as A
from batchfleet.worker.engine.native import cpu_kernel, hugepages, invariance, memlimit, small_ops
from batchfleet.worker.engine.native.block_manager import blocks_for
from batchfleet.worker.engine.native.graphs import (
    MODES,
    CaptureFailed,
    DecodeGraphs,
    DeviceCapture,
    StepInputs,
    eager_capture,
    graph_module,
)
from batchfleet.worker.engine.native.linear import LinearFactory
from batchfleet.worker.engine.native.model import NativeModel
from batchfleet.worker.engine.native.step import ScheduledBatch
from batchfleet.worker.engine.sampling import sample, token_logprobs

log = logging.getLogger(__name__)

FREE_MEMORY_FRACTION = 0.5  # of free device memory for the pool when kv_cache_gb is not given


def _int64(values: list[int], *shape: int) -> torch.Tensor:
    """CPU int64 ``values`` in ``shape`` via ``array``: 27 us for a step's 32 x 21 block tables (torch.tensor: 130)."""
    flat = torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)
    return flat.view(*shape)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` (on CPU: MemAvailable, capped by the container's cgroup limit)."""
    if device.type == "cpu":
        return memlimit.available_bytes()
    mod = getattr(torch, device.type)
    free, _total = mod.mem_get_info(device)
    return int(free)


def _precomputed(logits: torch.Tensor, greedy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, taken from ``greedy`` (the graph's argmax of ``logits``) when ``x`` is those logits."""
    return greedy.clone() if x is logits else x.argmax(dim=-1)


class ModelRunner:
    """Runs prefill and decode steps of the engine's own forward over a paged KV pool."""

    def __init__(self, hf_model: torch.nn.Module, block_size: int, max_batch_size: int, max_seq_len: int,
                 kv_cache_gb: float | None = None, buckets: tuple[int, ...] = (), padding: str = "bucket",
                 num_blocks: int | None = None, prefill: str = "auto", decode: str = "auto",
                 kernel_dir: Path | None = cpu_kernel.DEFAULT_KERNEL_DIR, static_decode: bool | None = None,
                 linear: str | LinearFactory = "auto", graph: str = "auto", batch_invariant: bool = False) -> None:
        """prefill: "padded" (per ``padding``), "packed" (varlen) or "auto" (packed on CPU);
        decode: "kernel" (C kernel, CPU), "gather" (gather + SDPA), "npu" or "auto";
        kernel_dir: where the C kernel is built (None: never use it);
        static_decode: pad decode steps to a few shapes (None: on CUDA/NPU, where a new shape recompiles);
        linear: the weight matmuls' kernel ("auto": measured per shape at load; see linear.py), or a LinearFactory;
        graph: decode steps through graphs.py: "captured" (CUDA graphs; NPU graphs through torch_npu), "eager" (the
        same padded buckets and persistent inputs, the capture replaced by a plain call: CPU tests), "off"
        (``--enforce-eager``) or "auto" (captured on CUDA and NPU where the decode path allows it, else off); a
        capture that fails turns the graphs off with a warning (that step and the later ones run eagerly);
        batch_invariant: on CUDA, the settings and fixed-row matmuls of invariance.py (CPU: already invariant)."""
        if graph not in MODES:
            raise ValueError(f"graph must be one of {MODES}, not {graph!r}")
        self.model = NativeModel(hf_model, max_positions=max_seq_len, linear=linear)
        self.batch_invariant = invariance.enable(self.model) if batch_invariant else False
        self.device, self.dtype = self.model.device, self.model.dtype
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.buckets = tuple(buckets)
        self.padding = padding
        m = self.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.bytes_per_block = 2 * m.num_layers * block_size * m.num_kv_heads * m.head_dim * elem
        self.num_blocks = num_blocks or self._size_pool(kv_cache_gb, max_batch_size, max_seq_len)
        self.trash_block = self.num_blocks  # the extra block padding writes to
        # kv: [L, 2, NB + 1, bs, Hkv, D]
        kv_shape = (m.num_layers, 2, self.num_blocks + 1, block_size, m.num_kv_heads, m.head_dim)
        self.kv = (hugepages.zeros(kv_shape, self.dtype) if self.device.type == "cpu"
                   else torch.zeros(kv_shape, device=self.device, dtype=self.dtype))
        cpu = self.device.type == "cpu"
        use_kernel = cpu and kernel_dir is not None and cpu_kernel.supports(self.dtype)
        self.kernel = cpu_kernel.load(Path(kernel_dir)) if use_kernel else None
        self.prefill_mode = ("packed" if cpu else "padded") if prefill == "auto" else prefill
        if decode == "auto":  # the torch paged attention on CUDA/NPU too: batch-invariant (npu: opt-in, untested)
            decode = "kernel" if self.kernel is not None else "gather"
        if decode == "kernel" and self.kernel is None:
            raise ValueError(f"the C decode kernel needs a CPU and float32/bfloat16, not {self.device}/{self.dtype}")
        if self.prefill_mode not in ("padded", "packed") or decode not in ("kernel", "gather", "npu"):
            raise ValueError(f"unknown prefill {prefill!r} or decode {decode!r} path")
        self.decode_mode = decode
        # without the C kernel: "paged" (A.paged_attention for prefill and decode: batch-invariant) or "sdpa"
        # (SDPA prefill, gather + SDPA decode: not batch-invariant; the earlier path, kept for benchmarks)
        self.attention = "paged"
        # RMSNorm, RoPE + KV write and SiLU * up of a decode step in C, beside the C attention kernel
        # (else the torch ops). They are the Llama block's ops: SUPPORTED_MODEL_TYPES keeps out models whose
        # block differs (qk-norm, other norms); another activation than SiLU keeps its torch op
        self.ops = small_ops.load_ops(Path(kernel_dir)) if decode == "kernel" else None
        self.c_silu = self.ops is not None and m.hidden_act == "silu"
        # decode buckets: rows and block-table width rounded up to powers of two, so a graph-compiled
        # device sees O(log(max_running) * log(max_blocks)) shapes; on CPU padding only costs (measured)
        self.static_decode = (not cpu) if static_decode is None else static_decode
        self.decode_shapes: set[tuple[int, int]] = set()  # (rows, table width) of every decode step run
        self.num_threads = torch.get_num_threads()  # read once; never changed here
        self.graphs = self._graphs(graph, max_batch_size)
        self.graph_failure: str | None = None  # why a capture failed, once graphs were turned off for it
        log.info("KV pool: %d blocks x %d slots (%.1f MiB); prefill %s, decode %s", self.num_blocks, block_size,
                 self.kv.numel() * elem / 2**20, self.prefill_mode, self.decode_mode)
        log.info("weight matmuls (measured in %.1f s): %s", m.linears.seconds, m.linears.describe())

    def describe(self) -> dict:
        """The kernels chosen at load, for the worker's status: weight matmuls per shape (kernel per
        probed row count), the decode attention path and where a decode step's small ops run (RMSNorm,
        RoPE + KV write, SiLU * up)."""
        attn = self.decode_mode
        if self.kernel is not None and attn == "kernel":
            m = self.model
            attn = f"kernel {cpu_kernel.isa(self.kernel, self.dtype, m.head_dim, m.num_heads // m.num_kv_heads)}"
        graphs = self.graphs and {"rows": list(self.graphs.sizes),  # buckets: rows x table width, captured so far
                                  "captured": [f"{b}x{w}" for b, w in sorted(list(self.graphs.buckets))]}
        return {"linear_kernels": self.model.linears.describe(), "decode_attention": attn,
                "decode_graphs": graphs or (f"off ({self.graph_failure})" if self.graph_failure else "off"),
                "batch_invariant": self.batch_invariant,
                "decode_small_ops": ("C: rms_norm rope_kv" + " silu_mul" * self.c_silu + " argmax") if self.ops
                else "torch"}

    def _size_pool(self, kv_cache_gb: float | None, max_batch_size: int, max_seq_len: int) -> int:
        if kv_cache_gb is not None:
            return max(1, int(kv_cache_gb * 2**30 // self.bytes_per_block))
        cap = max_batch_size * blocks_for(max_seq_len, self.block_size)
        fit = int(free_memory_bytes(self.device) * FREE_MEMORY_FRACTION // self.bytes_per_block)
        return max(1, min(cap, fit))

    # -- steps ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Compute one step for ``batch``; return one sampled token per ``batch.sampled`` sequence (and,
        for those that asked, append its logprobs entry to its StopChecker's, which the token then joins)."""
        # a step of partial prefill chunks only writes KV: logits [0, V], nothing sampled
        graphed = None
        if not batch.is_prefill and self.graphs is not None and self.graphs.fits(len(batch.seqs)):
            graphed = self._decode_graph(batch)  # fp32 [n, V], [n]: the step's argmax, from the graph (None: failed)
        if graphed is not None:
            logits, greedy = graphed
            # the graph's argmax where sample() takes the argmax of these logits (a grammar masks a copy)
            argmax = partial(_precomputed, logits, greedy)
        else:
            logits = self._prefill(batch) if batch.is_prefill else self._decode(batch)  # [len(sampled), V]
            argmax = None
            if self.ops is not None:  # loaded only for the CPU kernel decode path
                # exact in C on the model dtype: no fp32 copy of the logits (sampled rows and logprobs upcast
                # their own rows); 96 us at 32 x 32000 bf16 where torch's argmax takes 1.9 ms
                argmax = partial(small_ops.argmax, self.ops, num_threads=self.num_threads)
            else:
                logits = logits.float()  # like transformers' generate; argmax is also ~4x faster than on bf16
        payloads = [s.payload for s in batch.sampled]
        reqs = [p.req for p in payloads]
        tokens = sample(logits, reqs, [p.gen for p in payloads], [p.checker for p in payloads], argmax)
        for p, entry in zip(payloads, token_logprobs(logits, tokens, reqs)):
            if entry is not None:
                p.checker.logprobs.append(entry)
        return tokens.tolist()

    @torch.inference_mode()
    def hidden_states(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Embed requests' prefill, with no KV at all: the prompts back to back in one row (as a packed
        prefill), each attending causally to itself only, nothing written to the pool; the final-norm hidden
        state of every token of each prompt: [len(prompt), hidden] each."""
        m, dev = self.model, self.device
        lens = [len(p) for p in prompts]
        N = sum(lens)
        tokens = torch.tensor([t for p in prompts for t in p], device=dev).view(1, N)
        positions = torch.cat([torch.arange(n) for n in lens]).view(1, N).to(dev)

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return A.packed_prefill_attention(q, k, v, lens, m.scale)  # q: [1, N, H, D] -> [1, N, H * D]

        return list(m.forward(tokens, positions, attn, hidden=True).split(lens))  # [N, hidden] split

    def padded_len(self, longest: int) -> int:
        """Prefill length: the bucket holding the longest prompt ('bucket') or the longest ('longest')."""
        if self.padding == "bucket":
            for b in self.buckets:
                if b >= longest:
                    return b
            # a recomputed sequence longer than every bucket: a block multiple, within the RoPE table
            return min(math.ceil(longest / self.block_size) * self.block_size, self.max_seq_len)
        return longest

    def _prefill(self, batch: ScheduledBatch) -> torch.Tensor:
        whole = all(s.num_cached == 0 for s in batch.seqs) and len(batch.sampled) == len(batch.seqs)
        if self.prefill_mode == "padded" and whole:
            return self._prefill_padded(batch)
        return self._prefill_packed(batch)  # also every chunked prefill (it attends to cached KV)

    def _slots(self, seq, end: int | None = None) -> torch.Tensor:
        """Flat pool slots of tokens [0, end) of ``seq`` (default: all): [end] (on CPU)."""
        bs = self.block_size
        table = torch.tensor(seq.block_table)
        return (table[:, None] * bs + torch.arange(bs)).view(-1)[: len(seq) if end is None else end]

    def _prefill_packed(self, batch: ScheduledBatch) -> torch.Tensor:
        """Chunks back to back in one row: tokens [start, start + n) of each sequence (start = its
        ``num_cached``); a chunk with a cached prefix attends to it through the pool."""
        seqs, dev, m = batch.seqs, self.device, self.model
        starts, lens = [s.num_cached for s in seqs], batch.num_new
        N = sum(lens)
        tokens = torch.tensor([t for s, a, n in zip(seqs, starts, lens) for t in s.token_ids[a:a + n]],
                              device=dev).view(1, N)
        positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens)]).view(1, N).to(dev)
        upto = [self._slots(s, a + n) for s, a, n in zip(seqs, starts, lens)]  # prefix + chunk slots
        slots = torch.cat([u[a:] for u, a in zip(upto, starts)]).to(dev)  # [N]
        ends = torch.tensor(lens).cumsum(0).sub(1)  # flat index of each chunk's last token
        last = ends[[i for i, s in enumerate(seqs) if s in batch.sampled]].to(dev)
        if self.decode_mode == "kernel":
            attn = cpu_kernel.prefill_attention(self.kernel, self.kv, [s.block_table for s in seqs], lens,
                                                positions[0], slots, self.trash_block, m.scale, self.num_threads)
            return m.forward(tokens, positions, attn, last_idx=last, **self._c_ops())
        prefixes = [u.to(dev) if a else None for u, a in zip(upto, starts)]
        layout = self._layout(seqs, starts, lens)

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [1, N, H, D]; k, v: [1, N, Hkv, D]: every chunk's K/V written before any query reads the pool
            A.write_kv(self.kv[i], slots, k[0], v[0])
            if layout is not None:
                return A.paged_attention(q[0], self.kv[i], layout, m.scale).view(1, N, -1)
            return A.packed_prefill_attention(q, k, v, lens, m.scale, self.kv[i], prefixes)

        return m.forward(tokens, positions, attn, last_idx=last)

    def _layout(self, seqs: list, starts: list[int], lens: list[int], width: int | None = None):
        """The tiles of A.paged_attention for tokens [start, start + n) of each sequence (None: the kernel or
        SDPA runs the step's attention)."""
        if self.decode_mode == "kernel" or self.attention != "paged":
            return None
        tables = [s.block_table if s is not None else [self.trash_block] for s in seqs]  # None: a padding row
        return A.tile_layout(tables, starts, lens, self.trash_block, width).to(self.device)

    def _c_ops(self) -> dict:
        """The C RMSNorm and SiLU * up for one ``NativeModel.forward`` (empty without them: its torch ops), their
        outputs in buffers of that pass (small_ops.StepOps: never with ``hidden=True``)."""
        step_ops = self.ops and small_ops.StepOps(self.ops, self.model.eps, self.num_threads)
        return {"norm": step_ops.norm, **({"act_mul": step_ops.act_mul} if self.c_silu else {})} if step_ops else {}

    def _prefill_padded(self, batch: ScheduledBatch) -> torch.Tensor:
        seqs, bs, dev, m = batch.seqs, self.block_size, self.device, self.model
        B = len(seqs)
        S = self.padded_len(max(len(s) for s in seqs))
        tokens = torch.zeros(B, S, dtype=torch.long)
        slots = torch.full((B, S), self.trash_block * bs, dtype=torch.long)  # pads -> trash block
        for b, s in enumerate(seqs):
            n = len(s)
            tokens[b, :n] = torch.tensor(s.token_ids)
            slots[b, :n] = self._slots(s)
        tokens, slots = tokens.to(dev), slots.view(-1).to(dev)
        positions = torch.arange(S, device=dev).expand(B, S)
        last = torch.tensor([b * S + len(s) - 1 for b, s in enumerate(seqs)], device=dev)
        layout = self._layout(seqs, [0] * B, [len(s) for s in seqs])
        real = torch.cat([torch.arange(b * S, b * S + len(s)) for b, s in enumerate(seqs)]).to(dev)  # [N]

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [B, S, H, D]; k, v: [B, S, Hkv, D]; right padding + causal: real queries see real keys only
            A.write_kv(self.kv[i], slots, k.reshape(B * S, m.num_kv_heads, m.head_dim),
                       v.reshape(B * S, m.num_kv_heads, m.head_dim))
            if layout is None:
                return A.prefill_attention(q, k, v, m.scale)
            o = q.new_zeros(B * S, q.shape[2] * q.shape[3])  # pad rows: zeros, never read
            o[real] = A.paged_attention(q.reshape(B * S, *q.shape[2:])[real], self.kv[i], layout, m.scale)
            return o.view(B, S, -1)

        return m.forward(tokens, positions, attn, last_idx=last)

    def _graphs(self, graph: str, max_rows: int) -> DecodeGraphs | None:
        """The decode graphs for ``graph`` (None: every decode step eagerly, as ``_decode``)."""
        # the torch paths (decode 'gather', the default on CUDA and NPU): the C kernel is CPU-only, and decode 'npu'
        # (npu_incre_flash_attention) reads the context lengths from a host list, which a graph would freeze
        capturable = self.decode_mode == "gather"
        device_graphs = graph_module(self.device.type) is not None  # CUDA, NPU
        if graph == "auto":
            graph = "captured" if capturable and device_graphs else "off"
        if graph == "off":
            return None
        if not capturable:
            raise ValueError(f"decode graphs need the torch decode path (decode 'gather'), not {self.decode_mode!r}")
        if graph == "captured" and not device_graphs:
            raise ValueError(f"captured decode graphs need CUDA or an NPU, not {self.device} "
                             "(graph 'eager' runs them eagerly)")
        capture = DeviceCapture(self.device.type) if graph == "captured" else eager_capture
        return DecodeGraphs(self._graph_step, max_rows, blocks_for(self.max_seq_len, self.block_size),
                            self.trash_block, self.device, capture)

    def _decode_graph(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step through the graphs: (logits [n, V] fp32, greedy tokens [n]); None when a capture failed:
        the graphs are then off for good and the caller runs this step eagerly (its K/V writes, if the failed
        capture's warm-up ran, are the same values to the same slots)."""
        assert self.graphs is not None
        seqs = batch.seqs
        tables = [s.block_table for s in seqs]
        bucket = self.graphs.bucket(len(seqs), max(len(t) for t in tables))
        try:
            out = self.graphs.run([s.token_ids[-1] for s in seqs], [s.num_cached for s in seqs], tables)
        except CaptureFailed as e:
            # a worker keeps serving: captures were never run on some devices (NPU), so a failure is not fatal
            log.warning("decode graphs off, decoding eagerly: %s", e)
            self.graphs, self.graph_failure = None, str(e)
            return None
        self.decode_shapes.add(bucket)
        return out

    def _graph_step(self, inp: StepInputs) -> torch.Tensor:
        """The decode step a graph captures: everything from the bucket's inputs, static shapes, no host sync
        (graphs.py). -> fp32 logits [B, V]. Tokens identical to ``_decode``'s: the same attention per row (the
        torch paged attention with every split computed: a split past a row's context adds exact zeros)."""
        m, bs = self.model, self.block_size
        B, W = inp.tables.shape
        pos = inp.positions.view(B)
        slots = inp.tables.gather(1, (pos // bs).view(B, 1)).view(B) * bs + pos % bs  # [B] flat pool slots
        if self.attention == "paged":
            # one tile per row in row order (A.tile_layout's, for a decode step), every tile reaching all W blocks:
            # the bmm shapes depend on (B, W) only
            sub = pos % A.TILE
            ctx = torch.ones(B, A.TILE, dtype=torch.int64, device=pos.device).scatter_(1, sub.view(B, 1),
                                                                                         (pos + 1).view(B, 1))
            rows = torch.arange(B, device=pos.device)
            layout = A.TileLayout(rows * A.TILE + sub, inp.tables, rows, ctx, [W * bs] * B)
        else:
            mask = A.decode_mask(pos + 1, W * bs)

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [B, 1, H, D]; k, v: [B, 1, Hkv, D]
            pool = self.kv[i]
            A.write_kv(pool, slots, k[:, 0], v[:, 0])
            q1 = q[:, 0].contiguous()  # [B, H, D]
            if self.attention == "paged":
                return A.paged_attention(q1, pool, layout, m.scale).view(B, 1, -1)
            return A.decode_attention_gather(q1, pool, inp.tables, mask, m.scale).view(B, 1, -1)

        return m.forward(inp.tokens, inp.positions, attn).float()

    def decode_shape(self, rows: int, width: int) -> tuple[int, int]:
        """(rows, block-table width) a decode step of ``rows`` sequences needing ``width`` blocks runs at."""
        if not self.static_decode:
            return rows, width
        return 1 << (rows - 1).bit_length(), 1 << (width - 1).bit_length()

    def _decode(self, batch: ScheduledBatch) -> torch.Tensor:
        seqs, bs, dev, m = batch.seqs, self.block_size, self.device, self.model
        n = len(seqs)
        B, M = self.decode_shape(n, max(len(s.block_table) for s in seqs))
        self.decode_shapes.add((B, M))
        trash = self.trash_block
        # padding rows (static shapes): token 0 at position 0, writing to and reading the trash block only
        tables = _int64([b for s in seqs for b in s.block_table + [trash] * (M - len(s.block_table))]
                        + [trash] * (M * (B - n)), B, M).to(dev)
        pos_list = [s.num_cached for s in seqs] + [0] * (B - n)
        slot_list = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos_list)] + [trash * bs] * (B - n)
        tokens = _int64([s.token_ids[-1] for s in seqs] + [0] * (B - n), B, 1).to(dev)  # [B, 1]
        positions = _int64(pos_list, B, 1).to(dev)
        slots = _int64(slot_list, B).to(dev)
        ctx = positions.view(B) + 1  # [B] tokens to attend, incl. the current one
        mode = self.decode_mode
        layout = self._layout(seqs + [None] * (B - n), pos_list, [1] * B, M) if mode == "gather" else None
        mask = A.decode_mask(ctx, M * bs) if mode == "gather" and layout is None else None
        ctx_list = [p + 1 for p in pos_list]

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [B, 1, H, D]; k, v: [B, 1, Hkv, D]
            pool = self.kv[i]
            A.write_kv(pool, slots, k[:, 0], v[:, 0])
            q1 = q[:, 0].contiguous()  # [B, H, D]
            if mode == "kernel":
                o = cpu_kernel.paged_decode(self.kernel, q1, pool, tables, ctx, m.scale, self.num_threads)
            elif mode == "npu":
                o = A.decode_attention_npu(q1, pool, tables, ctx_list, m.scale)
            elif layout is not None:
                o = A.paged_attention(q1, pool, layout, m.scale)
            else:
                o = A.decode_attention_gather(q1, pool, tables, mask, m.scale)
            return o.reshape(B, 1, -1)

        rope_attn, c_ops = None, self._c_ops()
        if self.ops is not None:
            rope_kv = small_ops.RopeKV(self.ops, m.cos, m.sin_rot, positions.view(B), slots, m.num_heads,
                                       self.kv.shape[1:], self.num_threads)
            out = torch.empty(B, m.num_heads, m.head_dim, dtype=m.dtype)  # each layer's attention, read by o_proj

            def rope_attn(i: int, qkv: torch.Tensor) -> torch.Tensor:
                # qkv: [B, 1, (H + 2 Hkv) * D] before RoPE; RoPE and the KV write in one C call
                pool = self.kv[i]  # a view: indexed once a layer
                q1 = rope_kv(qkv, pool)
                o = cpu_kernel.paged_decode(self.kernel, q1, pool, tables, ctx, m.scale, self.num_threads, out)
                return o.view(B, 1, -1)

        return m.forward(tokens, positions, attn, rope_attn=rope_attn, **c_ops)[:n]
