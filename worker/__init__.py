"""batchfleet worker: stream consumer, batcher, engines and the loop that wires them."""
