"""``python -m batchfleet.worker`` == ``batchfleet worker``, ending without the interpreter's teardown.

Once the command returns there is nothing left to clean up (replies written, entries handed back,
connections closed), while tearing down torch and transformers takes over a second (1.3 s measured): whoever
waits for the stopped process (the tests' spawned workers, a supervisor) would wait for nothing. So the process
leaves with ``os._exit`` once logs and output are flushed. Only here, where this module is the process: the
click command itself stays safe to call in-process, and ``batchfleet worker`` (the k8s and compose command)
still exits through the interpreter.
"""

import logging
import os
import sys

from batchfleet.worker.cli import worker

if __name__ == "__main__":
    try:
        worker(prog_name="python -m batchfleet.worker")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
