#!/usr/bin/env bash
# The H200 benchmark pass behind docs/performance.md (Llama 2-13B shape, 10 KV heads, dummy
# weights, bf16). Writes JSON and logs under $OUT (default results_tmp/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
log="$out/h200_bench.log"
python benchmarks/offline_throughput.py --model llama2-13b-gqa10 --load-format dummy \
  --dtype bfloat16 --num-prompts 64 --prompt-len 1024 --output-len 128 \
  --out "$out/offline_throughput.json" 2>&1 | grep -v "it/s\]" | tee "$log"
python benchmarks/swap_bandwidth.py --out "$out/swap_bandwidth.json" 2>&1 | tee -a "$log"
python benchmarks/swap_overlap.py --model llama2-13b-gqa10 --out "$out/swap_overlap.json" \
  2>&1 | tee -a "$log"
python benchmarks/profile_cost.py --model llama2-13b-gqa10 --load-format dummy --dtype bfloat16 \
  --chunks-per-batch 16 --out-dir "$out" 2>&1 | tee -a "$log"
