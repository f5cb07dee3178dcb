#!/usr/bin/env bash
# Simulator sweeps behind docs/benchmarks.md, on the CPU, with the step-cost model fitted to the
# H200 steps (default: the fused-era fit, docs/results/multiturn_fused/step_cost_h200_fused.json;
# COST=... another). Paper-scale set-up: 40 GB GPU tier, 220 GB CPU tier, think time 60 s, ShareGPT. Usage: sim_sweeps.sh OUT_DIR [rates|think|cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/sim}; what=${2:-all}
cost=${COST:-docs/results/multiturn_fused/step_cost_h200_fused.json}
common=(--engine sim --step-cost "$cost" --warmup 150)
mkdir -p "$out"
if [[ $what == rates || $what == all ]]; then
  for s in ${SYSTEMS:-stateless gpu-only pensieve prefix-lru lru}; do
    pensieve bench multiturn "${common[@]}" --systems $s --rates ${RATES:-1,2,3,4} \
      --think-time 60 --gpu-kv-gb 40 --cpu-kv-gb 220 --duration 600 --drain 300 \
      --out "$out/rates" --tag paper-scale
  done
fi
if [[ $what == think || $what == all ]]; then
  for t in 30 60 120 300 600; do
    d=$(( t * 3 > 600 ? t * 3 : 600 ))
    pensieve bench multiturn "${common[@]}" --systems stateless,pensieve --rates 2 \
      --think-time $t --gpu-kv-gb 40 --cpu-kv-gb 220 --duration $d --drain $d \
      --out "$out/think" --tag think-sweep
  done
fi
if [[ $what == cpu || $what == all ]]; then
  for c in 0 27.5 55 110 220; do
    pensieve bench multiturn "${common[@]}" --systems pensieve --rates 2.5 \
      --think-time 60 --gpu-kv-gb 40 --cpu-kv-gb $c --duration 600 --drain 300 \
      --out "$out/cpu" --tag "cpu-$c"
  done
fi
