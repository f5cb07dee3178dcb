#!/usr/bin/env bash
# The performance pass on one H200 (docs/performance.md): decode-graph tests, decode step vs
# the HBM floor (eager and CUDA graphs), offline throughput with and without graphs, and the
# Figure-12 kernel comparison. Outputs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
log="$out/perf.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log"
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py 2>&1 | tail -5 \
  | tee -a "$log"
timeout 150 python benchmarks/decode_step.py --model llama2-13b-gqa10 --iters 10 --kv-gb 105 \
  --out "$out/decode_step.json" --plot "$out/decode_step.png" 2>>"$out/err.log" | tee -a "$log"
for mode in graphs eager; do
  extra=""; [ "$mode" = eager ] && extra="--enforce-eager"
  timeout 100 python benchmarks/offline_throughput.py --model llama2-13b-gqa10 \
    --load-format dummy --dtype bfloat16 --num-prompts 64 --prompt-len 1024 --output-len 128 \
    $extra --out "$out/offline_$mode.json" 2>>"$out/err.log" | tail -40 >> "$log"
done
timeout ${KC_TIMEOUT:-200} python benchmarks/kernel_compare.py --variants ${KC_VARIANTS:-ours,a,b,c} \
  --out "$out/kernel_compare.json" --plot "$out/kernel_compare.png" 2>>"$out/err.log" \
  | tee -a "$log"
tail -c 20000 "$out/err.log" > "$out/err_tail.log"; rm -f "$out/err.log"
