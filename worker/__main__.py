"""``python -m batchfleet.worker`` == ``batchfleet worker``."""

import logging

from batchfleet.worker.cli import worker

if __name__ == "__main__":
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker(prog_name="python -m batchfleet.worker")
