"""Prepared single-GPU benchmark (H100/H200), in phases that scripts/bench_gpu.sh runs one by one, each in its own
process under its own timeout, each writing its JSON as it goes (a phase cut short keeps what it finished).

No downloads: models are built from a config directly on the device with random weights. ``--phase``:

- ``correctness``: 16 greedy prompts through the native engine on a small model: the graph path (CUDA graphs;
  on CPU the same buckets run eagerly), the eager path (``--enforce-eager``) and, in fp32, the CPU reference (the
  same weights on this host's CPU); counts of identical token sequences and where the first difference falls.
- ``invariance``: batch invariance on the device (scripts/benchlib/invariance.py): a flood through the native
  engine, each background request compared with itself alone (tokens and logprobs), bf16 and fp32, on the
  ``small`` shape; with ``--batch-invariant``, the engine's batch-invariant mode.
- ``bench``: the 7B shape (Llama-2-7B, bf16) through the real worker loop, batcher and engine in-process (the
  in-memory transport stands in for Redis), 128 prompt / 128 new tokens, per client count (``--clients 32,64``)
  and strategy (continuous and the fixed 10/50/200 ms windows): tok/s, TTFT p50/p99, mean batch and the share
  of the HBM roofline (bytes per decode step = weights + the KV read so far, at the device's HBM bandwidth).
- ``profile``: one 7B decode step at 32 sequences: ms per step eager and replayed from its graph, the roofline's
  step time, and a torch.profiler table of the eager step's ops by device time; then a lone sequence's step
  (its tok/s: the issue's >= 150 target).
- ``summary``: every phase's JSON under ``--out-dir`` in one table and ``summary.json``.

    python scripts/bench_gpu.py --phase bench --device cuda --shape 7b       # what scripts/bench_gpu.sh runs
    python scripts/bench_gpu.py --phase correctness --device cpu --shape tiny   # CPU smoke runs (tests)
    python scripts/bench_gpu.py --device cpu --shape tiny --invariance --no-native-kernel
"""

from __future__ import annotations

import gc
import json
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from batchfleet.common.config import DynamicBatchingConfig, WorkerConfig
from batchfleet.common.engine_config import ENGINE_CHOICES, EngineConfig
from batchfleet.common.wire.params import Params
from batchfleet.worker.benchmark.loadgen import closed_loop, make_workload, summarize
from batchfleet.worker.benchmark.memqueue import MemClient, MemQueue
from batchfleet.worker.benchmark.strategies import parse_strategies
from batchfleet.worker.compose import build_worker
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import LoadedModel
from batchfleet.worker.engine.native.engine import NativeEngine
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
PHASES = ("bench", "correctness", "invariance", "profile", "summary")
HBM_TBS = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100", 2.0))  # by device name; first match
PROMPT_TOKENS = 128
PROFILE_ROWS = 25  # ops in the profile table
KV_CACHE_GB = 16.0  # the bench's KV pool on a GPU (default; --kv-cache-gb)


def build_model(shape: str, device: str, dtype: torch.dtype, head_scale: float = 1.0) -> LoadedModel:
    """A random Llama of ``shape`` built on ``device``; ``head_scale`` multiplies the lm_head (more spread between
    the greedy candidates: fewer near-ties where two devices' roundings may pick differently)."""
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, eos_token_id=EOS_ID, bos_token_id=1,
                         pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return LoadedModel(model=model, tokenizer=byte_level_tokenizer(), path=Path(f"llama-{shape}-random"),
                       device=torch.device(device), dtype=dtype)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else device


def hbm_tbs(device: str, given: float | None) -> float:
    """The roofline's bandwidth: ``given``, else by the device's name (else the H200's 4.8 TB/s)."""
    if given is not None:
        return given
    name = device_name(device)
    return next((tbs for key, tbs in HBM_TBS if key in name), 4.8)


def bytes_per_step(loaded: LoadedModel, batch: float, mean_ctx: float) -> float:
    """HBM bytes one decode step must read: every weight once, plus each sequence's K and V so far."""
    cfg = loaded.model.config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * loaded.dtype.itemsize
    return weights + batch * mean_ctx * kv_per_token


def write(path: str | None, doc: dict) -> None:
    """The phase's JSON so far (rewritten after each row: a phase killed by its timeout keeps its rows)."""
    if path:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")


@dataclass(frozen=True)
class Load:
    """What each strategy's run drives through the worker, and the roofline's bandwidth."""

    engine: str
    device: str
    requests: int | None
    new_tokens: int
    hbm_tbs: float | None
    kv_cache_gb: float | None
    enforce_eager: bool
    batch_invariant: bool


