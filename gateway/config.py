"""The gateway's configuration: one frozen, validated dataclass (the ``batchfleet serve`` options).

Fields carrying ``option(...)`` metadata become command-line options through common/options.py, exactly
like the worker's, so ``--api-key`` is also ``BATCHFLEET_API_KEY`` and the defaults live here only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchfleet.common.config import (
    MIN_KEY_CHARS,
    OPERATOR_KEY_HELP,
    ConnectionConfig,
    check_api_keys,
    check_operator_keys,
    parse_api_keys,
)
from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import TENANT_MAX_CHARS, valid_tenant
from batchfleet.common.optionspec import option
from batchfleet.common.tenants import RESERVED_LABELS, RESERVED_TEXT

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # gateway/openai/tools/parsers.py

__all__ = ["MIN_KEY_CHARS", "GatewayConfig", "parse_api_keys"]


@dataclass(frozen=True)
class GatewayConfig:
    """What ``batchfleet serve`` needs: where it listens, which fleet it fronts, and its request limits."""

    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    host: str = field(default="127.0.0.1", metadata=option("Address to listen on (0.0.0.0: every interface)."))
    port: int = field(default=8000, metadata=option("TCP port to listen on."))
    api_keys: tuple[str, ...] = field(default=(), metadata=option(
        "Accepted API keys, comma-separated (clients send 'Authorization: Bearer <key>'); none: no auth.",
        flag="api-key", parse=parse_api_keys))
    operator_keys: tuple[str, ...] = field(default=(), metadata=option(
        OPERATOR_KEY_HELP, flag="operator-key", parse=parse_api_keys))
    tenant_keys: tuple[str, ...] = field(default=(), metadata=option(
        "API keys of tenants, comma-separated LABEL:KEY (docs/TENANTS.md): each KEY is accepted as an API key and "
        "its requests run on tenant LABEL's account (its weight and limits); the label, never the key, goes to "
        "Redis, metrics and logs. Keys of --api-key run as the default tenant.", flag="tenant-key",
        parse=parse_api_keys))
    served_model_names: tuple[str, ...] = field(default=(), metadata=option(
        "Model ids the API lists and accepts, comma-separated (as vLLM's); answers report the first. "
        "Default: the fleet's model name.", flag="served-model-name", parse=parse_api_keys))
    model_alias_any: bool = field(default=False, metadata=option(
        "Accept any model name a request asks for and answer it with the served model (scripts written for "
        "OpenAI's models: 'gpt-4o-mini' and the like); off: an unknown name is a 404 model_not_found."))
    request_timeout_s: float = field(default=600.0, metadata=option(
        "Longest a request may take (queue + generation), also its deadline in the fleet; a request may ask "
        "for less with the 'timeout' field (seconds). Past it: HTTP 504.", flag="request-timeout"))
    chat_max_tokens: int = field(default=256, metadata=option(
        "max_tokens of a chat completion that does not set it (completions default to 16, as OpenAI's)."))
    tool_call_parser: str = field(default="auto", metadata=option(
        "How tool calls are written by the served model's family (as vLLM's --tool-call-parser): hermes "
        "(Qwen, Hermes: <tool_call> JSON), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS] JSON array); auto: "
        "from the fleet's chat template, hermes when it says nothing.", choices=TOOL_CALL_PARSERS))
    metrics_port: int = field(default=0, metadata=option(
        "Serve Prometheus metrics (the fleet's queue gauges and the gateway's HTTP requests by route and "
        "status, latency histogram) on this port; 0 = off."))
    metrics_host: str = field(default="127.0.0.1", metadata=option(
        "Address the metrics server binds: 127.0.0.1 (this host only, the default: /metrics has no key); 0.0.0.0 "
        "or a pod IP for a Prometheus on another host (the compose file and the Kubernetes manifests set it)."))
    files_dir: str = field(default="batchfleet-files", metadata=option(
        "Directory of the files API (/v1/files: batch inputs, outputs and error files); every gateway and "
        "`batchfleet batches` process of a fleet must see the same one (a shared volume)."))
    max_file_mb: int = field(default=512, metadata=option("Largest file /v1/files accepts, in MiB."))
    max_body_kb: int = field(default=2048, metadata=option(
        "Largest JSON request body the API reads, in KiB: a larger one is a 413 before it is parsed, rendered "
        "or tokenized (2 MiB holds a 128K-token prompt with room to spare; raise it for longer contexts)."))
    batch_runner: bool = field(default=True, metadata=option(
        "Run OpenAI batches (/v1/batches) in this process as well as serving the API; off: a dedicated "
        "`batchfleet batches` process runs them. A lease in Redis lets exactly one process run each batch."))
    batch_window: int = field(default=256, metadata=option("Requests of one batch in flight at once."))
    batch_lease_s: float = field(default=15.0, metadata=option(
        "A batch's lease, in seconds: when the process running it dies, another takes it over after this long.",
        flag="batch-lease"))
    response_ttl_s: float = field(default=30 * 86400.0, metadata=option(
        "How long a stored Responses API response (/v1/responses with store: true, the default) stays "
        "retrievable and chainable by previous_response_id, in seconds (OpenAI's: 30 days).",
        flag="response-ttl"))

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_kb << 10

    @property
    def key_tenants(self) -> dict[str, str]:
        """API key -> its tenant's label (``--tenant-key``); a key absent is the default tenant's."""
        return {key: label for label, _, key in (entry.partition(":") for entry in self.tenant_keys)}

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_keys", parse_api_keys(self.tenant_keys))
        for i, entry in enumerate(self.tenant_keys):
            label, sep, key = entry.partition(":")
            # the message never shows the entry: what stands before its ':' may be a key (KEY:LABEL swapped, a
            # key with a ':' and no label)
            if not sep or not valid_tenant(label):
                raise ConfigError(f"each --tenant-key is LABEL:KEY, the label first, of 1-{TENANT_MAX_CHARS} chars "
                                  f"of [a-z0-9_-]; entry {i + 1} has an invalid label ({len(label)} chars)" if sep else
                                  f"each --tenant-key is LABEL:KEY; entry {i + 1} has no ':'")
            if label in RESERVED_LABELS:  # "default": a key of the default tenant is an --api-key
                raise ConfigError(f"--tenant-key: {RESERVED_TEXT}; a key of the default tenant is an --api-key")
        keyed = tuple(entry.partition(":")[2] for entry in self.tenant_keys)
        try:
            check_api_keys(keyed)
        except ConfigError as exc:  # KEY:LABEL swapped reads as a short key: say which part is which
            raise ConfigError(f"--tenant-key is LABEL:KEY, the label first: {exc}") from None
        if len(keyed) != len(set(keyed)):
            raise ConfigError("a key must not be given to two tenants (--tenant-key)")
        if set(keyed) & set(parse_api_keys(self.api_keys)):  # which tenant its requests run for would be a guess
            raise ConfigError("a key must not be both an --api-key (the default tenant's) and a --tenant-key")
        # a tenant's key is an API key: every check of API keys (authorization, operator keys) covers it
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys((*parse_api_keys(self.api_keys), *keyed))))
        object.__setattr__(self, "operator_keys", parse_api_keys(self.operator_keys))
        object.__setattr__(self, "served_model_names", parse_api_keys(self.served_model_names))
        if not self.host:
            raise ConfigError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        check_api_keys(self.api_keys)
        check_operator_keys(self.api_keys, self.operator_keys)
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ConfigError("served_model_names must not repeat a name")
        if not (math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ConfigError(f"request_timeout_s must be a positive number, got {self.request_timeout_s}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not self.files_dir:
            raise ConfigError("files_dir must not be empty")
        if self.max_file_mb < 1:
            raise ConfigError(f"max_file_mb must be >= 1, got {self.max_file_mb}")
        if self.max_body_kb < 1:
            raise ConfigError(f"max_body_kb must be >= 1, got {self.max_body_kb}")
        if self.batch_window < 1:
            raise ConfigError(f"batch_window must be >= 1, got {self.batch_window}")
        if not (math.isfinite(self.batch_lease_s) and self.batch_lease_s >= 1):
            raise ConfigError(f"batch_lease_s must be >= 1 second, got {self.batch_lease_s}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if not (math.isfinite(self.response_ttl_s) and self.response_ttl_s >= 1):
            raise ConfigError(f"response_ttl_s must be >= 1 second, got {self.response_ttl_s}")
        if self.chat_max_tokens < 1:
            raise ConfigError(f"chat_max_tokens must be >= 1, got {self.chat_max_tokens}")
