#!/usr/bin/env bash
# What the decode split by span could give ShareGPT at 40 / 60 GB, simulated (CPU, ~10 minutes
# on 2 cores). The step-cost fit (step_cost_churn_fit_one.json) was taken from servers whose
# ragged decode steps ran unsplit; the what-if scales its KV-read cost by 0.55, the measured
# time of a ragged decode step of 56 with the split against without (benchmarks/decode_ragged.py,
# docs/performance.md "Decode over ragged contexts"): step_cost_span_whatif.json. Same settings
# as the warm03_1500 run of sim_starts.sh (warm start 0.03 s/token, 1,500 s, window 500-1,500 s),
# which is the baseline.
# Usage: bash benchmarks/sim_decode_span_whatif.sh [OUT]
#        (default docs/results/sim_sharegpt_40_60_span_whatif)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/sim_sharegpt_40_60_span_whatif}
py=${PYTHON:-python}
mkdir -p "$out"
"$py" benchmarks/sim_churn_capacity.py --workload sharegpt --gpu-kv-gb 40 --cpu-kv-gb 60 \
    --think 6 --step-cost docs/results/sim_sharegpt_40_60_span_whatif/step_cost_span_whatif.json \
    --duration 1500 --warmup 500 --warm-start 0.03 --systems stateless,pensieve \
    --rates "${RATES:-0.7,0.75,0.8,0.85,0.9,1.0,1.1,1.2,1.3}" --workers "${WORKERS:-2}" \
    --out "$out/warm03_1500" | tee "$out/warm03_1500.log"
