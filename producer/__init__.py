"""The producer library a web backend imports: no torch, no model files.

    from batchfleet.producer import Client
    client = Client()                      # BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE or defaults
    result = client.generate("Hello", max_new_tokens=32)
"""

from batchfleet.common.errors import FleetUnavailable, JobFailed, PromptTooLong, QueueFull, Timeout
from batchfleet.common.protocol import Result
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.client import Client

__all__ = ["AsyncClient", "Client", "FleetUnavailable", "JobFailed", "PromptTooLong", "QueueFull", "Result",
           "Timeout"]
