"""Frozen, validated configuration dataclasses, one per role. Built once by the CLI and passed down.

The single source of defaults and choices: a field that is also a command-line option says so in its
metadata (``option(help, ...)``, common/optionspec.py); common/options.py derives the click options (flag,
env var, default, type, help) from these fields, so nothing here is restated elsewhere. The engine's own
settings are in common/engine_config.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.errors import ConfigError, PromptTooLong
from batchfleet.common.keys import DEFAULT_NAMESPACE, MAX_SHARDS, Keys
from batchfleet.common.logs import LOG_FORMATS
from batchfleet.common.optionspec import is_option, option, option_env
from batchfleet.common.redis.url import check_redis_url, is_cluster

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_BUCKETS = (128, 256, 512, 1024, 4096)
PADDING_CHOICES = ("bucket", "longest")
WINDOW_CHOICES = ("adaptive", "fixed")  # worker/batching/window.py


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
        "A batch closes at the latest this long after its oldest entry was enqueued; inf = static batching "
        "(only full batches, a load generator bumps the flush key for the last one)."))
    window: str = field(default="adaptive", metadata=option(
        "adaptive: close a batch earlier when waiting no longer pays (an idle engine starts a lone request at "
        "once; docs/NATIVE_ENGINE.md, \"The batching window\"); fixed: always wait max_wait_ms.",
        choices=WINDOW_CHOICES))
    ttft_slo_ms: float | None = field(default=None, metadata=option(
        "Adaptive window: close a batch early enough that its requests' time to first token stays within "
        "this target (one engine step is left for the prefill). Default: max_wait_ms bounds the wait alone."))
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
        if self.window not in WINDOW_CHOICES:
            raise ConfigError(f"window must be one of {WINDOW_CHOICES}, got {self.window!r}")
        if self.ttft_slo_ms is not None and not self.ttft_slo_ms > 0:
            raise ConfigError(f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
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
        "redis+sentinel://host:26379[,host2:26379]/<master>/<db> to follow Sentinel failovers, or "
        "redis+cluster://host:port[,host2:port] for a Redis Cluster.", parse=check_redis_url))
    namespace: str = field(default=DEFAULT_NAMESPACE, metadata=option(
        "Key namespace: isolates fleets on one Redis (tenants share one fleet: docs/TENANTS.md).",
        parse=check_namespace))
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
        return Keys(self.namespace, hashtag=is_cluster(self.redis_url))


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs."""

    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    reply_ttl_s: int = field(default=3600, metadata=option("Seconds a reply waits for its client.", flag="reply-ttl"))
    stream_interval_ms: float = field(default=20.0, metadata=option(
        "Streamed requests: at most one text delta per request this often (each costs one Redis write)."))
    # per bucket and priority; published so producers refuse (QueueFull) beyond it
    max_queue_len: int = field(default=10_000, metadata=option(
        "Per-bucket (and tenant) interactive queue length at which producers get QueueFull (0 = unbounded)."))
    background_queue_len: int = field(default=1_000_000, metadata=option(
        "Per-bucket (and tenant) background queue length at which producers get QueueFull (0 = unbounded).",
        aliases=("batch-queue-len",)))
    name: str | None = field(default=None, metadata=option(
        "Consumer name, unique per worker (default host-pid-rand).", flag="worker-name", aliases=("name",)))
    claim_idle_ms: int = field(default=30_000, metadata=option(
        "Reclaim entries a silent (dead) worker left pending this long."))
    max_deliveries: int = field(default=3, metadata=option(
        "Deliveries before an entry is dead-lettered and answered worker_failed."))
    reclaim_budget: int = 256  # most entries one reclaim tick may take over (across all buckets)
    # a named tenant whose streams (of a shard) stayed empty this long is retired: dropped from the queued-tenants set
    # with its streams, so short-lived tenant labels do not grow every worker's reads (worker/transport/tenant_gc.py).
    # Minutes, not seconds: a tenant that comes back soon keeps its streams (re-creating them costs its next
    # enqueue and every worker a round trip), and retiring is never needed for correctness, only for bounds.
    tenant_idle_s: float = 300.0
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
    shards: int = field(default=1, metadata=option(
        "Redis Cluster only: spread the request streams, inboxes and markers over this many hash tags (set it to "
        "the number of masters; docs/OPERATIONS.md). Producers follow the fleet description. Every worker of "
        "a namespace sets the same value; changing it is a new layout (drain the fleet first)."))
    metrics_port: int = field(default=0, metadata=option(
        "Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0 = off). The port is bound before the "
        "model loads: a port in use stops the worker at once."))
    metrics_host: str = field(default="127.0.0.1", metadata=option(
        "Address the metrics server binds: 127.0.0.1 (this host only, the default: /metrics has no key); 0.0.0.0 "
        "or a pod IP for a Prometheus on another host (the compose file and the Kubernetes manifests set it)."))

    @property
    def keys(self) -> Keys:
        """Shard 0 of this worker's fleet layout (``Keys.every_shard`` gives the others)."""
        return self.connection.keys.with_shards(self.shards)

    def __post_init__(self) -> None:
        if self.reply_ttl_s < 1:
            raise ConfigError("reply_ttl_s must be >= 1")
        if not self.stream_interval_ms >= 0:
            raise ConfigError("stream_interval_ms must be >= 0")
        if self.max_queue_len < 0 or self.background_queue_len < 0:
            raise ConfigError("max_queue_len and background_queue_len must be >= 0")
        if self.claim_idle_ms < 100:
            raise ConfigError("claim_idle_ms must be >= 100")
        if self.max_deliveries < 1:
            raise ConfigError("max_deliveries must be >= 1")
        if self.reclaim_budget < 1:
            raise ConfigError("reclaim_budget must be >= 1")
        if not self.stall_timeout_s > 0:
            raise ConfigError("stall_timeout_s must be > 0")
        if not self.tenant_idle_s > 0:
            raise ConfigError("tenant_idle_s must be > 0")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ConfigError(f"shards must be 1..{MAX_SHARDS}, got {self.shards}")
        if self.shards > 1 and not is_cluster(self.connection.redis_url):
            raise ConfigError("--shards > 1 needs a Redis Cluster URL (redis+cluster://): a single Redis has one "
                              "core to spread over")
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


