"""The producer library a web backend imports: no torch, no model files.

    from batchfleet.producer import Client
    client = Client()                      # BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE or defaults
    result = client.generate("Hello", max_new_tokens=32)
"""

from batchfleet.common.errors import (
    AnswerExpired,
    Cancelled,
    FleetUnavailable,
    InvalidRequest,
    JobFailed,
    NoWorkers,
    PromptTooLong,
    QueueFull,
    RateLimited,
    RedisFull,
    RedisRefused,
    RedisUnavailable,
    Timeout,
)
from batchfleet.common.wire.protocol import Delta, Result
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.ask import Ask
from batchfleet.producer.chat import Chat
from batchfleet.producer.client import Client, TokenStream
from batchfleet.producer.stream import AsyncTokenStream

__all__ = ["AnswerExpired", "Ask", "AsyncClient", "AsyncTokenStream", "Cancelled", "Chat", "Client", "Delta",
           "FleetUnavailable", "InvalidRequest", "JobFailed", "NoWorkers", "PromptTooLong", "QueueFull",
           "RateLimited", "RedisFull", "RedisRefused", "RedisUnavailable", "Result", "Timeout", "TokenStream"]
