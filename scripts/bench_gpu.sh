#!/usr/bin/env bash
# Prepared run for one H200 (device tool): Llama-2-7B-shaped random bf16 model, 32 concurrent,
# 128 in / 128 out, dynamic 50 ms and continuous; prints tok/s and the share of the HBM roofline.
# Finishes in well under 8 minutes including model creation. Results land in ${OUT:-.}/bench_gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
# the script imports the package normally: install it (editable, no build isolation: the host may be offline)
python3 -c "import batchfleet.worker.compose, transformers, msgpack, tokenizers, click" 2>/dev/null || \
  python3 -m pip install -q --no-deps --no-build-isolation -e . msgpack tokenizers
export PYTHONUNBUFFERED=1
timeout 480 python3 scripts/bench_gpu.py --device "${DEVICE:-cuda}" --shape "${SHAPE:-7b}" \
  --engine "${ENGINE:-native}" --json "${OUT:-.}/bench_gpu.json" "$@"
