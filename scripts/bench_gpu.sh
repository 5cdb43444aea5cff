#!/usr/bin/env bash
# Prepared run for one H200 (device tool): first batch invariance on the device (a small model, bf16 and fp32:
# how many requests of a flood differ from themselves alone; with torch's defaults, then with cuBLAS's split-K
# workspace off as vLLM's batch-invariant mode sets it on Hopper), then the benchmark: Llama-2-7B-shaped random
# bf16 model, 32 concurrent, 128 in / 128 out, dynamic 50 ms and continuous; prints tok/s and the share of the
# HBM roofline. Finishes in under 10 minutes including model creation (INVARIANCE=0 skips the check).
# Results land in ${OUT:-.}/invariance*.json and ${OUT:-.}/bench_gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
# the script imports the package normally: install it (editable, no build isolation: the host may be offline)
python3 -c "import batchfleet.worker.compose, transformers, msgpack, tokenizers, click" 2>/dev/null || \
  python3 -m pip install -q --no-deps --no-build-isolation -e . msgpack tokenizers
export PYTHONUNBUFFERED=1
if [ "${INVARIANCE:-1}" = 1 ]; then
  timeout 90 python3 scripts/bench_gpu.py --device "${DEVICE:-cuda}" --shape small --invariance \
    --json "${OUT:-.}/invariance.json" || echo "invariance check failed or timed out"
  CUBLAS_WORKSPACE_CONFIG=:16:8 CUBLASLT_WORKSPACE_SIZE=1 timeout 90 python3 scripts/bench_gpu.py \
    --device "${DEVICE:-cuda}" --shape small --invariance --json "${OUT:-.}/invariance_cublas_nosplitk.json" \
    || echo "invariance check (cuBLAS split-K off) failed or timed out"
fi
timeout 400 python3 scripts/bench_gpu.py --device "${DEVICE:-cuda}" --shape "${SHAPE:-7b}" \
  --engine "${ENGINE:-native}" --json "${OUT:-.}/bench_gpu.json" "$@"
