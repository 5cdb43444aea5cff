#!/usr/bin/env bash
# Prepared run for one H100/H200 (the device tool), in phases of scripts/bench_gpu.py, each in its own process under
# its own timeout, each writing its JSON as it goes, so a phase that fails or runs long costs only itself:
#   1. correctness: 16 greedy prompts, small model: CUDA-graph path vs eager path (bf16, fp32) vs the CPU reference
#   2. invariance: a flood vs each request alone, bf16 and fp32, without and with --batch-invariant
#   3. bench: Llama-2-7B-shaped random bf16 model, 128 in / 128 out, 32 then 64 clients, continuous and the fixed
#      10/50/200 ms windows: tok/s, TTFT, share of the HBM roofline
#   4. profile: one 7B decode step at 32 sequences (eager and graph ms, ops by device time)
#   5. summary: one table of all of it
# Phase timeouts sum to 7.75 minutes (a typical H100 run should take well under that).
# Results: ${OUT:-.}/*.json, *.log, summary.json.
# Extra arguments go to the bench phase (e.g. --enforce-eager). PHASES="bench profile" runs a subset.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.}"
DEVICE="${DEVICE:-cuda}"
PHASES="${PHASES:-correctness invariance bench profile}"
# the script imports the package normally: install it (editable, no build isolation: the host may be offline)
timeout 60 python3 -c "import batchfleet.worker.compose, transformers, msgpack, tokenizers, click" 2>/dev/null || \
  timeout 60 python3 -m pip install -q --no-deps --no-build-isolation -e . msgpack tokenizers
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt" 2>&1 || true
cat "$OUT/gpu.txt"

phase() {  # phase NAME SECONDS ARGS...: one phase, its output in NAME.log, its failure reported, never fatal
  local name=$1 secs=$2
  shift 2
  echo "== $name (at most ${secs} s)"
  timeout -k 10 "$secs" python3 scripts/bench_gpu.py --device "$DEVICE" --json "$OUT/$name.json" "$@" \
    2>&1 | tee "$OUT/$name.log" | grep -v '^ \|^{\|^}\|^\]' ; local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "!! $name failed or timed out (exit $rc): see $OUT/$name.log"
}

for p in $PHASES; do
  case $p in
    correctness) phase correctness 75 --phase correctness --shape "${SMALL:-small}" ;;
    invariance)
      phase invariance 65 --phase invariance --shape "${SMALL:-small}"
      CUBLAS_WORKSPACE_CONFIG=:4096:8 phase invariance_mode 65 --phase invariance --shape "${SMALL:-small}" --batch-invariant ;;
    bench) phase bench_gpu 200 --phase bench --shape "${SHAPE:-7b}" --engine "${ENGINE:-native}" "$@" ;;
    profile) phase profile 60 --phase profile --shape "${SHAPE:-7b}" ;;
  esac
done
timeout 20 python3 scripts/bench_gpu.py --phase summary --out-dir "$OUT" || echo "!! summary failed"
