"""The Redis transport: the Transport protocol the loop uses and its Redis implementation (plain and sharded)."""
