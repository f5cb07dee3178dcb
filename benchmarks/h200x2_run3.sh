#!/usr/bin/env bash
# Second x2 pass (docs/performance.md, docs/benchmarks.md): TP tests over NCCL (all models),
# 70B TP=2 offline throughput; then, in parallel, GPU 0: 13B multi-turn points (stateless,
# pensieve); GPU 1: kernel tests with the new tiles, the Figure-12 comparison (+FlexAttention
# on a subset) and pensieve with separate prefill/decode batches. Outputs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
log="$out/run.log"
rate=${RATE:-2}
PENSIEVE_TEST_DEVICE=cuda timeout 120 python -m pytest -q -p no:cacheprovider \
  tests/test_tensor_parallel.py 2>&1 | tail -6 | tee -a "$log"
timeout 130 python benchmarks/offline_throughput.py --model llama2-70b --load-format dummy \
  --dtype bfloat16 -tp 2 --num-prompts 32 --prompt-len 1024 --output-len 64 \
  --out "$out/offline_70b_tp2.json" 2>>"$out/err.log" | tail -45 >> "$log"
mt=(--model llama2-13b-gqa10 --load-format dummy --dtype bfloat16 --think-time 6
    --gpu-kv-gb 8 --cpu-kv-gb 22 --duration 60 --warmup 10 --drain 20 --tag h200-graphs)
CUDA_VISIBLE_DEVICES=0 timeout 230 python benchmarks/multiturn.py --systems stateless,pensieve \
  --rates "$rate" "${mt[@]}" --out "$out/mt" > "$out/gpu0.log" 2>>"$out/err.log" &
g0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -4
  timeout 60 python benchmarks/kernel_compare.py --variants ours,a,b,c \
    --out "$out/kernel_compare.json" --plot "$out/kernel_compare.png" 2>>"$out/err.log"
  timeout 60 python benchmarks/kernel_compare.py --variants ours,d \
    --configs 'q1_ctx4096,q128_ctx4096,q512_ctx0,q16_ctx1024,mixed*' 2>>"$out/err.log"
  timeout 120 python benchmarks/multiturn.py --systems pensieve --batching separate \
    --rates "$rate" "${mt[@]}" --out "$out/mt1" 2>>"$out/err.log"
) > "$out/gpu1.log" 2>&1
wait $g0
cat "$out/gpu0.log" "$out/gpu1.log" >> "$log"; rm -f "$out/gpu0.log" "$out/gpu1.log"
for f in points requests steps; do
  [ -f "$out/mt1/$f.jsonl" ] && cat "$out/mt1/$f.jsonl" >> "$out/mt/$f.jsonl"
done
rm -rf "$out/mt1"
gzip -f "$out"/mt/requests.jsonl "$out"/mt/steps.jsonl 2>/dev/null
tail -c 15000 "$out/err.log" > "$out/err_tail.log"; rm -f "$out/err.log"
