#!/usr/bin/env bash
# Tensor parallelism on nvidia-h200-x2 (docs/performance.md, "Tensor parallelism"): the TP
# tests on GPUs over NCCL; Llama 2-70B shape TP=2 offline throughput; multi-turn points
# (stateless / pensieve / prefix-lru). Meanwhile GPU 1 first runs the attention tile sweep
# next to the (tiny) TP tests. Outputs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
log="$out/tp.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$log"
CUDA_VISIBLE_DEVICES=1 timeout 170 python benchmarks/attention_tiles.py --qlens 1,64,128,512 \
  --out "$out/attention_tiles.json" > "$out/attention_tiles.log" 2>&1 &
tiles=$!
PENSIEVE_TEST_DEVICE=cuda timeout 170 python -m pytest -q -p no:cacheprovider \
  tests/test_tensor_parallel.py 2>&1 | tail -15 | tee -a "$log"
wait $tiles
timeout 150 python benchmarks/offline_throughput.py --model llama2-70b --load-format dummy \
  --dtype bfloat16 -tp 2 --num-prompts 32 --prompt-len 1024 --output-len 64 \
  --out "$out/offline_70b_tp2.json" 2>>"$out/err.log" | tail -40 >> "$log"
timeout ${MT_TIMEOUT:-250} python benchmarks/multiturn.py --systems stateless,pensieve,prefix-lru \
  --rates ${MT_RATE:-1.5} --model llama2-70b --load-format dummy --dtype bfloat16 -tp 2 \
  --think-time 6 --gpu-kv-gb 8 --cpu-kv-gb 22 --duration 45 --warmup 5 --drain 20 \
  --out "$out/mt" --tag h200x2-tp2 2>>"$out/err.log" | tee -a "$log"
tail -c 20000 "$out/err.log" > "$out/err_tail.log"; rm -f "$out/err.log"
gzip -f "$out"/mt/requests.jsonl "$out"/mt/steps.jsonl 2>/dev/null