def engine_config(args: Load, mode: str, max_running: int = 64) -> EngineConfig:
    # a fixed pool on the GPU (64 sequences x 256 tokens of the 7B shape take 8.6 GB): sized from free memory, each
    # run's pool would depend on what the previous run left unfreed
    kv_gb = args.kv_cache_gb or (KV_CACHE_GB if args.device.startswith("cuda") else None)
    return EngineConfig(engine=args.engine, mode=mode, device=args.device, block_size=16, kv_cache_gb=kv_gb,
                        max_running=max_running, enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant)


def release(device: str) -> None:
    """Free the last run's engine (KV pool, graphs) before the next one is built."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run(loaded: LoadedModel, strategy: str, clients: int, args: Load) -> dict:
    """One closed-loop run of ``clients`` clients under ``strategy`` (batchfleet bench's names)."""
    s = parse_strategies(strategy)[0].worker_values()
    batching = DynamicBatchingConfig(max_wait_ms=s["max_wait_ms"], max_batch_size=s["max_batch_size"],
                                     window=s["window"], max_seq_len=1024, buckets=(128, 256))
    cfg = WorkerConfig(batching=batching, engine=engine_config(args, str(s["mode"]), max(64, clients)))
    queue = MemQueue("gpu", batching.buckets)
    loop = build_worker(cfg, transport=queue, loaded=loaded)  # the worker's one composition function
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    client = MemClient(queue)
    requests = args.requests or 2 * clients
    load = make_workload(requests, (PROMPT_TOKENS, PROMPT_TOKENS), (args.new_tokens, args.new_tokens), seed=0)
    closed_loop(client, make_workload(clients, (PROMPT_TOKENS, PROMPT_TOKENS), (4, 4), seed=1), clients)  # warm-up
    result = closed_loop(client, load, clients)
    loop.stopping.set()
    thread.join(120)
    del loop, thread
    release(args.device)
    row = summarize(strategy, result)
    batch = row["mean_batch_size"] or 1
    step_bytes = bytes_per_step(loaded, batch, PROMPT_TOKENS + args.new_tokens / 2)
    roofline_tok_s = batch * hbm_tbs(args.device, args.hbm_tbs) * 1e12 / step_bytes
    row.update(clients=clients, roofline_tok_s=round(roofline_tok_s, 1),
               roofline_share=round(row["throughput_tok_s"] / roofline_tok_s, 3),
               bytes_per_step_gb=round(step_bytes / 1e9, 3))
    return row


@click.command(help=__doc__)
@click.option("--phase", type=click.Choice(PHASES), default="bench", show_default=True)
@click.option("--device", default="cuda", show_default=True)
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="7b", show_default=True)
@click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="native", show_default=True)
@click.option("--strategies", default="continuous,fixed10,fixed50,fixed200", show_default=True,
              help="bench: batchfleet bench's strategy names (the hf engine runs the dynamic ones only).")
@click.option("--clients", default="32,64", show_default=True, help="bench: client counts, comma-separated.")
@click.option("--requests", type=int, default=None, help="bench: requests per run (default: 2 per client).")
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--hbm-tbs", type=float, default=None,
              help="HBM bandwidth for the roofline, TB/s (default: by device name, H200 4.8, H100 SXM 3.35).")
@click.option("--kv-cache-gb", type=float, default=None)
@click.option("--enforce-eager", is_flag=True, help="Decode op by op (no CUDA graphs).")
@click.option("--batch-invariant", is_flag=True, help="The engine's batch-invariant mode (CUDA).")
@click.option("--prompts", type=int, default=16, show_default=True, help="correctness: greedy prompts.")
@click.option("--check-tokens", type=int, default=32, show_default=True, help="correctness: tokens per prompt.")
@click.option("--batch", type=int, default=32, show_default=True, help="profile: sequences in the decode step.")
@click.option("--json", "json_path", default=None)
@click.option("--out-dir", default=".", show_default=True, help="summary: where the phases' JSON files are.")
@click.option("--invariance", is_flag=True, help="Same as --phase invariance.")
@click.option("--native-kernel/--no-native-kernel", default=True, show_default=True,
              help="On CPU: the C kernels or the torch path (what CUDA runs).")
