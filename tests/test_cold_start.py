"""A worker's cold start (issue 56 item 2): the kernel choices measured once per CPU kind and shape are found again
(in this host's cache dir and in the fleet's Redis) instead of measured, a bad cache entry is measured again and
never stops a worker, the start's phases are logged, and the readiness probe says ready only once the worker
serves (a worker process: ready implies it answers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from batchfleet.common.keys import Keys
from batchfleet.worker.engine.native.kernel_cache import KernelChoices, entry_key
from batchfleet.worker.engine.native.linear import LinearFactory, onednn_available
from batchfleet.worker.health import ready
from tests.conftest import worker_config

FP = "0123456789abcdef"  # a fixed fingerprint: the cache's entries do not depend on which one
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN linear ops in this torch build")


def _weight() -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(0))  # [out, in] fp32


def _build(choices: KernelChoices):
    return LinearFactory("auto", choices)(_weight())


@needs_onednn
def test_a_cached_kernel_choice_is_not_measured_again(tmp_path: Path):
    first = KernelChoices(FP)
    lin = _build(first)
    assert (first.measured, first.hits) == (1, 0)
    first.save_file(tmp_path)
    again = KernelChoices(FP)
    assert set(again.load_file(tmp_path)) == set(first.entries)
    assert _build(again).block == lin.block and (again.measured, again.hits) == (0, 1)
    other_cpu = KernelChoices("fedcba9876543210")  # another CPU kind or torch build: another file, measured
    assert other_cpu.load_file(tmp_path) == {}
    _build(other_cpu)
    assert other_cpu.measured == 1


@needs_onednn
@pytest.mark.parametrize("stored", [b"{not json", b"\xff\xfe", json.dumps([1, 2]).encode(),
                                    json.dumps({"fingerprint": FP, "entries": "x"}).encode()])
def test_a_cache_that_does_not_parse_is_ignored(tmp_path: Path, stored: bytes):
    choices = KernelChoices(FP)
    choices.file(tmp_path).parent.mkdir(parents=True)
    choices.file(tmp_path).write_bytes(stored)
    assert choices.load_file(tmp_path) == {}
    _build(choices)
    assert choices.measured == 1


@needs_onednn
@pytest.mark.parametrize("bad", ["x", 999, -1, 1.5, [1], {"by_probe": {}}])
def test_a_corrupted_entry_is_measured_again_and_replaced(tmp_path: Path, bad: object):
    good = KernelChoices(FP)
    _build(good)
    (key,) = good.entries
    assert key == entry_key("block", 64, 32, "float32", torch.get_num_threads())
    doc = json.loads(good.document())
    doc["entries"][key] = bad
    good.file(tmp_path).parent.mkdir(parents=True)
    good.file(tmp_path).write_text(json.dumps(doc))
    choices = KernelChoices(FP)
    choices.load_file(tmp_path)
    _build(choices)
    assert (choices.measured, choices.hits) == (1, 0) and choices.entries[key] == good.entries[key]
    choices.save_file(tmp_path)
    assert json.loads(choices.file(tmp_path).read_text())["entries"][key] == good.entries[key]


@needs_onednn
def test_the_fleet_keeps_the_choices_in_redis(redis_url: str, namespace: str, tiny_model_dir: Path, tmp_path: Path):
    """A worker on a new host (an empty cache dir) finds what another worker of its CPU kind measured in Redis;
    something else under the key is ignored, then overwritten."""
    from batchfleet.worker.kernel_store import KernelStore

    cfg = worker_config(redis_url, namespace, tiny_model_dir, engine="native", cache_dir=str(tmp_path / "a"))
    first = KernelStore(cfg, KernelChoices(FP))
    first.read()
    _build(first.choices)
    first.write()
    r = redis.Redis.from_url(redis_url)
    assert json.loads(r.get(Keys(namespace).kernel_choices(FP)))["entries"] == first.choices.entries
    new_host = KernelStore(worker_config(redis_url, namespace, tiny_model_dir, cache_dir=str(tmp_path / "b")),
                           KernelChoices(FP))
    new_host.read()
    _build(new_host.choices)
    assert (new_host.choices.measured, new_host.choices.hits) == (0, 1)
    r.set(Keys(namespace).kernel_choices(FP), b"\x00garbage")
    third = KernelStore(worker_config(redis_url, namespace, tiny_model_dir, cache_dir=str(tmp_path / "c")),
                        KernelChoices(FP))
    third.read()
    _build(third.choices)
    third.write()
    assert third.choices.measured == 1
    assert json.loads(r.get(Keys(namespace).kernel_choices(FP)))["entries"] == first.choices.entries
    r.close()


def _spawn(redis_url: str, namespace: str, model: Path, cache: Path, name: str, log: Path) -> subprocess.Popen:
    args = ["--redis-url", redis_url, "--namespace", namespace, "--name", name, "--model", str(model),
            "--cache-dir", str(cache), "--max-seq-len", "256", "--buckets", "64,256", "--kv-cache-gb", "0.02"]
    return subprocess.Popen([sys.executable, "-m", "batchfleet.worker", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


def _until_ready(r: redis.Redis, keys: Keys, name: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 240
    while not ready(r, keys, name):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)


def test_a_ready_worker_answers_and_the_next_start_measures_nothing(redis_url: str, namespace: str,
                                                                      tiny_model_dir: Path, tmp_path: Path):
    """Two worker processes, each with an empty cache dir (two pods): the first measures and logs its phases; the
    moment the probe says ready it answers; the second finds every choice in Redis."""
    from batchfleet.producer import Client

    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    logs = []
    for i in range(2):
        name, log = f"cold-{i}", tmp_path / f"worker-{i}.log"
        proc = _spawn(redis_url, namespace, tiny_model_dir, tmp_path / f"cache-{i}", name, log)
        try:
            _until_ready(r, keys, name, proc, log)
            with Client(redis_url, namespace) as client:
                assert client.generate([5, 6, 7], max_new_tokens=2, timeout=60).completion_tokens == 2
        finally:
            proc.terminate()
            assert proc.wait(60) == 0
        logs.append(log.read_text())
    for text in logs:
        phases = [ln.split("start phase ")[1].split()[0] for ln in text.splitlines() if "start phase " in ln]
        assert {"imports", "model", "kernels", "engine", "join", "other"} <= set(phases), text
        assert "start total " in text
    measured = [int(text.split("found cached, ")[1].split()[0]) for text in logs]
    assert measured[0] > 0 and measured[1] == 0, logs
    r.close()


def test_a_joined_worker_is_live_but_not_ready_until_its_loop_serves(redis_url: str, namespace: str,
                                                                       tiny_model_dir: Path):
    """build_worker joins the fleet (a fresh heartbeat) without serving: the readiness probe says not ready, the
    liveness check live; the loop's first heartbeat (its status) makes it ready. A status left under the name by
    an earlier process does not count: joining drops it."""
    from batchfleet.worker.compose import build_worker

    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    cfg = worker_config(redis_url, namespace, tiny_model_dir, name="joined-0")
    r.set(keys.worker("joined-0"), b"left by a process that died", ex=30)
    loop = build_worker(cfg)
    try:
        assert ready(r, keys, "joined-0", serving=False) and not ready(r, keys, "joined-0")
        loop._heartbeat()  # what run() does first, once its read-ahead thread reads the streams
        assert ready(r, keys, "joined-0")
    finally:
        loop.observer.close()
        loop.transport.close()
        r.close()
