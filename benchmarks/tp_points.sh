#!/usr/bin/env bash
# Tensor parallelism on two GPUs of one host (nvidia-h200-x2; docs/performance_history.md, "Tensor
# parallelism"). PART selects what runs, so that each part fits one device call:
#   PART=check (default): the TP tests on GPUs over NCCL (tests/test_tensor_parallel.py with
#     PENSIEVE_TEST_DEVICE=cuda); TP=2 against TP=1 on the same prompts, Llama 2-13B GQA-10
#     shape, dummy weights, bf16, by the top-5 rule (benchmarks/tp_compare.py); Llama 2-70B
#     shape TP=2 offline throughput (32 x 1024 prompt tokens, 64 output tokens).
#   PART=multiturn: one multi-turn point, stateless then pensieve, MODEL (default the Llama 2-70B
#     shape) TP=2, the
#     agentic workload in process (RATE sessions/s, THINK s think time, tiers GPU_KV_GB /
#     CPU_KV_GB per rank, WARMUP + WINDOW s of arrivals, DRAIN s).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Outputs under $OUT (default results_tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
out=${OUT:-results_tmp}; mkdir -p "$out"
part=${PART:-check}
log="$out/tp_$part.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$log"
if [ "$part" = check ]; then
  PENSIEVE_TEST_DEVICE=cuda timeout 150 python -m pytest -q -p no:cacheprovider \
    tests/test_tensor_parallel.py 2>&1 | tail -8 | tee -a "$log"
  timeout 170 python benchmarks/tp_compare.py --model llama2-13b-gqa10 --tp 2 \
    --out "$out/tp_compare_13b.json" 2>>"$out/err.log" | tee -a "$log"
  timeout 150 python benchmarks/offline_throughput.py --model llama2-70b --load-format dummy \
    --dtype bfloat16 -tp 2 --num-prompts 32 --prompt-len 1024 --output-len 64 \
    --out "$out/offline_70b_tp2.json" 2>>"$out/err.log" | tail -40 | tee -a "$log"
else
  timeout ${MT_TIMEOUT:-540} pensieve bench multiturn --systems stateless,pensieve \
    --rates "${RATE:-0.2}" --model "${MODEL:-llama2-70b}" --load-format dummy --dtype bfloat16 -tp 2 \
    --workload agentic --think-time "${THINK:-5}" --gpu-kv-gb "${GPU_KV_GB:-8}" \
    --cpu-kv-gb "${CPU_KV_GB:-20}" --warmup "${WARMUP:-90}" --duration $(( ${WARMUP:-90} + ${WINDOW:-90} )) \
    --drain "${DRAIN:-20}" --out "$out/mt" --tag "tp2-${MODEL:-llama2-70b}" 2>>"$out/err.log" | tee -a "$log"
  gzip -f "$out"/mt/requests.jsonl "$out"/mt/steps.jsonl 2>/dev/null
fi
[ -f "$out/err.log" ] && { tail -c 20000 "$out/err.log" > "$out/err_tail.log"; rm -f "$out/err.log"; }
exit 0
