"""Run one workload through vLLM's offline engine and print one JSON line (runs in vLLM's own venv).

Never imported by batchfleet: scripts/bench_vs_vllm.py starts it with the vLLM venv's python, passing a
JSON workload file ({"model": dir, "prompts": [[ids]], "max_new_tokens": [n], "dtype": "bfloat16"}).
All requests are submitted at once (the same as 32 closed-loop clients sending 32 requests); greedy,
``ignore_eos`` so every request produces exactly its max_new_tokens. With ``"json_schema": {...}`` in the
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
              skip_tokenizer_init=False, gpu_memory_utilization=spec.get("memory_fraction", 0.4))
    schema = spec.get("json_schema")
    if schema is None:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["max_new_tokens"]]
    else:
        params = [SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
                  for n in spec["max_new_tokens"]]
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=2, temperature=0.0)] * 2, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sorted((o.metrics.first_token_time - o.metrics.arrival_time) * 1000 for o in outs
                  if getattr(o, "metrics", None) and getattr(o.metrics, "first_token_time", None))
    out = {"wall_s": wall, "output_tokens": tokens, "throughput_tok_s": tokens / wall,
           "ttft_p50_ms": ttft[len(ttft) // 2] if ttft else None}
    if schema is not None:
        out["texts"] = [o.outputs[0].text for o in outs]
        out["finish_reasons"] = [o.outputs[0].finish_reason for o in outs]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
