#!/usr/bin/env bash
# Swap or recompute, simulated A/B (CPU, ~12 minutes on 2 cores): how a CPU-tier chunk comes
# back, by the engine's rule (step: swap or recompute by cost, the step's own compute counted),
# the rule before ee02085 (bare: without it) and always swapped in (off), at three loads:
# ShareGPT 40 / 60 GB at 0.9 sessions/s from an uncongested (0.02 s/token) and a congested
# (0.05) warm start, and the agentic workload at 1.0 and 1.4 sessions/s from a cold start.
# Usage: bash benchmarks/sim_recompute_rule.sh [OUT]   (default docs/results/sim_recompute_rule)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/sim_recompute_rule}
py=${PYTHON:-python}
sg=(--workload sharegpt --think 6 --duration 1500 --warmup 500 --rates 0.9 --systems pensieve
    --step-cost docs/results/sim_churn_process_sharegpt/step_cost_churn_fit_one.json --workers 1)
ag=(--workload agentic --think 5 --duration 600 --warmup 300 --rates 1.0,1.4 --systems pensieve
    --step-cost docs/results/sim_churn_process/step_cost_churn_fit_all.json --workers 2)
for rule in step bare off; do
  "$py" benchmarks/sim_churn_capacity.py "${sg[@]}" --warm-start 0.02 --recompute-rule "$rule" \
      --out "$out/sharegpt_warm0.02_$rule" > /dev/null &
  "$py" benchmarks/sim_churn_capacity.py "${sg[@]}" --warm-start 0.05 --recompute-rule "$rule" \
      --out "$out/sharegpt_warm0.05_$rule" > /dev/null
  wait
  "$py" benchmarks/sim_churn_capacity.py "${ag[@]}" --recompute-rule "$rule" \
      --out "$out/agentic_$rule" > /dev/null
done
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':<22} {'rule':<5} {'req/s':>6} {'P50':>6} {'P90':>6} {'TTFT50':>7} "
      f"{'recomp':>6} {'prefill run':>11} {'exposed copy s':>14}")
for d in sorted(out.glob("*_*")):
    doc = json.loads((d / "sim_churn_capacity.json").read_text())
    for p in doc["points"] if isinstance(doc, dict) else doc:
        run = d.name.rsplit("_", 1)[0] + f"@{p['conv_rate']:g}"
        print(f"{run:<22} {p['recompute_rule']:<5} {p['throughput_rps']:6.2f} "
              f"{1e3 * p['normalized_latency_s_p50']:6.1f} {1e3 * p['normalized_latency_s_p90']:6.1f} "
              f"{p['ttft_s_p50']:7.3f} {p['recomputed_rate']:6.3f} {p['prefill_tokens_run']:11,} "
              f"{p['exposed_copy_s']:14.1f}")
PY