def check_operator_keys(api_keys: tuple[str, ...], operator_keys: tuple[str, ...]) -> None:
    """ConfigError unless the operator keys are valid keys and none is also an API key (a key is either
    read-only or not)."""
    check_api_keys(operator_keys)
    if set(api_keys) & set(operator_keys):
        raise ConfigError("an operator key must not also be an API key: operator keys are read-only")


OPERATOR_KEY_HELP = ("Read-only operator keys, comma-separated: they see the dashboard's data (and `batchfleet "
                     "status --gateway`) and the gateway's /metrics, nothing else. Once set, only they do (an API "
                     "key gets 403 there); none: the API keys do.")


@dataclass(frozen=True)
class DashboardConfig:
    """``batchfleet dashboard``: the live web dashboard on its own (the gateway also serves it at /dashboard)."""

    host: str = field(default="127.0.0.1", metadata=option("Address to listen on (0.0.0.0: every interface)."))
    port: int = field(default=8001, metadata=option("TCP port to listen on."))
    api_keys: tuple[str, ...] = field(default=(), metadata=option(
        "API keys the dashboard's data needs, comma-separated (the gateway's); none: no auth.",
        flag="api-key", parse=parse_api_keys))
    operator_keys: tuple[str, ...] = field(default=(), metadata=option(
        OPERATOR_KEY_HELP, flag="operator-key", parse=parse_api_keys))

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", parse_api_keys(self.api_keys))
        object.__setattr__(self, "operator_keys", parse_api_keys(self.operator_keys))
        check_api_keys(self.api_keys)
        check_operator_keys(self.api_keys, self.operator_keys)
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
    return ConnectionConfig(**{k: v for k, v in values.items() if v})  # type: ignore[arg-type]  # checked there
