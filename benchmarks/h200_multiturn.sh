#!/usr/bin/env bash
# Real multi-turn points on one H200 (docs/benchmarks.md): Llama 2-13B shape with 10 KV heads,
# dummy weights, bf16, the ShareGPT trace. Scaled set-up: think time 6 s (the paper's 60 s / 10),
# GPU tier 8 GB, CPU tier 22 GB (the paper's 220 GB / 10). Usage: h200_multiturn.sh SYSTEMS RATES
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
python benchmarks/multiturn.py --systems "$1" --rates "$2" --model llama2-13b-gqa10 \
  --load-format dummy --dtype bfloat16 --think-time 6 --gpu-kv-gb 8 --cpu-kv-gb 22 \
  --duration 30 --warmup 5 --drain 15 --out "$out" --tag h200 2> "$out/progress.log" \
  | tee -a "$out/multiturn.log"
