"""The gateway package's commands: batchfleet serve, batches and bulk."""
