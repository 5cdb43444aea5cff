"""What runs the model and where: the engine's settings (model, engine kind, batching mode, device, dtype,
KV cache, kernels), their choices and checks. Part of every WorkerConfig (common/config.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from batchfleet.common.errors import ConfigError
from batchfleet.common.optionspec import option

ENGINE_CHOICES = ("native", "hf")
MODE_CHOICES = ("dynamic", "continuous")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
LINEAR_CHOICES = ("auto", "fastest", "default", "onednn")  # worker/engine/native/linear.py
POOLING_CHOICES = ("last", "mean")  # worker/engine/embed.py
PRESETS = ("tiny", "bench", "llama1b")  # built-in models; worker/engine/models.py defines one shape per name
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|npu(:\d+)?)$")


@dataclass(frozen=True)
class EngineConfig:
    """What runs the model and where."""

    model: str | None = field(default=None, metadata=option(
        "Local HF checkpoint dir (Llama/Mistral/Qwen2); never downloads. Default: the built-in --preset."))
    preset: str = field(default="tiny", metadata=option(
        "Built-in model made locally when --model is not given.", choices=PRESETS))
    engine: str = field(default="native", metadata=option(
        "native: own forward over a paged KV cache; hf: transformers generate (the baseline).",
        choices=ENGINE_CHOICES))
    mode: str | None = field(default=None, metadata=option(
        "continuous: closed batches of every bucket start while others decode, all buckets decode together "
        "(native only); dynamic: one bucket's batch runs to completion (the reference). "
        "Default: continuous for native, dynamic for hf.", choices=MODE_CHOICES))
    max_running: int = field(default=64, metadata=option(
        "Continuous mode: most sequences decoding at once, all buckets together (--max-batch-size stays the "
        "per-bucket prefill batch). 64 measured best on a 2-core CPU: 1311 tok/s per decode step vs 944 at 32."))
    background_min_share: float = field(default=0.1, metadata=option(
        "Continuous mode: share of --max-running decode slots background work keeps while interactive work "
        "runs (at least one slot when > 0): interactive work preempts background sequences down to it, never "
        "below, so a flood of interactive requests never starves background work.", aliases=("batch-min-share",)))
    max_prefill_tokens: int = field(default=2048, metadata=option(
        "Continuous mode: prompt tokens per prefill step; longer prefills are chunked, with decode steps "
        "between chunks, so a long prompt never stalls running requests for its whole prefill."))
    device: str = field(default="cpu", metadata=option("cpu | cuda[:i] | npu[:i]"))
    dtype: str | None = field(default=None, metadata=option(
        "Default: measured per device (bf16 on GPU, NPU, AMX CPUs and AMD CPUs with AVX512-BF16; else float32).",
        choices=DTYPE_CHOICES))
    block_size: int = field(default=16, metadata=option("KV cache block size (native engine)."))
    kv_cache_gb: float | None = field(default=None, metadata=option(
        "KV pool size (native engine). Default: a fraction of free memory."))
    threads: int | None = field(default=None, metadata=option(
        "CPU threads per worker (torch + kernels). Default: all cores. With N workers on one host give each "
        "cores/N: OpenMP threads fighting over cores slow everything down."))
    cache_dir: str = field(default="~/.cache/batchfleet", metadata=option(
        "Where built-in presets (models/) are created and the CPU kernel (kernels/) is compiled."))
    native_kernel: bool = field(default=True, metadata=option(
        "Use the C decode kernels on CPU: paged attention and the step's small ops (off: gather + SDPA, torch ops)."))
    linear: str = field(default="auto", metadata=option(
        "Native engine weight matmuls: auto = oneDNN with the weight prepacked wherever it can (CPU; bf16 on CPUs "
        "with AMX: the engine's AMX kernel; elsewhere F.linear), the same bits for a row at every row count "
        "(batch-invariant output); fastest = per weight shape and row count the faster of F.linear and oneDNN, "
        "measured at load (not batch-invariant); default = F.linear; onednn = as auto, oneDNN on AMX too.",
        choices=LINEAR_CHOICES))
    enforce_eager: bool = field(default=False, metadata=option(
        "Native engine: run every decode step op by op (vLLM's name). Default: on CUDA and NPU each decode step "
        "replays a graph (CUDA graph, torch_npu's NPUGraph) captured once per padded batch size; CPU always runs "
        "eagerly, and a capture that fails turns the graphs off with a warning."))
    batch_invariant: bool = field(default=False, metadata=option(
        "Native engine on CUDA: a request's tokens and logprobs do not depend on what runs beside it (weight "
        "matmuls in fixed 128-row calls, no reduced-precision cuBLAS reductions; its cost is not measured yet). "
        "CPU is batch-invariant by default."))
    prefix_cache: bool = field(default=True, metadata=option(
        "Native engine: keep the KV of full prompt blocks and reuse it for every later prompt starting with the "
        "same tokens (a shared system prompt is computed once); cached blocks are evicted least recently used."))
    pooling: str = field(default="last", metadata=option(
        "Embeddings (/v1/embeddings, embed requests): the final hidden state of the prompt's last token "
        "(what causal-LM embedders use, vLLM's default for them) or the mean over its tokens; L2-normalised.",
        choices=POOLING_CHOICES))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_CHOICES:
            raise ConfigError(f"engine must be one of {ENGINE_CHOICES}, got {self.engine!r}")
        if self.mode is None:  # the best the engine can do
            object.__setattr__(self, "mode", "continuous" if self.engine == "native" else "dynamic")
        if self.mode not in MODE_CHOICES:
            raise ConfigError(f"mode must be one of {MODE_CHOICES}, got {self.mode!r}")
        if self.engine == "hf" and self.mode != "dynamic":
            raise ConfigError("the hf engine runs each batch to completion: add --mode dynamic")
        if self.max_running < 1 or self.max_prefill_tokens < 1:
            raise ConfigError("max_running and max_prefill_tokens must be >= 1")
        if not 0 <= self.background_min_share <= 1:
            raise ConfigError(f"background_min_share must be in [0, 1], got {self.background_min_share}")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device must be cpu, cuda[:i] or npu[:i], got {self.device!r}")
        if self.linear not in LINEAR_CHOICES:
            raise ConfigError(f"linear must be one of {LINEAR_CHOICES}, got {self.linear!r}")
        if self.pooling not in POOLING_CHOICES:
            raise ConfigError(f"pooling must be one of {POOLING_CHOICES}, got {self.pooling!r}")
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.preset not in PRESETS:
            raise ConfigError(f"preset must be one of {PRESETS}, got {self.preset!r}")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ConfigError("kv_cache_gb must be > 0")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be >= 1")
