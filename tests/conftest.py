"""Shared fixtures: a real Redis (REDIS_URL, else 127.0.0.1:6379, else a private redis-server), a fresh
namespace per test (deleted afterwards), the tiny built-in model, and in-process / subprocess workers."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchfleet.common.config import ConnectionConfig, DynamicBatchingConfig, EngineConfig, WorkerConfig
from batchfleet.common.keys import Keys
from batchfleet.common.localredis import ensure_redis

TEST_BUCKETS = (32, 64, 128, 256)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url, private = ensure_redis(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    yield url
    if private is not None:
        private.stop()


@pytest.fixture
def namespace(redis_url: str) -> Iterator[str]:
    from batchfleet.worker.spawn import delete_namespace

    ns = f"t-{uuid.uuid4().hex[:10]}"
    yield ns
    delete_namespace(redis_url, Keys(ns))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bfcache")


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    from batchfleet.worker.engine.models import make_preset

    return make_preset("tiny", cache_dir / "models")


def worker_config(redis_url: str, namespace: str, model_dir: Path, **kw) -> WorkerConfig:
    """A WorkerConfig for tests: tiny model in fp32 on CPU, small buckets."""
    batching = DynamicBatchingConfig(
        max_wait_ms=kw.pop("max_wait_ms", 50.0), max_batch_size=kw.pop("max_batch_size", 32),
        max_seq_len=kw.pop("max_seq_len", 512), buckets=kw.pop("buckets", TEST_BUCKETS),
        padding=kw.pop("padding", "bucket"),
    )
    engine = EngineConfig(model=str(model_dir), engine=kw.pop("engine", "hf"), mode=kw.pop("mode", "dynamic"),
                          dtype=kw.pop("dtype", "float32"), block_size=kw.pop("block_size", 16),
                          kv_cache_gb=kw.pop("kv_cache_gb", None))
    return WorkerConfig(connection=ConnectionConfig(redis_url=redis_url, namespace=namespace),
                        batching=batching, engine=engine, **kw)


@pytest.fixture
def start_worker(redis_url: str, namespace: str, tiny_model_dir: Path, cache_dir: Path):
    """start_worker(**config overrides) -> a real worker loop in a thread; all are stopped at teardown."""
    from tests.test_reliability_helpers import LoopThread

    started: list[LoopThread] = []

    def start(**kw) -> LoopThread:
        model_dir = kw.pop("model_dir", tiny_model_dir)
        w = LoopThread(worker_config(redis_url, namespace, model_dir, **kw))
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
