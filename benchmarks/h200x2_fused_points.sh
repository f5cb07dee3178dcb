#!/usr/bin/env bash
# Multi-turn points after the fused kernels, one invocation list per GPU of nvidia-h200-x2
# (same set-up as h200x2_points.sh). Usage:
#   h200x2_fused_points.sh "SYSTEMS:RATES[;SYSTEMS:RATES]" "SYSTEMS:RATES[;...]" [perf]
# Each SYSTEMS:RATES is one multiturn.py process (model loaded once, systems x rates points).
# With a third argument "perf", GPU 0 first runs the GPU kernel tests, decode_step.py and
# profile_step.py; with "tests", GPU 1 runs the kernel tests alongside its first model load. Everything lands in $OUT/points.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"; w=$(mktemp -d)
mt=(--model llama2-13b-gqa10 --load-format dummy --dtype bfloat16 --think-time 6
    --gpu-kv-gb 8 --cpu-kv-gb 22 --duration 60 --warmup 10 --drain 20 --tag h200-fused)
run_gpu() {  # GPU LIST
  export CUDA_VISIBLE_DEVICES=$1
  if [ "$1" = 1 ] && [ "${3:-}" = tests ]; then  # alongside GPU 1's model load
    (timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernels.py \
      tests/test_fused_kernels.py 2>&1 | tail -3 > "$w/tests_kernels.log") &
  fi
  if [ "$1" = 0 ] && [ "${3:-}" = perf ]; then
    timeout 100 python -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3 \
      > "$w/tests_kernels.log"
    timeout 120 python benchmarks/decode_step.py --model llama2-13b-gqa10 --iters 10 \
      --kv-gb 105 --out "$w/decode_step.json" --plot "$w/decode_step.png" \
      > "$w/decode_step.log" 2>&1
    timeout 90 python benchmarks/profile_step.py --model llama2-13b-gqa10 --kv-gb 60 \
      --configs 1x512,32x512,256x512,64x2048,32x8192 --out "$w/profile.json" \
      --plot "$w/profile.png" > "$w/profile.log" 2>&1
  fi
  IFS=';' read -ra jobs <<< "$2"
  for j in "${jobs[@]}"; do
    timeout ${PT_TIMEOUT:-420} python benchmarks/multiturn.py --systems "${j%%:*}" \
      --rates "${j##*:}" "${mt[@]}" --out "$w/mt$1" >> "$w/gpu$1.log" 2>>"$w/err$1.log"
  done
}
run_gpu 0 "$1" "${3:-}" &
run_gpu 1 "$2" "${3:-}" &
wait
for g in 0 1; do
  gzip -f "$w/mt$g/requests.jsonl" "$w/mt$g/steps.jsonl" 2>/dev/null
  tail -c 15000 "$w/err$g.log" > "$w/err${g}_tail.log"; rm -f "$w/err$g.log"
done
tar czf "$out/points.tgz" -C "$w" .
cat "$w"/tests_kernels.log "$w"/gpu?.log 2>/dev/null | grep -v '^$'
grep -h ' | ' "$w/decode_step.log" 2>/dev/null | head -20
