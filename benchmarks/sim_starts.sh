#!/usr/bin/env bash
# ShareGPT 40 / 60 GB near saturation, simulated from different starts (CPU, ~15 minutes on 2
# cores): cold runs of 4,000 s, warm starts at 0.03 and 0.05 s/token, and the plot of sessions
# in flight and requests waiting over time (plot_sim_starts.py). The warm start at 0.02 is the
# capacity sweep of docs/results/sim_sharegpt_40_60_warm (docs/benchmarks.md gives its command).
# Usage: bash benchmarks/sim_starts.sh [OUT]   (default docs/results/sim_sharegpt_40_60_start)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/sim_sharegpt_40_60_start}
py=${PYTHON:-python}
run() {  # OUT_NAME ARGS...
  local name=$1; shift
  "$py" benchmarks/sim_churn_capacity.py --workload sharegpt --gpu-kv-gb 40 --cpu-kv-gb 60 \
      --think 6 --step-cost docs/results/sim_churn_process_sharegpt/step_cost_churn_fit_one.json \
      "$@" --out "$out/$name" > "$out/$name.log" 2>&1
}
mkdir -p "$out"
run cold_4000 --duration 4000 --warmup 2500 --rates 0.75,0.85 --systems stateless,pensieve \
    --workers 2
run cold_4000_pensieve_0.9 --duration 4000 --warmup 2500 --rates 0.9 --systems pensieve \
    --workers 1 &
run warm05_4000_stateless_0.75 --duration 4000 --warmup 2500 --rates 0.75 --systems stateless \
    --warm-start 0.05 --workers 1
wait
run warm05_4000_pensieve_0.9 --duration 4000 --warmup 2500 --rates 0.9 --systems pensieve \
    --warm-start 0.05 --workers 1 &
run warm03_1500 --duration 1500 --warmup 500 --rates 0.7,0.75,0.8,0.85,0.9,1.0 \
    --systems stateless,pensieve --warm-start 0.03 --workers 1
wait
for f in "$out"/*.log; do echo "== $f"; tail -n +1 "$f" | head -16; done
"$py" benchmarks/plot_sim_starts.py "$out"/*/sim_churn_capacity.json \
    docs/results/sim_sharegpt_40_60_warm/sim_churn_capacity.json \
    --only stateless:0.75,pensieve:0.9 --out "$out/starts.png"
