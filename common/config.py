"""Frozen, validated configuration dataclasses, one per role. Built once by the CLI and passed down."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from batchfleet.common.errors import ConfigError, PromptTooLong
from batchfleet.common.keys import DEFAULT_NAMESPACE, Keys

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_BUCKETS = (128, 256, 512, 1024, 4096)
PADDING_CHOICES = ("bucket", "longest")
ENGINE_CHOICES = ("native", "hf")
MODE_CHOICES = ("dynamic", "continuous")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|npu(:\d+)?)$")


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """How a worker forms batches.

    A bucket's batch closes when it holds ``max_batch_size`` entries or when ``max_wait_ms`` has passed
    since its oldest entry was enqueued, whichever comes first. Buckets never share a batch.
    """

    max_wait_ms: float = 50.0
    max_batch_size: int = 32
    max_seq_len: int = 4096
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    padding: str = "bucket"

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))
        if not self.max_wait_ms >= 0:  # also rejects NaN
            raise ConfigError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not self.buckets:
            raise ConfigError("buckets must not be empty")
        if any(b < 1 for b in self.buckets):
            raise ConfigError(f"buckets must be positive, got {self.buckets}")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ConfigError(f"buckets must be strictly increasing, got {self.buckets}")
        if self.buckets[-1] > self.max_seq_len:
            raise ConfigError(f"bucket {self.buckets[-1]} exceeds max_seq_len {self.max_seq_len}")
        if self.padding not in PADDING_CHOICES:
            raise ConfigError(f"padding must be one of {PADDING_CHOICES}, got {self.padding!r}")

    def bucket_for(self, prompt_len: int, max_new_tokens: int) -> int:
        """Smallest bucket >= prompt_len; raises PromptTooLong when the request cannot fit."""
        return bucket_for(self.buckets, self.max_seq_len, prompt_len, max_new_tokens)


def bucket_for(buckets: tuple[int, ...], max_seq_len: int, prompt_len: int, max_new_tokens: int) -> int:
    """Route a prompt to the smallest bucket that holds it (shared by producer and worker)."""
    if prompt_len < 1:
        raise PromptTooLong("prompt must have at least one token")
    if prompt_len > buckets[-1]:
        raise PromptTooLong(f"prompt has {prompt_len} tokens; the largest bucket is {buckets[-1]}")
    if prompt_len + max_new_tokens > max_seq_len:
        raise PromptTooLong(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len ({max_seq_len})"
        )
    return buckets[bisect.bisect_left(buckets, prompt_len)]


def parse_buckets(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Parse ``"128,256,512"`` into a tuple; raises ConfigError on junk."""
    if isinstance(text, (tuple, list)):
        return tuple(int(b) for b in text)
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError as exc:
        raise ConfigError(f"buckets must be comma-separated integers, got {text!r}") from exc


@dataclass(frozen=True)
class ConnectionConfig:
    """Where the fleet lives: shared by every command and by the Python clients."""

    redis_url: str = DEFAULT_REDIS_URL
    namespace: str = DEFAULT_NAMESPACE
    socket_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        Keys(self.namespace)  # validates
        if self.socket_timeout_s <= 1:
            raise ConfigError("socket_timeout_s must be > 1 s (blocking reads are sized below it)")

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)


@dataclass(frozen=True)
class EngineConfig:
    """What runs the model and where."""

    model: str | None = None  # local HF checkpoint dir; None = the built-in default model
    preset: str = "tiny"  # built-in model preset when model is None: "tiny" or "bench"
    engine: str = "native"
    mode: str = "dynamic"
    device: str = "cpu"
    dtype: str | None = None  # None = per-device default chosen by measurement (bf16 on CPU with AMX)
    block_size: int = 16
    kv_cache_gb: float | None = None  # None = a fraction of free memory
    threads: int | None = None  # CPU threads for torch and the kernels; None = torch's default (all cores)
    cache_dir: str = "~/.cache/batchfleet"  # built-in presets (models/) and the compiled CPU kernel (kernels/)
    native_kernel: bool = True  # the C paged-decode kernel on CPU (False: gather + SDPA)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_CHOICES:
            raise ConfigError(f"engine must be one of {ENGINE_CHOICES}, got {self.engine!r}")
        if self.mode not in MODE_CHOICES:
            raise ConfigError(f"mode must be one of {MODE_CHOICES}, got {self.mode!r}")
        if self.engine == "hf" and self.mode != "dynamic":
            raise ConfigError("the hf engine runs each batch to completion: use --mode dynamic")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device must be cpu, cuda[:i] or npu[:i], got {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.preset not in ("tiny", "bench"):
            raise ConfigError(f"preset must be tiny or bench, got {self.preset!r}")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ConfigError("kv_cache_gb must be > 0")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be >= 1")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs."""

    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    reply_ttl_s: int = 3600
    max_queue_len: int = 10_000  # per bucket; published so producers refuse (QueueFull) beyond it; 0 = off
    name: str | None = None  # consumer name; None = host-pid-random
    claim_idle_ms: int = 30_000  # entries pending this long on a silent consumer are reclaimed by live ones
    max_deliveries: int = 3  # a delivery beyond this dead-letters the entry and answers worker_failed
    reclaim_budget: int = 256  # most entries one reclaim tick may take over (across all buckets)
    stall_timeout_s: float = 600.0  # a loop making no progress this long stops renewing its leases

    def __post_init__(self) -> None:
        if self.reply_ttl_s < 1:
            raise ConfigError("reply_ttl_s must be >= 1")
        if self.max_queue_len < 0:
            raise ConfigError("max_queue_len must be >= 0")
        if self.claim_idle_ms < 100:
            raise ConfigError("claim_idle_ms must be >= 100")
        if self.max_deliveries < 1:
            raise ConfigError("max_deliveries must be >= 1")
        if self.reclaim_budget < 1:
            raise ConfigError("reclaim_budget must be >= 1")
        if not self.stall_timeout_s > 0:
            raise ConfigError("stall_timeout_s must be > 0")


def connection_from_env(redis_url: str | None = None, namespace: str | None = None,
                        environ: dict[str, str] | None = None) -> ConnectionConfig:
    """ConnectionConfig from explicit values, else BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE, else defaults.

    The one place that reads the environment for Python clients (the CLI gets the same via click envvar).
    """
    import os

    env = os.environ if environ is None else environ
    return ConnectionConfig(
        redis_url=redis_url or env.get("BATCHFLEET_REDIS_URL") or DEFAULT_REDIS_URL,
        namespace=namespace or env.get("BATCHFLEET_NAMESPACE") or DEFAULT_NAMESPACE,
    )