def main(phase: str, shape: str, strategies: str, clients: str, prompts: int, check_tokens: int, batch: int,
         json_path: str | None, out_dir: str, invariance: bool, native_kernel: bool, **load) -> None:
    args = Load(**load)
    t0 = time.perf_counter()
    phase = "invariance" if invariance else phase
    if phase == "invariance":
        return check_invariance(shape, args, json_path, t0, native_kernel)
    if phase == "correctness":
        return check_correctness(shape, args.device, json_path, t0, prompts, check_tokens)
    if phase == "profile":
        return profile_step(shape, args, json_path, t0, batch)
    if phase == "summary":
        return summary(Path(out_dir))
    loaded = build_model(shape, args.device, torch.bfloat16)
    print(f"model {shape} built on {args.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    names = [s for s in strategies.split(",") if args.engine == "native" or s.startswith(("dynamic", "static"))]
    names = names or ["dynamic50"]  # the hf engine runs each batch to completion: its one column
    doc = {"device": args.device, "gpu": device_name(args.device), "shape": shape, "engine": args.engine,
           "enforce_eager": args.enforce_eager, "batch_invariant": args.batch_invariant,
           "hbm_tbs": hbm_tbs(args.device, args.hbm_tbs), "rows": []}
    for n in (int(c) for c in clients.split(",")):
        for name in names:
            r = run(loaded, name, n, args)
            doc["rows"].append(r)
            doc["total_s"] = round(time.perf_counter() - t0, 1)
            write(json_path, doc)
            print(f"{n} clients, {r['strategy']}: {r['throughput_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} "
                  f"ms, mean batch {r['mean_batch_size']:.1f}, roofline {r['roofline_tok_s']:.0f} tok/s -> "
                  f"{100 * r['roofline_share']:.1f}% of HBM roofline", flush=True)
    print(json.dumps(doc, indent=2))


# -- correctness ---------------------------------------------------------------------------------------------------
def greedy_tokens(loaded: LoadedModel, device: str, graph: str, prompts: list[list[int]], new_tokens: int,
                  native_kernel: bool = True) -> tuple[list[list[int]], object]:
    """Greedy continuations of ``prompts``, all decoding together, through the native engine, and the runner's
    decode graphs at the end (the buckets captured, or "off (...)" after a failed capture: its eager fallback would
    otherwise pass the graph-vs-eager check unseen)."""
    batching = DynamicBatchingConfig(max_batch_size=len(prompts), max_seq_len=512, buckets=(64, 128, 256))
    cfg = EngineConfig(engine="native", mode="continuous", device=device, block_size=16, kv_cache_gb=0.25,
                       max_running=len(prompts), native_kernel=native_kernel)
    engine = NativeEngine(loaded, batching, cfg, graph=graph)
    engine.add([GenRequest(id=str(i), prompt=p, bucket=next(b for b in batching.buckets if b >= len(p)),
                           params=Params(max_new_tokens=new_tokens)) for i, p in enumerate(prompts)])
    done = {}
    while engine.has_work():
        for c in engine.step():
            if c.error is not None:
                raise RuntimeError(f"request {c.id}: {c.error}")
            done[int(c.id)] = list(c.token_ids)
    return [done[i] for i in range(len(prompts))], engine.runner.describe()["decode_graphs"]


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many sequences are identical, and for the others the index of the first differing token."""
    first = [next((j for j, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b)
             if s != t]
    return {"identical": len(a) - len(first), "of": len(a), "first_difference_at": first}


def check_correctness(shape: str, device: str, json_path: str | None, t0: float, n: int = 16,
                      new_tokens: int = 32) -> None:
    """Greedy tokens of ``n`` prompts: graph path vs eager path (bf16, fp32), and vs the CPU reference (fp32)."""
    vocab = SHAPES[shape]["vocab_size"]
    g = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(4, vocab, (8 + 13 * i % 120,), generator=g).tolist() for i in range(n)]
    graph = "captured" if device.startswith("cuda") else "eager"
    doc: dict = {"device": device, "gpu": device_name(device), "shape": shape, "graph": graph, "prompts": n,
                 "new_tokens": new_tokens, "rows": []}
    for dtype in (torch.bfloat16, torch.float32):
        loaded = build_model(shape, device, dtype, head_scale=4.0)
        # the torch path on the device and for both here (on CPU the C kernels would otherwise run the eager path)
        graphed, graphs = greedy_tokens(loaded, device, graph, prompts, new_tokens, native_kernel=False)
        eager, _ = greedy_tokens(loaded, device, "off", prompts, new_tokens, native_kernel=False)
        row = {"dtype": str(dtype).removeprefix("torch."), "graph_vs_eager": compare(graphed, eager), "graphs": graphs}
        if dtype == torch.float32:  # the same weights on this host's CPU (the C kernels: the CPU default path)
            cpu = replace(loaded, model=loaded.model.to("cpu"), device=torch.device("cpu"))
            row["graph_vs_cpu"] = compare(graphed, greedy_tokens(cpu, "cpu", "off", prompts, new_tokens)[0])
        doc["rows"].append(row)
        doc["total_s"] = round(time.perf_counter() - t0, 1)
        write(json_path, doc)
        print(f"correctness {row['dtype']} (graphs {graphs}): graph vs eager {row['graph_vs_eager']['identical']}/{n}"
              " identical"
              + (f", graph vs CPU reference {row['graph_vs_cpu']['identical']}/{n} (first differences at "
                 f"{row['graph_vs_cpu']['first_difference_at']})" if "graph_vs_cpu" in row else ""), flush=True)
        del loaded
    print(json.dumps(doc, indent=2))


# -- invariance ----------------------------------------------------------------------------------------------------
def check_invariance(shape: str, args: Load, json_path: str | None, t0: float, native_kernel: bool) -> None:
    """Print, per dtype, how many of the flood's background requests differ from themselves alone."""
    device = args.device
    doc: dict = {"device": device, "gpu": device_name(device), "shape": shape,
                 "batch_invariant_mode": args.batch_invariant, "invariance": []}
    for dtype in (torch.bfloat16, torch.float32):
        row = flood_vs_alone(build_model(shape, device, dtype), device, native_kernel, args.batch_invariant)
        doc["invariance"].append(row)
        doc["total_s"] = round(time.perf_counter() - t0, 1)
        write(json_path, doc)
        print(f"batch invariance on {device} ({shape}, {row['dtype']}, mode {'on' if args.batch_invariant else 'off'}, "
              f"prefill {row['prefill']}, attention {row['attention']}, graphs {row['decode_graphs']}): "
              f"{row['differ']}/{row['targets']} requests differ from themselves alone ({row['tokens_differ']} in "
              f"tokens; {row['preemptions']} preemptions, {row['prefix_cache_hits']} prefix-hit tokens, "
              f"{row['steps']} steps)", flush=True)
    print(json.dumps(doc, indent=2))


# -- profile -------------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _ms_per_step(engine: NativeEngine, device: str, steps: int) -> float:
    engine.step()  # a new bucket is captured here, outside the timing
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    return 1000 * (time.perf_counter() - t) / steps


def _decoding_engine(loaded: LoadedModel, args: Load, shape: str, batch: int, steps: int) -> NativeEngine:
    """An engine with ``batch`` sequences of PROMPT_TOKENS prefilled, decoding (room for 4 * steps + 16 tokens)."""
    batching = DynamicBatchingConfig(max_batch_size=batch, max_seq_len=1024, buckets=(128, 256))
    engine = NativeEngine(loaded, batching, engine_config(args, "continuous"), max_prefill_tokens=batch * PROMPT_TOKENS)
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape]["vocab_size"]
    engine.add([GenRequest(id=str(i), prompt=torch.randint(4, vocab, (PROMPT_TOKENS,), generator=g).tolist(),
                           bucket=128, params=Params(max_new_tokens=4 * steps + 16)) for i in range(batch)])
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    return engine


