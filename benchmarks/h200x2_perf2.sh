#!/usr/bin/env bash
# The fused element-wise kernels on two H200s (docs/performance.md): GPU tests, the kernel
# profile of a decode step and the decode-step table with and without the fused kernels
# (PENSIEVE_FUSED_OPS=0), offline throughput, and the Figure-12 kernel table with the final
# tile rule. GPU 0 and GPU 1 run their halves side by side. Everything lands in $OUT/perf2.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"; w=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$w/gpu.txt"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py \
    tests/test_gpu_models.py tests/test_gpu_graphs.py 2>&1 | tail -15 > "$w/tests.log"
  for fused in 1 0; do
    PENSIEVE_FUSED_OPS=$fused timeout 150 python benchmarks/profile_step.py \
      --model llama2-13b-gqa10 --kv-gb 60 --configs 1x512,32x512,256x512,64x2048,32x8192 \
      --out "$w/profile_fused$fused.json" --plot "$w/profile_fused$fused.png" \
      --trace "$w/trace_fused$fused.json.gz" > "$w/profile_fused$fused.log" 2>&1
  done
  timeout 100 python benchmarks/offline_throughput.py --model llama2-13b-gqa10 \
    --load-format dummy --dtype bfloat16 --num-prompts 64 --prompt-len 1024 --output-len 128 \
    --out "$w/offline_fused.json" > "$w/offline_fused.log" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for fused in 1 0; do
    PENSIEVE_FUSED_OPS=$fused timeout 150 python benchmarks/decode_step.py \
      --model llama2-13b-gqa10 --iters 10 --kv-gb 105 --out "$w/decode_step_fused$fused.json" \
      --plot "$w/decode_step_fused$fused.png" > "$w/decode_step_fused$fused.log" 2>&1
  done
  timeout ${KC_TIMEOUT:-200} python benchmarks/kernel_compare.py --variants ours,a,b,c \
    --out "$w/kernel_compare.json" --plot "$w/kernel_compare.png" > "$w/kernel_compare.log" 2>&1
) &
wait
tar czf "$out/perf2.tgz" -C "$w" .
cat "$w/tests.log"; tail -n 30 "$w"/profile_fused1.log; tail -n 20 "$w"/decode_step_fused?.log
