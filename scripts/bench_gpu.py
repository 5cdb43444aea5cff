"""Prepared single-GPU benchmark (H200): a Llama-2-7B-shaped model with random bf16 weights.

No downloads: the model is built from a config directly on the device. The real worker loop, batcher
and engine run in-process (the in-memory transport stands in for Redis, which the GPU host may lack).
32 concurrent clients, 128 prompt tokens, 128 new tokens, dynamic 50 ms and continuous. Prints tok/s
and the share of the HBM roofline (bytes per decode step = weights + KV read, at --hbm-tbs TB/s).

    python scripts/bench_gpu.py --device cuda --shape 7b           # the H200 run (scripts/bench_gpu.sh)
    python scripts/bench_gpu.py --device cpu --shape tiny --requests 8   # CPU smoke run (tests)

``--invariance``: instead, batch invariance on the device (scripts/benchlib/invariance.py): a small flood
through the native engine with the device's defaults, each background request compared with itself alone
(tokens and logprobs), in bf16 and fp32 on the ``small`` shape; prints how many differ.

    python scripts/bench_gpu.py --device cuda --shape small --invariance
    python scripts/bench_gpu.py --device cpu --shape tiny --invariance --no-native-kernel  # the torch path here
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from batchfleet.common.config import DynamicBatchingConfig, WorkerConfig
from batchfleet.common.engine_config import ENGINE_CHOICES, EngineConfig
from batchfleet.worker.benchmark.loadgen import closed_loop, make_workload, summarize
from batchfleet.worker.benchmark.memqueue import MemClient, MemQueue
from batchfleet.worker.compose import build_worker
from batchfleet.worker.engine.models import LoadedModel
from batchfleet.worker.engine.tokenizer import EOS_ID, byte_level_tokenizer
from benchlib.invariance import flood_vs_alone

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=320),
}


def build_model(shape: str, device: str, dtype: torch.dtype) -> LoadedModel:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, eos_token_id=EOS_ID, bos_token_id=1,
                         pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return LoadedModel(model=model, tokenizer=byte_level_tokenizer(), path=Path(f"llama-{shape}-random"),
                       device=torch.device(device), dtype=dtype)


def bytes_per_step(loaded: LoadedModel, batch: float, mean_ctx: float) -> float:
    """HBM bytes one decode step must read: every weight once, plus each sequence's K and V so far."""
    cfg = loaded.model.config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * loaded.dtype.itemsize
    return weights + batch * mean_ctx * kv_per_token


@dataclass(frozen=True)
class Load:
    """What each mode's run drives through the worker, and the roofline's bandwidth."""

    engine: str
    device: str
    clients: int
    requests: int
    new_tokens: int
    hbm_tbs: float
    kv_cache_gb: float | None


def run(loaded: LoadedModel, mode: str, args: Load) -> dict:
    batching = DynamicBatchingConfig(max_wait_ms=50, max_batch_size=32, max_seq_len=1024, buckets=(128, 256))
    engine_cfg = EngineConfig(engine=args.engine, mode=mode, device=args.device, block_size=16,
                              kv_cache_gb=args.kv_cache_gb)
    cfg = WorkerConfig(batching=batching, engine=engine_cfg)
    queue = MemQueue("gpu", batching.buckets)
    loop = build_worker(cfg, transport=queue, loaded=loaded)  # the worker's one composition function
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    client = MemClient(queue)
    load = make_workload(args.requests, (128, 128), (args.new_tokens, args.new_tokens), seed=0)
    warm = make_workload(4, (128, 128), (4, 4), seed=1)
    closed_loop(client, warm, 4)
    result = closed_loop(client, load, args.clients)
    loop.stopping.set()
    thread.join(120)
    row = summarize(f"{mode}" + ("50" if mode == "dynamic" else ""), result)
    batch = row["mean_batch_size"] or 1
    step_bytes = bytes_per_step(loaded, batch, 128 + args.new_tokens / 2)
    roofline_tok_s = batch * args.hbm_tbs * 1e12 / step_bytes
    row.update(roofline_tok_s=round(roofline_tok_s, 1),
               roofline_share=round(row["throughput_tok_s"] / roofline_tok_s, 3),
               bytes_per_step_gb=round(step_bytes / 1e9, 3))
    return row


@click.command(help=__doc__)
@click.option("--device", default="cuda", show_default=True)
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="7b", show_default=True)
@click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="native", show_default=True)
@click.option("--modes", default="dynamic,continuous", show_default=True)
@click.option("--clients", type=int, default=32, show_default=True)
@click.option("--requests", type=int, default=96, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--hbm-tbs", type=float, default=4.8, show_default=True,
              help="HBM bandwidth for the roofline, TB/s (H200: 4.8).")
@click.option("--kv-cache-gb", type=float, default=None)
@click.option("--json", "json_path", default=None)
@click.option("--invariance", is_flag=True, help="Only check batch invariance (bf16 and fp32); no throughput.")
@click.option("--native-kernel/--no-native-kernel", default=True, show_default=True,
              help="With --invariance on CPU: the C kernels or the torch path (what CUDA/NPU run).")
def main(shape: str, modes: str, json_path: str | None, invariance: bool, native_kernel: bool, **load) -> None:
    args = Load(**load)
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    if invariance:
        return check_invariance(shape, args.device, json_path, t0, native_kernel)
    loaded = build_model(shape, args.device, dtype)
    print(f"model {shape} built on {args.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for mode in modes.split(","):
        if args.engine == "hf" and mode == "continuous":
            continue
        rows.append(run(loaded, mode, args))
        r = rows[-1]
        print(f"{r['strategy']}: {r['throughput_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
              f"mean batch {r['mean_batch_size']:.1f}, roofline {r['roofline_tok_s']:.0f} tok/s "
              f"-> {100 * r['roofline_share']:.1f}% of HBM roofline", flush=True)
    doc = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "",
           "shape": shape, "engine": args.engine, "rows": rows, "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(doc, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")


def check_invariance(shape: str, device: str, json_path: str | None, t0: float, native_kernel: bool) -> None:
    """Print, per dtype, how many of the flood's background requests differ from themselves alone."""
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        row = flood_vs_alone(build_model(shape, device, dtype), device, native_kernel)
        rows.append(row)
        print(f"batch invariance on {device} ({shape}, {row['dtype']}, prefill {row['prefill']}, attention "
              f"{row['attention']}): {row['differ']}/{row['targets']} requests differ from themselves alone "
              f"({row['tokens_differ']} in tokens; {row['preemptions']} preemptions, {row['prefix_cache_hits']} "
              f"prefix-hit tokens, {row['steps']} steps)", flush=True)
    doc = {"device": device, "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "",
           "shape": shape, "invariance": rows, "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(doc, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
