"""``python -m batchfleet.worker`` == ``batchfleet worker``."""

from batchfleet.common import logs
from batchfleet.worker.cli import worker

if __name__ == "__main__":
    logs.configure("INFO")  # --log-format json switches the format when the worker starts
    worker(prog_name="python -m batchfleet.worker")
