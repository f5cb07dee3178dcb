#!/usr/bin/env bash
# The disk tier under long idle, simulated (issue 45; docs/performance_history.md "Disk tier under long
# idle, simulated"): pensieve on the agentic load with 5-minute think times, 40 / 60 GB tiers,
# 13B GQA-10 step cost and the engine's H200 cost profile of that shape (what the engine weighs
# recomputation with on the H200), without a disk tier and with 200 GB of disk at the given
# read rates (the engine: a turn reads only the files no slower to read than to recompute, and
# every copy read is restored at admission).
# Usage: sim_disk_long_idle.sh OUT_DIR [RATE] [READ_GBPS...]   (CPU; ~1-2 min of wall a point)
# Env: WRITE_GBPS (0.85: the rate of the docs' runs; the simulator's default is now 1.2)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/disk_sim}; rate=${2:-0.1}; shift $(( $# > 2 ? 2 : $# ))
reads=("${@:-1.6 6}")
common=(--engine sim --systems pensieve --rates "$rate" --workload agentic --think-time 300
        --duration ${DURATION:-2400} --warmup ${WARMUP:-1200} --warm-start 0.05
        --gpu-kv-gb 40 --cpu-kv-gb 60 --sample-interval 10
        --step-cost docs/results/sim_churn_process/step_cost_churn_fit_all.json
        --cost-profile src/pensieve/profiles/llama-L40-H5120-q40-kv10-d128-i13824__NVIDIA_H200.json
        --out "$out")
pensieve bench multiturn "${common[@]}" --tag no-disk
for r in ${reads[@]}; do
  pensieve bench multiturn "${common[@]}" --disk-kv-gb 200 --disk-read-gbps "$r" \
    --sim-disk-write-gbps "${WRITE_GBPS:-0.85}" \
    --tag "disk-200-read-$r"
done
