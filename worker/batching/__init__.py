"""When a batch closes: per-bucket, per-priority queues (the batcher) and the batching window. Pure: no Redis, no
torch."""
