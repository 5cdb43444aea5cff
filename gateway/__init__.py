"""The OpenAI-compatible HTTP gateway over AsyncClient (``batchfleet serve``; needs ``batchfleet[serve]``)."""
