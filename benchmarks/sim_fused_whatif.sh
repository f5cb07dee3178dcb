#!/usr/bin/env bash
# Simulator runs on the fused-kernel step cost (docs/benchmarks.md, "After the fused
# kernels"): (1) the 12 real points' set-up, for the simulator's error; (2) what-ifs in steady
# state (360 s of arrivals, window 120-360 s; the 60 s real points end while the number of
# conversations in flight is still growing): the measured cost, mixed steps as cheap as decode-only ones (per_prefill_step_s=0,
# i.e. CUDA graphs for mixed steps too), swaps with no exposed overhead beyond the PCIe time
# (per_swap_chunk_s=0), and both. CPU only; ~20 minutes on 2 cores. Outputs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-}
out=${OUT:-results/sim_fused}; mkdir -p "$out"
cost=docs/results/multiturn_fused/step_cost_h200_fused.json
setup=(--engine sim --step-cost "$cost" --think-time 6 --gpu-kv-gb 8 --cpu-kv-gb 22)
[ -n "${SKIP_VALIDATE:-}" ] || python benchmarks/multiturn.py "${setup[@]}" \
  --systems stateless,pensieve,gpu-only,prefix-lru --rates 4,5,6,7 --duration 60 --warmup 10 --drain 20 --tag sim-validate \
  --out "$out/validate" > "$out/validate.log" 2>&1
run() {  # NAME SET
  extra=(); [ -n "$2" ] && extra=(--step-cost-set "$2")
  python benchmarks/multiturn.py "${setup[@]}" "${extra[@]}" \
    --systems stateless,pensieve,gpu-only,prefix-lru --rates "${WHATIF_RATES:-0.6,0.8,1,1.2,1.4}" \
    --duration 360 --warmup 120 --drain 60 --tag "$1" --out "$out/$1" > "$out/$1.log" 2>&1
}
run measured "" & run no_mixed_penalty per_prefill_step_s=0 & wait
run no_swap_overhead per_swap_chunk_s=0 & run both per_prefill_step_s=0,per_swap_chunk_s=0 & wait
for v in measured no_mixed_penalty no_swap_overhead both; do
  echo "== $v"; python benchmarks/capacity.py "$out/$v/points.jsonl" --target-ms 150
done
