"""``python -m batchfleet.worker`` == ``batchfleet worker``."""

from batchfleet.worker.cli import worker

if __name__ == "__main__":
    worker(prog_name="python -m batchfleet.worker")
