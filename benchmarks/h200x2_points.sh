#!/usr/bin/env bash
# 13B multi-turn points with decode CUDA graphs, one rate per GPU of nvidia-h200-x2 (same
# set-up as h200x2_run3.sh). Usage: h200x2_points.sh SYSTEMS RATE_GPU0 RATE_GPU1 [SYSTEMS_GPU1]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
mt=(--model llama2-13b-gqa10 --load-format dummy --dtype bfloat16 --think-time 6
    --gpu-kv-gb 8 --cpu-kv-gb 22 --duration 60 --warmup 10 --drain 20 --tag h200-graphs)
for g in 0 1; do
  rate=$2; systems=$1; [ $g = 1 ] && rate=$3 && systems=${4:-$1}
  CUDA_VISIBLE_DEVICES=$g timeout ${PT_TIMEOUT:-300} python benchmarks/multiturn.py \
    --systems "$systems" --rates "$rate" "${mt[@]}" --out "$out/mt$g" > "$out/gpu$g.log" \
    2>>"$out/err$g.log" &
done
wait
cat "$out/gpu0.log" "$out/gpu1.log" | tee "$out/run.log"
mkdir -p "$out/mt"
for f in points requests steps; do cat "$out"/mt0/$f.jsonl "$out"/mt1/$f.jsonl > "$out/mt/$f.jsonl"; done
rm -rf "$out/mt0" "$out/mt1" "$out/gpu0.log" "$out/gpu1.log"
gzip -f "$out"/mt/requests.jsonl "$out"/mt/steps.jsonl
cat "$out/err0.log" "$out/err1.log" | tail -c 15000 > "$out/err_tail.log"; rm -f "$out"/err?.log
