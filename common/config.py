"""Frozen, validated configuration dataclasses, one per role. Built once by the CLI and passed down.

The single source of defaults and choices: a field that is also a command-line option says so in its
metadata (``option(help, ...)``); common/options.py derives the click options (flag, env var, default,
type, help) from these fields, so nothing here is restated elsewhere.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field
from typing import Any

from batchfleet.common.errors import ConfigError, PromptTooLong
from batchfleet.common.keys import DEFAULT_NAMESPACE, Keys
from batchfleet.common.logs import LOG_FORMATS
from batchfleet.common.redis_url import check_redis_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_BUCKETS = (128, 256, 512, 1024, 4096)
PADDING_CHOICES = ("bucket", "longest")
ENGINE_CHOICES = ("native", "hf")
MODE_CHOICES = ("dynamic", "continuous")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
LINEAR_CHOICES = ("auto", "default", "onednn")  # worker/engine/native/linear.py
PRESETS = ("tiny", "bench")  # built-in models; worker/engine/models.py defines one shape per name
ENV_PREFIX = "BATCHFLEET_"
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|npu(:\d+)?)$")


def option(help: str, *, flag: str | None = None, choices: tuple[str, ...] | None = None,
           parse: Callable[[str], Any] | None = None, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field metadata that makes a config field a CLI option (read by common/options.py).

    ``flag`` overrides ``--<field-name>`` (without the dashes); the environment variable is always
    ``BATCHFLEET_<FLAG>`` (one rule, no exceptions: README and --help say so). ``choices`` restricts the
    value, ``parse`` turns the command-line text into the field's value, ``aliases`` are older flag names
    still accepted.
    """
    return {"help": help, "flag": flag, "choices": choices, "parse": parse, "aliases": aliases}


def option_flag(f: Field) -> str:
    """The option's name without dashes: ``reply-ttl`` for ``reply_ttl_s``."""
    return f.metadata["flag"] or f.name.replace("_", "-")


def option_env(f: Field) -> str:
    """The option's environment variable: ``BATCHFLEET_REPLY_TTL`` for ``reply_ttl_s``."""
    return ENV_PREFIX + option_flag(f).upper().replace("-", "_")


def is_option(f: Field) -> bool:
    """Whether a config field is also a command-line option."""
    return "help" in f.metadata


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class LogConfig:
    """Logging, the same on every command (and on the ``batchfleet`` group: a subcommand's own value wins,
    else the group's)."""

    log_level: str = field(default="INFO", metadata=option("Log level.", choices=LOG_LEVELS))
    log_format: str = field(default="text", metadata=option(
        "text: one readable line per record; json: one JSON object per line (time, level, logger, message, "
        "job, bucket, worker) for log shippers, and nothing else on stderr.", choices=LOG_FORMATS))


