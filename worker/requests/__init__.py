"""The requests a worker holds: intake from the transport, validation, the request table, replies and deltas."""
