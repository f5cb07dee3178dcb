#!/usr/bin/env bash
# Issue 44's serving points, one after another in one device call: `pensieve serve` alone on
# GPU 0 for each point (benchmarks/churn_points.sh with one system), llama3.1-8b shape (dummy
# bf16 weights, the word-level tokenizer, 131,072 positions), 40 GB GPU and 60 GB CPU tiers, an
# OpenAI-style chat client that re-sends the history and streams, the given workload
# (coding-agent | agent-mix; seed 0, think time exponential with mean 6 s), a warm start (the
# sessions a steady state holds are in flight at time 0), then WARMUP s before a WINDOW s
# window; each point's summary says whether the window was at steady state.
#   OUT=results bash benchmarks/agent_points.sh WORKLOAD "SYSTEM RATE [NAME [SERVE ARGS...]]" ...
# e.g. OUT=results bash benchmarks/agent_points.sh coding-agent "pensieve 0.07" \
#        "pensieve 0.07 fp8 --kv-cache-dtype fp8_e4m3"
# Env: POINT_S (285: each point's BUDGET_S), WARMUP (45), WINDOW (100), DRAIN (15), THINK (6),
# WARM_START (0.05 s per answer token), MODEL (llama3.1-8b; demo for a CPU smoke test),
# MAX_MODEL_LEN (131072), CLIENT_ARGS (more multiturn.py args, e.g. "--length-scale 0.05"),
# and churn_points.sh's own.
# shellcheck disable=SC2086  # CLIENT_ARGS is a list of words
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results_tmp}; workload=$1; shift
for point in "$@"; do
  read -r sys rate name serve <<< "$point"
  name=${name:-$sys}
  OUT="$out/${workload}_${name}_$rate" BUDGET_S=${POINT_S:-285} MODEL=${MODEL:-llama3.1-8b} \
    MODEL_SET="max_position_embeddings=${MAX_MODEL_LEN:-131072}" THINK=${THINK:-6} WARMUP=${WARMUP:-45} \
    WINDOW=${WINDOW:-100} DRAIN=${DRAIN:-15} TAG="$name" SERVE_ARGS="${serve:-}" \
    bash benchmarks/churn_points.sh "$sys" "$rate" --workload "$workload" \
    --max-model-len "${MAX_MODEL_LEN:-131072}" --warm-start "${WARM_START:-0.05}" \
    ${CLIENT_ARGS:-} | tail -n 45
done