def parse_buckets(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Parse ``"128,256,512"`` into a tuple; raises ConfigError on junk."""
    if isinstance(text, (tuple, list)):
        return tuple(int(b) for b in text)
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError as exc:
        raise ConfigError(f"buckets must be comma-separated integers, got {text!r}") from exc


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """How a worker forms batches.

    A bucket's batch closes when it holds ``max_batch_size`` entries or when ``max_wait_ms`` has passed
    since its oldest entry was enqueued, whichever comes first. Buckets never share a batch.
    """

    max_wait_ms: float = field(default=50.0, metadata=option(
        "A batch closes this long after its oldest entry was enqueued; inf = static batching (only full "
        "batches, a load generator bumps the flush key for the last one)."))
    max_batch_size: int = field(default=32, metadata=option("Most entries in one batch, per bucket."))
    max_seq_len: int = field(default=4096, metadata=option("Prompt + max_new_tokens limit."))
    buckets: tuple[int, ...] = field(default=DEFAULT_BUCKETS, metadata=option(
        "Prompt-length buckets (one stream each), comma-separated.", parse=parse_buckets))
    padding: str = field(default="bucket", metadata=option(
        "bucket: pad to the bucket length (static shapes); longest: to the longest prompt.", choices=PADDING_CHOICES))

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
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len ({max_seq_len})",
            "max_new_tokens")  # the prompt fits a bucket: what it asks for on top is too much
    return buckets[bisect.bisect_left(buckets, prompt_len)]


def check_namespace(namespace: str) -> str:
    """``namespace`` when it is a valid key namespace; ConfigError otherwise."""
    try:
        Keys(namespace)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return namespace


@dataclass(frozen=True)
class ConnectionConfig:
    """Where the fleet lives: shared by every command and by the Python clients."""

    redis_url: str = field(default=DEFAULT_REDIS_URL, metadata=option(
        "redis://[user:pass@]host:port/db, rediss:// for TLS, or "
        "redis+sentinel://host:26379[,host2:26379]/<master>/<db> to follow Sentinel failovers.", parse=check_redis_url))
    namespace: str = field(default=DEFAULT_NAMESPACE, metadata=option(
        "Key namespace: isolates fleets (tenants) on one Redis.", parse=check_namespace))
    wait_replicas: int = field(default=0, metadata=option(
        "An enqueue and a reply count as written only once this many replicas acknowledged them (Redis WAIT); "
        "0: replication stays asynchronous and a failover may lose the last writes (docs/OPERATIONS.md)."))
    socket_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        check_namespace(self.namespace)
        object.__setattr__(self, "wait_replicas", int(self.wait_replicas))
        if self.wait_replicas < 0:
            raise ConfigError("wait_replicas must be >= 0")
        if self.socket_timeout_s <= 1:
            raise ConfigError("socket_timeout_s must be > 1 s (blocking reads are sized below it)")

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)


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
    batch_min_share: float = field(default=0.1, metadata=option(
        "Continuous mode: share of --max-running decode slots the batch class keeps while interactive work "
        "runs (at least one slot when > 0): interactive work preempts batch sequences down to it, never below, "
        "so a flood of interactive requests never starves batch jobs."))
    max_prefill_tokens: int = field(default=2048, metadata=option(
        "Continuous mode: prompt tokens per prefill step; longer prefills are chunked, with decode steps "
        "between chunks, so a long prompt never stalls running requests for its whole prefill."))
    device: str = field(default="cpu", metadata=option("cpu | cuda[:i] | npu[:i]"))
    dtype: str | None = field(default=None, metadata=option(
        "Default: measured per device (bf16 on AMX/AVX512-BF16 CPUs, GPU, NPU; else float32).", choices=DTYPE_CHOICES))
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
        "Native engine weight matmuls: auto = per weight shape and row count, the faster of torch's default "
        "and oneDNN with the weight prepacked, measured at load (CPU; elsewhere default); default = F.linear; "
        "onednn = prepacked wherever oneDNN can.", choices=LINEAR_CHOICES))
    prefix_cache: bool = field(default=True, metadata=option(
        "Native engine: keep the KV of full prompt blocks and reuse it for every later prompt starting with the "
        "same tokens (a shared system prompt is computed once); cached blocks are evicted least recently used."))
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
        if not 0 <= self.batch_min_share <= 1:
            raise ConfigError(f"batch_min_share must be in [0, 1], got {self.batch_min_share}")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device must be cpu, cuda[:i] or npu[:i], got {self.device!r}")
        if self.linear not in LINEAR_CHOICES:
            raise ConfigError(f"linear must be one of {LINEAR_CHOICES}, got {self.linear!r}")
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


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs."""

    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    reply_ttl_s: int = field(default=3600, metadata=option("Seconds a reply waits for its client.", flag="reply-ttl"))
    stream_interval_ms: float = field(default=20.0, metadata=option(
        "Streamed requests: at most one text delta per request this often (each costs one Redis write)."))
    # per bucket and class; published so producers refuse (QueueFull) beyond it
    max_queue_len: int = field(default=10_000, metadata=option(
        "Per-bucket interactive queue length at which producers get QueueFull (0 = unbounded)."))
    batch_queue_len: int = field(default=1_000_000, metadata=option(
        "Per-bucket queue length of the batch class at which producers get QueueFull (0 = unbounded)."))
    name: str | None = field(default=None, metadata=option(
        "Consumer name, unique per worker (default host-pid-rand).", flag="worker-name", aliases=("name",)))
    claim_idle_ms: int = field(default=30_000, metadata=option(
        "Reclaim entries a silent (dead) worker left pending this long."))
    max_deliveries: int = field(default=3, metadata=option(
        "Deliveries before an entry is dead-lettered and answered worker_failed."))
    reclaim_budget: int = 256  # most entries one reclaim tick may take over (across all buckets)
    replace_fleet: bool = field(default=False, metadata=option(
        "Start even though live workers of this namespace serve another model, tokenizer or buckets (a "
        "different fleet fingerprint): publish this worker's fleet description in their place. Without it "
        "such a worker refuses to start."))
    stall_timeout_s: float = field(default=600.0, metadata=option(
        "A worker whose loop makes no progress this long (one engine step included) stops renewing its leases, "
        "so other workers take its requests over."))

    scale_to_zero: bool = field(default=False, metadata=option(
        "The fleet may run with zero workers (KEDA minReplicaCount 0): the fleet description is kept when the "
        "last worker stops, and producers and the gateway enqueue while no worker is live (a worker started "
        "later answers). Set it on every worker of the namespace."))
    metrics_port: int = field(default=0, metadata=option(
        "Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0 = off). The port is bound before the "
        "model loads: a port in use stops the worker at once."))
    metrics_host: str = field(default="0.0.0.0", metadata=option(
        "Address the metrics server binds (127.0.0.1: this host only)."))

    def __post_init__(self) -> None:
        if self.reply_ttl_s < 1:
            raise ConfigError("reply_ttl_s must be >= 1")
        if not self.stream_interval_ms >= 0:
            raise ConfigError("stream_interval_ms must be >= 0")
        if self.max_queue_len < 0 or self.batch_queue_len < 0:
            raise ConfigError("max_queue_len and batch_queue_len must be >= 0")
        if self.claim_idle_ms < 100:
            raise ConfigError("claim_idle_ms must be >= 100")
        if self.max_deliveries < 1:
            raise ConfigError("max_deliveries must be >= 1")
        if self.reclaim_budget < 1:
            raise ConfigError("reclaim_budget must be >= 1")
        if not self.stall_timeout_s > 0:
            raise ConfigError("stall_timeout_s must be > 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0..65535, got {self.metrics_port}")
        if not self.metrics_host:
            raise ConfigError("metrics_host must not be empty")


MIN_KEY_CHARS = 8  # a shorter "secret" is guessable; refuse it rather than pretend to protect anything


def parse_api_keys(text: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """``"k1,k2"`` -> ("k1", "k2"); empty text -> () (no authentication)."""
    if text is None:
        return ()
    parts = text.split(",") if isinstance(text, str) else list(text)
    return tuple(p.strip() for p in parts if p.strip())


def check_api_keys(keys: tuple[str, ...]) -> None:
    """ConfigError unless every key is long enough and printable without spaces."""
    if any(len(k) < MIN_KEY_CHARS or not k.isprintable() or " " in k for k in keys):
        raise ConfigError(f"each API key must be at least {MIN_KEY_CHARS} printable chars without spaces")


@dataclass(frozen=True)
class DashboardConfig:
    """``batchfleet dashboard``: the live web dashboard on its own (the gateway also serves it at /dashboard)."""

    host: str = field(default="127.0.0.1", metadata=option("Address to listen on (0.0.0.0: every interface)."))
    port: int = field(default=8001, metadata=option("TCP port to listen on."))
    api_keys: tuple[str, ...] = field(default=(), metadata=option(
        "API keys the dashboard's data needs, comma-separated (the gateway's); none: no auth.",
        flag="api-key", parse=parse_api_keys))

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", parse_api_keys(self.api_keys))
        check_api_keys(self.api_keys)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")


def connection_from_env(redis_url: str | None = None, namespace: str | None = None,
                        environ: Mapping[str, str] | None = None) -> ConnectionConfig:
    """ConnectionConfig from explicit values, else BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE, else defaults.

    The one place that reads the environment for Python clients (the CLI gets the same via click envvar;
    both take the variable names from the fields' metadata).
    """
    import os
    from dataclasses import fields

    env = os.environ if environ is None else environ
    explicit = {"redis_url": redis_url, "namespace": namespace}
    values = {f.name: explicit.get(f.name) or env.get(option_env(f)) for f in fields(ConnectionConfig) if is_option(f)}
    return ConnectionConfig(**{k: v for k, v in values.items() if v})
