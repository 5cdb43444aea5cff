"""Run one workload through vLLM's offline engine and print one JSON line (runs in vLLM's own venv).

Never imported by batchfleet: scripts/bench_vs_vllm.py starts it with the vLLM venv's python, passing a
JSON workload file ({"model": dir, "prompts": [[ids]], "max_new_tokens": [n], "dtype": "bfloat16"},
optionally "warmup": [[ids]], the warm-up prompts, default the first two). All requests are submitted at
once (the same as 32 closed-loop clients sending 32 requests); greedy, ``ignore_eos`` so every request
produces exactly its max_new_tokens. vLLM's defaults otherwise (automatic prefix caching on); its prefix
cache counters of the timed run are reported when it exposes them. With ``"json_schema": {...}`` in the
spec (scripts/bench_structured.py) every request is constrained to it instead (EOS honoured) and the
output texts and finish reasons are printed too.
"""

import json
import sys
import time


def main(path: str) -> None:
    from vllm import LLM, SamplingParams  # noqa: PLC0415 (vLLM's venv only)
    from vllm.sampling_params import StructuredOutputsParams  # noqa: PLC0415

    spec = json.load(open(path))
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec.get("dtype", "bfloat16"),
              max_model_len=spec.get("max_model_len", 4096), seed=0, enforce_eager=spec.get("eager", False),
              skip_tokenizer_init=False, gpu_memory_utilization=spec.get("memory_fraction", 0.4),
              disable_log_stats=False)
    schema = spec.get("json_schema")
    if schema is None:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["max_new_tokens"]]
    else:
        params = [SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
                  for n in spec["max_new_tokens"]]
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    warm = [{"prompt_token_ids": ids} for ids in spec["warmup"]] if "warmup" in spec else prompts[:2]
    llm.generate(warm, [SamplingParams(max_tokens=2, temperature=0.0)] * len(warm), use_tqdm=False)
    before = prefix_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sorted((o.metrics.first_token_time - o.metrics.arrival_time) * 1000 for o in outs
                  if getattr(o, "metrics", None) and getattr(o.metrics, "first_token_time", None))
    after = prefix_counters(llm)
    cache = {k: after[k] - before.get(k, 0) for k in after}
    out = {"wall_s": wall, "output_tokens": tokens, "throughput_tok_s": tokens / wall,
           "ttft_p50_ms": ttft[len(ttft) // 2] if ttft else None, **cache}
    if schema is not None:
        out["texts"] = [o.outputs[0].text for o in outs]
        out["finish_reasons"] = [o.outputs[0].finish_reason for o in outs]
    print(json.dumps(out), flush=True)


def prefix_counters(llm) -> dict:
    """vLLM's prefix cache counters (tokens) so far, if this version exposes them."""
    try:
        found = {m.name: m.value for m in llm.get_metrics()
                 if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")}
    except Exception:
        return {}
    return {name.split(":")[1]: value for name, value in found.items()}


if __name__ == "__main__":
    main(sys.argv[1])
