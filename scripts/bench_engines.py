"""Benchmark the native engine against the hf engine and transformers' own continuous batching.

In-process, identical requests for every engine: the ``bench`` preset (~130M Llama, random weights,
bf16 by default), N concurrent requests, prompts uniformly in [min, max] tokens, max_new_tokens
uniformly in [min, max], greedy. Reports output tokens/s per engine and ratios to native, plus the
native decode step time at full batch against the same step's weight matmuls timed alone.

    python scripts/bench_engines.py --json bench.json

Timing on a small shared machine is noisy: run it when the machine is otherwise idle.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import click
import torch

from batchfleet.common.config import DynamicBatchingConfig, parse_buckets
from batchfleet.common.engine_config import DTYPE_CHOICES, EngineConfig
from batchfleet.common.wire.params import Params
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import LoadedModel, load_model, make_preset
from batchfleet.worker.engine.native.engine import NativeEngine
from batchfleet.worker.engine.tokenizer import EOS_ID, PAD_ID
from benchlib.floor import matmul_ms, time_ms


def make_requests(args) -> list[GenRequest]:
    g = torch.Generator().manual_seed(args.seed)
    reqs = []
    for i in range(args.requests):
        n = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=g))
        new = int(torch.randint(args.min_new, args.max_new + 1, (1,), generator=g))
        prompt = [1] + torch.randint(4, 32000, (n - 1,), generator=g).tolist()
        bucket = next(b for b in args.buckets if b >= n)
        reqs.append(GenRequest(id=f"r{i}", prompt=prompt, bucket=bucket, params=Params(max_new_tokens=new)))
    return reqs


def batching(args) -> DynamicBatchingConfig:
    return DynamicBatchingConfig(max_batch_size=args.requests, max_seq_len=args.max_seq_len,
                                 buckets=tuple(args.buckets), padding="longest")


def drive(engine, reqs: list[GenRequest], on_step=None) -> tuple[float, dict]:
    """Add everything, step until idle; returns (wall seconds, {id: Completion})."""
    done = {}
    t0 = time.perf_counter()
    engine.add(reqs)
    while engine.has_work():
        s = time.perf_counter()
        out = engine.step()
        if on_step is not None:
            on_step(time.perf_counter() - s)
        for c in out:
            done[c.id] = c
    return time.perf_counter() - t0, done


def warm(engine) -> None:
    drive(engine, [GenRequest(id="w0", prompt=[1] + [5] * 40, bucket=64, params=Params(max_new_tokens=4)),
                   GenRequest(id="w1", prompt=[1] + [6] * 20, bucket=64, params=Params(max_new_tokens=6))])


def bench_native(loaded: LoadedModel, reqs, args) -> dict:
    cfg = EngineConfig(engine="native", mode="continuous", block_size=args.block_size)
    engine = NativeEngine(loaded, batching(args), cfg)
    warm(engine)
    steps: list[tuple[bool, int, float]] = []  # (prefill?, batch size, seconds)

    def on_step(dt: float) -> None:
        st = engine.stats()
        steps.append((st["prefill_steps"] > on_step.prefills, len(engine.last_step_ids), dt))
        on_step.prefills = st["prefill_steps"]

    on_step.prefills = engine.stats()["prefill_steps"]
    wall, done = drive(engine, reqs, on_step)
    full = [dt for pre, b, dt in steps if not pre and b == args.requests]
    step_ms = statistics.median(full) * 1000 if full else float("nan")
    mm_ms = matmul_ms(engine, args.requests)
    st = engine.stats()
    return dict(engine="native", wall_s=wall, done=done, decode_step_ms=step_ms, matmul_ms=mm_ms,
                prefill_s=sum(dt for pre, _, dt in steps if pre), decode_attention=engine.runner.decode_mode,
                prefill_layout=engine.runner.prefill_mode, kv_blocks_total=st["kv_blocks_total"],
                kv_blocks_peak=st["kv_blocks_peak"], kv_slots_wasted_peak=st["kv_slots_wasted_peak"],
                kv_slots_wasted_contiguous_peak=st["kv_slots_wasted_contiguous_peak"],
                preemptions=st["preemptions"])


def bench_hf(loaded: LoadedModel, reqs, args) -> dict:
    try:
        from batchfleet.worker.engine.hf import HFEngine
    except ImportError:  # the hf engine is not there yet: plain left-padded generate
        HFEngine = None
    if HFEngine is None:
        return bench_plain_generate(loaded, reqs, args)
    engine = HFEngine(loaded, batching(args))
    warm(engine)
    wall, done = drive(engine, reqs)
    return dict(engine="hf", wall_s=wall, done=done)


def bench_plain_generate(loaded: LoadedModel, reqs, args) -> dict:
    t0 = time.perf_counter()
    width = max(len(r.prompt) for r in reqs)
    ids = torch.full((len(reqs), width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt):] = 1
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD_ID,
                                    max_new_tokens=max(r.params.max_new_tokens for r in reqs))
    done = {r.id: _Toks(_trim(out[i, width:].tolist(), r.params.max_new_tokens)) for i, r in enumerate(reqs)}
    return dict(engine="hf(generate)", wall_s=time.perf_counter() - t0, done=done)


class _Toks:
    def __init__(self, toks: list[int]) -> None:
        self.token_ids = toks


def _trim(toks: list[int], n: int) -> list[int]:
    toks = toks[:n]
    return toks[: toks.index(EOS_ID) + 1] if EOS_ID in toks else toks


def bench_generate_batch(loaded: LoadedModel, reqs, args) -> dict:
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.params.max_new_tokens for r in reqs),
                          eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model = loaded.model
    t0 = time.perf_counter()
    done = {}
    with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=5) as mgr:
        for r in reqs:  # per-request max_new_tokens through the manager API
            mgr.add_request(r.prompt, request_id=r.id, max_new_tokens=r.params.max_new_tokens)
        while len(done) < len(reqs):
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                done[res.request_id] = _Toks(list(res.generated_tokens))
            elif res is None and not mgr.is_running():
                raise RuntimeError("generate_batch manager stopped")
    return dict(engine="generate_batch", wall_s=time.perf_counter() - t0, done=done)


def bench_attention(args, flex: bool) -> dict[str, float]:
    """One layer's decode attention at the bench shape (ms): gather + SDPA, the C kernel, optionally
    compiled FlexAttention over the block pool (compile time reported separately)."""
    from batchfleet.worker.engine.native import attention as A
    from batchfleet.worker.engine.native import cpu_kernel

    B, H, D, bs, ctx_len = args.requests, 12, 64, args.block_size, args.attn_ctx
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    ctx = torch.full((B,), ctx_len)
    M = -(-ctx_len // bs)
    nb = B * M
    pool = torch.randn(2, nb + 1, bs, H, D, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g).view(B, M).contiguous()
    q = torch.randn(B, H, D, generator=g).to(dtype)
    mask = A.decode_mask(ctx, M * bs)
    out = {"gather_sdpa_ms": time_ms(lambda: A.decode_attention_gather(q, pool, tables, mask, D**-0.5))}
    if (lib := cpu_kernel.load()) is not None:
        nt = torch.get_num_threads()
        out["kernel_ms"] = time_ms(lambda: cpu_kernel.paged_decode(lib, q, pool, tables, ctx, D**-0.5, nt))
    if flex:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        owner = torch.full((nb + 1,), -1)
        lpos = torch.zeros(nb + 1, dtype=torch.long)
        for b in range(B):
            owner[tables[b]] = b
            lpos[tables[b]] = torch.arange(M)

        def mask_mod(b, h, qi, kv):
            blk = kv // bs
            return (owner[blk] == b) & (lpos[blk] * bs + kv % bs < ctx[b])

        kv_idx = torch.zeros(B, 1, 1, nb + 1, dtype=torch.int32)
        kv_idx[:, 0, 0, :M] = tables.int()
        bm = BlockMask.from_kv_blocks(torch.full((B, 1, 1), M, dtype=torch.int32), kv_idx, BLOCK_SIZE=(1, bs),
                                      mask_mod=mask_mod, seq_lengths=(1, (nb + 1) * bs))
        k = pool[0].view(1, -1, H, D).transpose(1, 2)  # the whole pool as one sequence: [1, H, slots, D]
        v = pool[1].view(1, -1, H, D).transpose(1, 2)
        fa = torch.compile(flex_attention, dynamic=False)
        t = time.perf_counter()
        fa(q[:, :, None], k, v, block_mask=bm)
        out["flex_compile_s"] = time.perf_counter() - t
        out["flex_ms"] = time_ms(lambda: fa(q[:, :, None], k, v, block_mask=bm))
    return out


ENGINES = {"native": bench_native, "hf": bench_hf, "generate_batch": bench_generate_batch}


@click.command(help=__doc__)
@click.option("--engines", default="native,hf,generate_batch", show_default=True, help=f"Any of {sorted(ENGINES)}.")
@click.option("--cache-dir", default=str(Path(EngineConfig.cache_dir) / "models"), show_default=True,
              help="Where the bench preset is created.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="bfloat16", show_default=True)
@click.option("--requests", type=int, default=32, show_default=True)
@click.option("--min-prompt", type=int, default=32, show_default=True)
@click.option("--max-prompt", type=int, default=512, show_default=True)
@click.option("--min-new", type=int, default=16, show_default=True)
@click.option("--max-new", type=int, default=256, show_default=True)
@click.option("--buckets", type=parse_buckets, metavar="N,N,...", default="64,128,256,512", show_default=True)
@click.option("--max-seq-len", type=int, default=1024, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", default=None, help="Write the report as JSON here.")
@click.option("--repeat", type=int, default=1, show_default=True, help="runs per engine; the fastest is reported")
@click.option("--attention", is_flag=True, help="also time one layer's decode attention paths")
@click.option("--flex", is_flag=True, help="with --attention: include compiled FlexAttention")
@click.option("--attn-ctx", type=int, default=300, show_default=True, help="context length for --attention")
def main(**options) -> None:
    args = SimpleNamespace(**options)  # the functions above read the options as attributes
    loaded = load_model(make_preset("bench", Path(args.cache_dir).expanduser()), "cpu", args.dtype)
    reqs = make_requests(args)
    results = []
    for name in args.engines.split(","):
        runs = []
        for i in range(args.repeat):
            print(f"running {name} ({i + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            res = ENGINES[name](loaded, [replace(r) for r in reqs], args)
            res["output_tokens"] = sum(len(c.token_ids) for c in res.pop("done").values())
            print(f"  {name}: {res['output_tokens']} tokens in {res['wall_s']:.1f} s", file=sys.stderr, flush=True)
            runs.append(res)
        res = min(runs, key=lambda r: r["wall_s"])  # the least disturbed run
        res["wall_s_all"] = [r["wall_s"] for r in runs]
        res["tok_s"] = res["output_tokens"] / res["wall_s"]
        results.append(res)
    native = next((r for r in results if r["engine"] == "native"), None)
    for r in results:
        r["native_speedup"] = native["tok_s"] / r["tok_s"] if native else None
    report = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(["python", *sys.argv]),
        machine=f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        torch=torch.__version__, dtype=args.dtype, requests=args.requests,
        prompt_range=[args.min_prompt, args.max_prompt], new_range=[args.min_new, args.max_new],
        prompt_tokens=sum(len(r.prompt) for r in reqs), results=results,
    )
    if args.attention:
        report["attention"] = dict(batch=args.requests, ctx=args.attn_ctx, **bench_attention(args, args.flex))
    print(markdown(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))


def markdown(report: dict) -> str:
    lines = ["| engine | output tokens | wall s | tok/s | native speedup |", "|---|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['engine']} | {r['output_tokens']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | "
                     f"{r['native_speedup']:.2f}x |")
    native = next((r for r in report["results"] if r["engine"] == "native"), None)
    if native:
        lines += ["", f"native decode step at batch {report['requests']}: {native['decode_step_ms']:.1f} ms; "
                      f"the same step's weight matmuls alone: {native['matmul_ms']:.1f} ms "
                      f"(ratio {native['decode_step_ms'] / native['matmul_ms']:.2f}); prefill total "
                      f"{native['prefill_s']:.1f} s; decode attention: {native['decode_attention']}, "
                      f"prefill: {native['prefill_layout']}",
                  f"KV: peak {native['kv_blocks_peak']} of {native['kv_blocks_total']} blocks, peak waste "
                  f"{native['kv_slots_wasted_peak']} slots vs {native['kv_slots_wasted_contiguous_peak']} for a "
                  f"contiguous max-length cache; preemptions {native['preemptions']}"]
    if "attention" in report:
        a = report["attention"]
        lines.append(f"one layer's decode attention, batch {a['batch']} x {a['ctx']} tokens: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in a.items() if k not in ("batch", "ctx")))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
