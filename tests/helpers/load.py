"""Steady producer load for the failover tests (no tests here): threads that submit small jobs until stopped,
recording every enqueue that returned, then the answers those jobs got."""

from __future__ import annotations

import threading
import time

from batchfleet.producer import Client, Result, Timeout


class SteadyLoad:
    """``producers`` threads on one client, each submitting a 4-token job every ``every_s`` (none while
    ``burst`` is set). ``acked``: (monotonic time, job id) of every enqueue that returned; ``errors``: what
    ended a thread."""

    def __init__(self, client: Client, producers: int = 4, every_s: float = 0.05) -> None:
        self.client = client
        self.every_s = every_s
        self.acked: list[tuple[float, str]] = []
        self.errors: list[BaseException] = []
        self.burst = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in range(producers)]

    def start(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def _run(self, p: int) -> None:
        i = 0
        try:
            while not self._stop.is_set():
                job = f"p{p}-{i}"
                self.client.submit([10 + p, 11 + i % 50, 12], job_id=job, max_new_tokens=4)
                self.acked.append((time.monotonic(), job))
                i += 1
                self._stop.wait(0 if self.burst.is_set() else self.every_s)
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self, join_s: float = 30) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(join_s)

    def results(self, within_s: float) -> tuple[dict[str, Result], list[str]]:
        """(answer by job id, jobs not answered) of every acknowledged job, all within ``within_s``."""
        answered, lost = {}, []
        deadline = time.monotonic() + within_s
        for _, job in self.acked:
            try:
                answered[job] = self.client.result(job, timeout=max(0.001, deadline - time.monotonic()))
            except Timeout:
                lost.append(job)
        return answered, lost