def _step_ms(engine: NativeEngine, device: str, steps: int) -> tuple[float, float | None]:
    """ms per decode step eager, then replayed from its graph (None without graphs)."""
    graphs = engine.runner.graphs
    engine.runner.graphs = None
    eager_ms = _ms_per_step(engine, device, steps)
    engine.runner.graphs = graphs
    return eager_ms, (_ms_per_step(engine, device, steps) if graphs is not None else None)


def profile_step(shape: str, args: Load, json_path: str | None, t0: float, batch: int = 32, steps: int = 5) -> None:
    """One decode step of ``batch`` sequences at context ~PROMPT_TOKENS: eager and graph ms per step, and the
    eager step's ops by device time (torch.profiler); then a lone sequence's step (its tok/s)."""
    device, cuda = args.device, args.device.startswith("cuda")
    loaded = build_model(shape, device, torch.bfloat16)
    engine = _decoding_engine(loaded, args, shape, batch, steps)
    graphs = engine.runner.graphs
    eager_ms, graph_ms = _step_ms(engine, device, steps)
    step_bytes = bytes_per_step(loaded, batch, PROMPT_TOKENS + 2 * steps)
    roofline_ms = 1000 * step_bytes / (hbm_tbs(device, args.hbm_tbs) * 1e12)
    engine.runner.graphs = None  # profile the eager step: the ops one by one (a replay is one graph launch)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        engine.step()
        _sync(device)
    engine.runner.graphs = graphs
    ops = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        dev_us = getattr(e, "cuda_time_total", 0) if dev_us is None else dev_us
        ops.append({"op": e.key, "calls": e.count, "device_ms": round(dev_us / 1000, 3),
                    "cpu_ms": round(e.cpu_time_total / 1000, 3)})
    key = "device_ms" if cuda else "cpu_ms"
    ops = sorted((o for o in ops if not o["op"].startswith("ProfilerStep")), key=lambda o: -o[key])[:PROFILE_ROWS]
    doc = {"device": device, "gpu": device_name(device), "shape": shape, "batch": batch,
           "eager_ms_per_step": round(eager_ms, 3), "graph_ms_per_step": graph_ms and round(graph_ms, 3),
           "roofline_ms_per_step": round(roofline_ms, 3), "sorted_by": key, "ops": ops,
           "total_s": round(time.perf_counter() - t0, 1)}
    write(json_path, doc)
    print(f"decode step, {batch} sequences: eager {eager_ms:.2f} ms, graph "
          f"{'-' if graph_ms is None else f'{graph_ms:.2f}'} ms, HBM roofline {roofline_ms:.2f} ms")
    print("| op | calls | device ms | cpu ms |\n|---|---:|---:|---:|")
    for o in ops:
        print(f"| {o['op'][:60]} | {o['calls']} | {o['device_ms']:.3f} | {o['cpu_ms']:.3f} |")
    del engine, graphs
    release(device)
    lone_eager, lone_graph = _step_ms(_decoding_engine(loaded, args, shape, 1, steps), device, steps)
    doc.update(lone_eager_ms_per_step=round(lone_eager, 3), lone_graph_ms_per_step=lone_graph and round(lone_graph, 3),
               lone_tok_s=round(1000 / (lone_graph or lone_eager), 1), total_s=round(time.perf_counter() - t0, 1))
    write(json_path, doc)
    print(f"a lone sequence: eager {lone_eager:.2f} ms, graph {'-' if lone_graph is None else f'{lone_graph:.2f}'} "
          f"ms per step -> {doc['lone_tok_s']} tok/s")


