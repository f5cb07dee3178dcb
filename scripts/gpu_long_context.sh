#!/usr/bin/env bash
# Issue 44's GPU measurements in one device call (one H200): the FP8 and kernel tests on the
# GPU, attention at 32k/64k/128k against torch SDPA (bf16 and FP8 KV; --sweep: the best decode
# tile and split count per case), FP8 accuracy on the dummy llama3.1-8b shape, and how long a
# 60k-token prompt stalls 32 running decodes (8,192- and 2,048-token step budgets).
#   OUT=results bash scripts/gpu_long_context.sh          (TESTS=0 skips the tests)
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pb() { local script=${1//-/_}; shift; python "benchmarks/$script.py" "$@"; }  # long-attention ...
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python -m pytest -q -p no:cacheprovider tests/test_fp8_kv.py tests/test_kernels.py \
    tests/test_gpu_graphs.py tests/test_gpu_models.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
fi
pb long-attention --sweep --out "$OUT/long_attention.json" --plot "$OUT/long_attention.png" \
  2>&1 | grep -v "^long-attention:" | tee "$OUT/long_attention.txt"
pb kv-accuracy --model llama3.1-8b --load-format dummy --prompts 16 --prompt-len 2048 \
  --new-tokens 64 --gpu-kv-gb 16 --out "$OUT/kv_accuracy_llama31_8b.json" 2>&1 | tail -15
for run in "auto 8192" "fp8 8192" "auto 2048"; do
  set -- $run
  pb prefill-stall --model llama3.1-8b --gpu-kv-gb 40 --kv-cache-dtype $1 --decodes 32 \
    --decode-context 2048 --prompt 60000 --max-num-batched-tokens $2 \
    --out "$OUT/prefill_stall_$1_$2.json" 2>&1 | head -7
done
