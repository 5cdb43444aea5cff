"""Headless Chromium for the dashboard tests (no tests here): the DOM after the page's script ran (and the HTTP
requests the load made, from Chromium's own net log), and a small parser that finds rows by their data
attributes and elements by id."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                    "(apt-get install -y chromium; .ci/run installs it)")


def chromium(url: str, *flags: str) -> str:
    """The DOM after the page ran its script (virtual time lets its first poll finish)."""
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--virtual-time-budget=5000", *flags, "--dump-dom", url],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def chromium_requests(url: str, *flags: str) -> tuple[str, list[tuple[str, int]]]:
    """The DOM (as ``chromium``) and every HTTP request the load made that got an answer: (url, status), in
    order, read from Chromium's net log (``--log-net-log``), so the favicon request a browser makes on its own
    is there too."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "net.json"
        dom = chromium(url, f"--log-net-log={log}", *flags)
        return dom, answered(json.loads(log.read_text()))


def answered(net_log: dict[str, Any]) -> list[tuple[str, int]]:
    """(url, HTTP status) of each request of a Chromium net log that got response headers."""
    kinds = {v: k for k, v in net_log["constants"]["logEventTypes"].items()}
    urls: dict[int, str] = {}
    out = []
    for event in net_log["events"]:
        kind, params, source = kinds.get(event["type"]), event.get("params") or {}, event["source"]["id"]
        if kind == "URL_REQUEST_START_JOB" and "url" in params:
            urls[source] = params["url"]
        elif kind == "HTTP_TRANSACTION_READ_RESPONSE_HEADERS" and source in urls:
            out.append((urls[source], int(params["headers"][0].split()[1])))  # "HTTP/1.1 404 Not Found"
    return out


class Dom(HTMLParser):
    """Rows by their data attributes (and their cells' text, ``cells``) and the text of each element with
    an id."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.text: dict[str, str] = {}
        self.tags: list[str] = []
        self._open: list[str] = []
        self.style: dict[str, str] = {}
        self.charts: dict[str, dict[str, str]] = {}  # an inline SVG chart's attributes by its data-chart name
        self._row = False  # inside a row with data attributes
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "tr":
            self._row = any(k.startswith("data-") for k in a)
            if self._row:
                self.rows.append({**a, "cells": []})
        elif tag == "td" and self._row:
            self.rows[-1]["cells"].append("")
        if "data-chart" in a:
            self.charts[a["data-chart"]] = a
        if "id" in a:
            self.style[a["id"]] = a.get("style") or ""
        self._open.append(a.get("id", ""))
        for i in filter(None, self._open):
            self.text.setdefault(i, "")

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        if self._row and self.rows[-1]["cells"] and self.tags[-1] in ("td", "span"):
            self.rows[-1]["cells"][-1] += data
        for i in filter(None, self._open):
            self.text[i] = self.text.get(i, "") + data