# -- summary -------------------------------------------------------------------------------------------------------
def summary(out: Path) -> None:
    """One table of every phase's JSON under ``out`` (files of scripts/bench_gpu.sh), and summary.json."""
    docs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "summary"}
    lines = []
    for name, doc in docs.items():
        for r in doc.get("rows", []):
            if "graph_vs_eager" in r:
                cpu = r.get("graph_vs_cpu")
                off = isinstance(r.get("graphs"), str)  # "off (capture ... failed: ...)": eager on both sides
                lines.append(f"| {name} | {r['dtype']} | graph = eager: {r['graph_vs_eager']['identical']}/"
                             f"{r['graph_vs_eager']['of']}" + (f"; graph = CPU: {cpu['identical']}/{cpu['of']}"
                                                                  if cpu else "")
                             + (f" (graphs {r['graphs']})" if off else "") + " |")
            elif "throughput_tok_s" in r:
                lines.append(f"| {name} | {r.get('clients', '')} clients, {r['strategy']} | "
                             f"{r['throughput_tok_s']:,.0f} tok/s, TTFT p50 {r['ttft_p50_ms']:,.0f} ms, "
                             f"roofline {100 * r['roofline_share']:.1f}% |")
        for r in doc.get("invariance", []):
            lines.append(f"| {name} | {r['dtype']}, mode {'on' if r.get('batch_invariant') else 'off'} | "
                         f"{r['differ']}/{r['targets']} differ ({r['tokens_differ']} in tokens) |")
        if "ops" in doc:
            lines.append(f"| {name} | decode step, {doc['batch']} seqs | eager {doc['eager_ms_per_step']} ms, graph "
                         f"{doc['graph_ms_per_step']} ms, roofline {doc['roofline_ms_per_step']} ms; a lone "
                         f"sequence {doc.get('lone_tok_s', '-')} tok/s |")
    table = "| phase | what | result |\n|---|---|---|\n" + "\n".join(lines)
    print(table)
    (out / "summary.json").write_text(json.dumps({"phases": docs, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
