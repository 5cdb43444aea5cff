"""A real Prometheus server for tests (the ``prometheus`` binary, e.g. Debian's package): scrapes the given
targets every second, with the labels a ServiceMonitor would add, and answers queries on a free port."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from batchfleet.worker.devtools import free_port
from tests.helpers.keda import PrometheusQuery
from tests.helpers.loops import wait_until

BINARY = shutil.which("prometheus")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextmanager
def prometheus(folder: Path, targets: list[int], labels: dict[str, str]) -> Iterator[PrometheusQuery]:
    """Prometheus scraping http://127.0.0.1:PORT/metrics of each of ``targets`` every second, their samples
    labelled ``labels``; yields its query API. Stopped at the end."""
    assert BINARY is not None, "no prometheus binary (skip before calling)"
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "batchfleet", "static_configs": [
                  {"targets": [f"127.0.0.1:{p}" for p in targets], "labels": labels}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([BINARY, f"--config.file={folder / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: proc.poll() is not None or _ready(url), 120, "prometheus ready", every_s=0.2)
        assert proc.poll() is None, (folder / "prometheus.log").read_text()[-2000:]
        yield PrometheusQuery(url)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
