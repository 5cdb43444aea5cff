"""Structured outputs: what the per-step grammar mask costs, the fleet's engine against vLLM's CPU backend,
same model, same prompts, one run.

    python scripts/bench_structured.py --json docs/bench/structured.json

Each side runs the same requests twice, all submitted at once: free (greedy, ``ignore_eos``, a fixed
number of tokens) and constrained by a bounded JSON schema (greedy; the output ends when the schema is
complete, or at ``--max-new-tokens``; the default, 600, is above the schema's longest output: 40
characters of strings, each up to 12 bytes as an escaped surrogate pair, one token per byte with the
presets' tokenizer). Reported: tokens/s of both runs, constrained / free (the mask's cost), and how many
constrained outputs parse and validate. The fleet's side is the worker's engine in-process (native,
continuous, its defaults), so Redis is not measured here. vLLM runs in its own venv (``--vllm-python``,
see scripts/bench_vs_vllm.py) with its default structured-output backend.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import click
import jsonschema
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.wire.guided import Guide, dump_schema
from batchfleet.common.wire.params import Params
from batchfleet.worker.benchmark.cli import parse_range
from batchfleet.worker.benchmark.loadgen import make_workload
from batchfleet.worker.benchmark.report import machine, write_json
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import load_model, make_preset
from batchfleet.worker.engine.native.engine import NativeEngine
from benchlib.vllm_peer import run_offline

HERE = Path(__file__).resolve().parent
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}


def validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def fleet_engine(model_dir: Path, prompts: list, max_new: int, free_tokens: int) -> dict:
    """The worker's engine in-process: a free run, then a constrained one, same requests."""
    loaded = load_model(model_dir, "cpu", None)
    n = len(prompts)
    engine = NativeEngine(loaded, DynamicBatchingConfig(max_batch_size=n, max_seq_len=4096, buckets=(512,)),
                          EngineConfig(max_running=n))
    guide = Guide("json_schema", dump_schema(SCHEMA))

    def run(constrained: bool) -> tuple[float, list]:
        reqs = [GenRequest(id=f"{constrained}{i}", prompt=list(p), bucket=512,
                           params=Params(max_new_tokens=max_new if constrained else free_tokens,
                                         guide=guide if constrained else None)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        engine.add(reqs)
        done = []
        while engine.has_work():
            done += engine.step()
        return time.perf_counter() - t0, done

    run(True)  # warm-up: compiles the grammar's tokenizer once, as a worker does at its first such request
    free_wall, free = run(False)
    wall, done = run(True)
    tokens = sum(len(c.token_ids) for c in done)
    free_tokens_out = sum(len(c.token_ids) for c in free)
    return summary(free_tokens_out / free_wall, tokens, wall, [c.text for c in done],
                   [c.finish_reason for c in done])


def summary(free_tok_s: float, tokens: int, wall: float, texts: list, reasons: list) -> dict:
    return {"free_tok_s": round(free_tok_s, 1), "constrained_tok_s": round(tokens / wall, 1),
            "constrained_vs_free": round(tokens / wall / free_tok_s, 3), "constrained_tokens": tokens,
            "constrained_wall_s": round(wall, 2), "valid": sum(map(validates, texts)), "requests": len(texts),
            "finish_reasons": {r: reasons.count(r) for r in sorted(set(reasons))}}


def vllm(python: str, model_dir: Path, prompts: list, max_new: int, free_tokens: int) -> dict:
    def run(schema: dict | None, tokens: int) -> dict:
        spec = {"model": str(model_dir), "prompts": prompts, "max_new_tokens": [tokens] * len(prompts),
                "dtype": "bfloat16", "max_model_len": 4096, **({"json_schema": schema} if schema else {})}
        return run_offline(python, spec)

    free = run(None, free_tokens)
    con = run(SCHEMA, max_new)
    return summary(free["throughput_tok_s"], con["output_tokens"], con["wall_s"], con["texts"],
                   con["finish_reasons"])


@click.command(help=__doc__)
@click.option("--vllm-python", envvar="VLLM_PYTHON", default="/work/vllm-venv/bin/python", show_default=True)
@click.option("--requests", "n", type=int, default=16, show_default=True)
@click.option("--prompt-len", default="32-256", show_default=True)
@click.option("--max-new-tokens", "max_new", type=int, default=600, show_default=True)
@click.option("--free-tokens", type=int, default=64, show_default=True, help="Tokens per request, free run.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--cache-dir", default="~/.cache/batchfleet", show_default=True)
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(vllm_python: str, n: int, prompt_len: str, max_new: int, free_tokens: int, seed: int, cache_dir: str,
         json_path: str | None) -> None:
    torch.set_grad_enabled(False)
    model_dir = make_preset("bench", Path(cache_dir).expanduser() / "models", max_seq_len=4096)
    workload = make_workload(n, parse_range(prompt_len), (free_tokens, free_tokens), seed=seed)
    prompts = [list(p) for p in workload.prompts]
    click.echo("fleet engine (in-process) ...", err=True)
    ours = fleet_engine(model_dir, prompts, max_new, free_tokens)
    click.echo("vLLM CPU backend ...", err=True)
    theirs = vllm(vllm_python, model_dir, prompts, max_new, free_tokens)
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "scripts/bench_structured.py", *sys.argv[1:]]), "machine": machine(),
           "workload": {"requests": n, "prompt_len": prompt_len, "max_new_tokens": max_new,
                        "free_tokens": free_tokens, "seed": seed, "schema": SCHEMA, "model": "bench preset"},
           "fleet": ours, "vllm": theirs,
           "constrained_fleet_vs_vllm": round(ours["constrained_tok_s"] / theirs["constrained_tok_s"], 3)}
    click.echo("\n| run | free tok/s | constrained tok/s | constrained / free | valid | finish |\n"
               "|---|---:|---:|---:|---:|---|")
    for name, r in (("fleet engine", ours), ("vLLM CPU", theirs)):
        click.echo(f"| {name} | {r['free_tok_s']} | {r['constrained_tok_s']} | {r['constrained_vs_free']} | "
                   f"{r['valid']}/{r['requests']} | {r['finish_reasons']} |")
    click.echo(f"\nconstrained tok/s, fleet / vLLM = {doc['constrained_fleet_vs_vllm']}")
    if json_path:
        write_json(json_path, doc)


if __name__ == "__main__":
    main()
