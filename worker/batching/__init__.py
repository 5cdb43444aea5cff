"""When a batch closes: per-bucket, per-class queues (the batcher) and the batching window. Pure: no Redis, no torch."""
