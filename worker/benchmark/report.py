"""Bench output: the reference-style markdown table, the JSON document and the throughput/TTFT plot."""

from __future__ import annotations

import json
import platform
from pathlib import Path

COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("throughput_tok_s", "output tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("e2e_p50_ms", "e2e p50 ms", "{:.0f}"),
    ("e2e_p99_ms", "e2e p99 ms", "{:.0f}"),
    ("queue_p50_ms", "queue p50 ms", "{:.1f}"),
    ("mean_batch_size", "mean batch", "{:.1f}"),
    ("kv_waste_peak_slots", "KV waste peak (slots)", "{}"),
    ("kv_waste_contiguous_peak_slots", "contiguous waste (slots)", "{}"),
    ("errors", "errors", "{}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None or value == "":
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown_table(rows: list[dict], baseline: str | None = "static1") -> str:
    """Rows as a markdown table, plus a speed-up column against the baseline strategy if present."""
    base = next((r for r in rows if r.get("strategy") == baseline), None)
    header = [title for _, title, _ in COLUMNS] + ([f"x {baseline}"] if base else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row, key, fmt) for key, _, fmt in COLUMNS]
        if base:
            ratio = row.get("throughput_tok_s", 0) / base["throughput_tok_s"] if base["throughput_tok_s"] else 0
            cells.append(f"{ratio:.1f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    import os

    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2), **cpu_kind()}


def git_commit() -> str:
    """The short commit of the checkout this code runs from ("" outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile",
              "avx_ne_convert")


def cpu_kind() -> dict:
    """The CPU model name (lscpu's) and which of ``SIMD_FLAGS`` it has: what the kernels' choices depend on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    return {"cpu_model": model, "cpu_flags": [f for f in SIMD_FLAGS if f in flags]}


def write_json(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    """Two panels against TTFT p50, one labelled point per strategy: throughput (what a closed loop
    shows) and mean batch size (what an open loop below saturation shows: the wait buys batch size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("throughput_tok_s") and r.get("ttft_p50_ms") == r.get("ttft_p50_ms")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "throughput_tok_s", "output tokens / s"),
                           (axes[1], "mean_batch_size", "mean batch size")):
        ax.plot([r["ttft_p50_ms"] for r in pts], [r[key] for r in pts], "o-", color="tab:blue")
        for r in pts:
            ax.annotate(r["strategy"], (r["ttft_p50_ms"], r[key]), textcoords="offset points", xytext=(5, 5),
                        fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT p50 from submission (ms, log)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
