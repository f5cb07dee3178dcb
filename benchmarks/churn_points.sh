#!/usr/bin/env bash
# Stateful serving under churn, measured the way users run it: two `pensieve serve` servers
# side by side (SYSTEM_A's --cache-policy on GPU 0, SYSTEM_B's on GPU 1, one H200 each, pinned
# with CUDA_VISIBLE_DEVICES), driven at the same time by the same agentic load (two
# `multiturn.py --engine http --api chat` processes, same seed: the same sessions, prompts and
# think times): an ordinary OpenAI chat client that re-sends the whole message history each
# turn, streams the answer and counts tokens from `usage`; RATE new sessions a second (Poisson),
# 8-24 turns of ~300 new tokens and ~100-token answers (pensieve.bench.agentic), THINK s of mean
# think time between turns. Arrivals run WARMUP + WINDOW s; the point is the requests sent in
# the WINDOW after the WARMUP, then DRAIN s for them to finish. Once a second the client samples
# the sessions it has in flight and the server's /metrics (KV blocks used per tier, requests
# running and waiting); each point says whether its window was at steady state (the halves'
# means within 10%: `steady_state`; and within the window's own noise: `steady_within_noise`).
# Set-up: Llama 2-13B shape with 10 KV heads (preset llama2-13b-gqa10 + a word-level tokenizer
# whose id sequences all re-tokenize to themselves, via benchmarks/chat_model_dir.py; TOKENIZER=
# demo for the demo SentencePiece one), dummy weights, bf16, GPU KV tier 40 GB, CPU tier 60 GB.
#
# Usage: churn_points.sh [SYSTEM_A,SYSTEM_B] [RATE | RATE_A,RATE_B] [extra multiturn.py args]
#        (defaults: stateless,pensieve 0.7; two rates give each side its own load, e.g. each
#        system near its own capacity). One system alone (e.g. `pensieve 1.0`) runs one
#        server on GPU A: what a one-GPU machine can do (compare with an earlier run's point).
# The device image lacks fastapi/uvicorn/pydantic: run
#   bash scripts/device-wheels.sh annotated-doc anyio==4.16.0
# here first and carry .whl; they are installed into $SITE (default /tmp/site).
# Env overrides: MODEL (preset, model dir or demo), MODEL_SET (chat_model_dir.py --set;
# default max_position_embeddings=16384; a value replaces it, e.g. "max_position_embeddings=16384
# num_hidden_layers=1"), LOAD_FORMAT (dummy), DTYPE (bfloat16), DEVICE (auto; cpu for a smoke
# test), GPUS (0,1: A's and B's), GPU_KV_GB (40), CPU_KV_GB (60), THINK (5), WARMUP (210),
# WINDOW (210), DRAIN (25), SEED (0), TAG (churn), API (chat | completions), MODE (http |
# inproc: `multiturn.py --engine real` in process on each GPU instead of servers, same load),
# SERVE_ARGS (more flags for both servers), SERVE_ARGS_A / SERVE_ARGS_B (one server),
# SERVE_ENV_A / SERVE_ENV_B (NAME=VALUE words for one server's environment, e.g.
# PENSIEVE_STEP_LOG=steps.jsonl),
# BUDGET_S (560: the whole call; once the servers are up the window is cut to what is left,
# to MIN_WINDOW s at least, default 60, the warm-up giving way),
# HEALTH_TIMEOUT (240), PORT (8321 for A, PORT+1 for B), MAX_CONN (1024), LOG_LEVEL (info: the log keeps the start-up timings),
# PROFILE_STEPS (START:COUNT: each server's steps START.. as a profiler trace, trace.json.gz),
# TOKENIZER (words | demo: chat_model_dir.py --tokenizer), WORKLOAD (agentic | sharegpt: the
# packaged ShareGPT lengths; a --workload in the extra args also sets it), PYTHON, SITE.
# Steady state sooner: `--warm-start S_PER_TOKEN` among the extra args starts the load with the
# sessions a steady state would have in flight (pensieve.bench.loadgen.WarmStart); with ShareGPT
# a cold start needs ~1,000 s of arrivals before sessions in flight level off.
# Smoke test on the CPU (demo model, ~2 minutes): OUT=/tmp/churn DEVICE=cpu
# MODEL=demo DTYPE=auto GPU_KV_GB=0.004 CPU_KV_GB=0.008 THINK=1 WARMUP=25 WINDOW=40 DRAIN=20
# bash benchmarks/churn_points.sh stateless,pensieve 0.3 --length-scale 0.1
# Writes to $OUT (default results_tmp), six files: summary.txt (side by side, also printed),
# points.jsonl (both points), churn_timeseries.png (sessions in flight, tier occupancy, running /
# waiting vs time, window shaded), run.log, and churn.tgz: per system its points.jsonl,
# timeseries.jsonl, requests.jsonl.gz, steps.jsonl.gz (every engine step, the server's
# PENSIEVE_STEP_LOG), client and progress logs, the server log and its /metrics at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t_start=$(date +%s)
out=${OUT:-results_tmp}; mkdir -p "$out"
w=$(mktemp -d)
log="$out/run.log"; : > "$log"
say() { echo "[$(( $(date +%s) - t_start )) s] $*" | tee -a "$log"; }
# On the CPU two servers' OpenMP pools oversubscribe the cores and slow each other ~100x
[ "${DEVICE:-auto}" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

systems=${1:-stateless,pensieve}; rate=${2:-0.7}
[ $# -ge 2 ] && shift 2 || shift $#
IFS=',' read -r sys_a sys_b <<< "$systems"
IFS=',' read -r rate_a rate_b <<< "$rate"; rate_b=${rate_b:-$rate_a}
if [ -z "${sys_a:-}" ]; then
  echo "usage: $0 SYSTEM_A[,SYSTEM_B] RATE [multiturn args]" >&2; exit 2
fi
sides="A B"  # one system alone (no comma) runs side A only: a one-GPU machine
[ -z "${sys_b:-}" ] && { sides="A"; sys_b=-; rate_b=-; }
py=${PYTHON:-python3}
mode=${MODE:-http}; api=${API:-chat}
model=${MODEL:-llama2-13b-gqa10}
device=${DEVICE:-auto}
IFS=',' read -r gpu_a gpu_b <<< "${GPUS:-0,1}"
gpu_kv=${GPU_KV_GB:-40}; cpu_kv=${CPU_KV_GB:-60}
workload=${WORKLOAD:-agentic}
for ((i = 1; i < $#; i++)); do  # a --workload among the extra multiturn.py args wins
  [ "${!i}" = --workload ] && { j=$((i + 1)); workload=${!j}; }
done
think=${THINK:-5}; warmup=${WARMUP:-210}; window=${WINDOW:-210}; drain=${DRAIN:-25}
min_window=${MIN_WINDOW:-60}  # the shortest window a cut to BUDGET_S leaves
budget=${BUDGET_S:-560}
port=${PORT:-8321}
model_args=(--load-format "${LOAD_FORMAT:-dummy}" --dtype "${DTYPE:-bfloat16}"
            --device "$device" --gpu-kv-gb "$gpu_kv" --cpu-kv-gb "$cpu_kv")
load_args=(--workload "$workload" --think-time "$think" --seed "${SEED:-0}"
           --tag "${TAG:-churn}" --model "$model" --gpu-kv-gb "$gpu_kv" --cpu-kv-gb "$cpu_kv")
label=$mode; [ "$mode" = http ] && label="http ($api)"
say "churn points: $sys_a (GPU ${gpu_a:-})$([ "$sides" = A ] || echo " vs $sys_b (GPU ${gpu_b:-})")," \
    "$rate sessions/s, $label," \
    "model $model, tiers $gpu_kv / $cpu_kv GB, think $think s, warm-up $warmup s," \
    "window $window s, drain $drain s"

pin() {  # GPU: the environment for one side
  if [ "$device" = cpu ] || [ -z "$1" ]; then echo ""; else echo "CUDA_VISIBLE_DEVICES=$1"; fi
}

finish() {  # gather what there is into $OUT, print the summary
  for s in $sides; do cat "$w/$s/points.jsonl"; done > "$out/points.jsonl" 2>/dev/null
  local ts=()
  for s in $sides; do
    [ -f "$w/$s/timeseries.jsonl" ] && ts+=("$w/$s/timeseries.jsonl")
    [ -f "$w/$s/requests.jsonl" ] && gzip -f "$w/$s/requests.jsonl"
    [ -f "$w/$s/steps.jsonl" ] && gzip -f "$w/$s/steps.jsonl"  # every engine step
    [ -f "$w/$s/trace.json" ] && gzip -f "$w/$s/trace.json"  # PROFILE_STEPS
    [ -f "$w/$s/progress.log" ] && tr '\r' '\n' < "$w/$s/progress.log" \
      | grep -v -e ' @ ' -e '^\s*$' | tail -n 200 > "$w/$s/progress_tail.log" \
      && rm -f "$w/$s/progress.log"
  done
  for f in "$w"/server_*.log; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 2000000 ] && gzip -f "$f"
  done
  if [ ${#ts[@]} -gt 0 ]; then
    "$py" benchmarks/plot_timeseries.py "${ts[@]}" --out "$out/churn" --title \
      "$sys_a$([ "$sides" = A ] || echo " vs $sys_b"), $rate sessions/s, $workload, $model, tiers $gpu_kv/$cpu_kv GB, $label" \
      >> "$log" 2>&1 || say "plot failed"
  fi
  if [ -s "$out/points.jsonl" ]; then
    "$py" benchmarks/churn_summary.py "$out/points.jsonl" > "$out/summary.txt" 2>> "$log"
    cat "$out/summary.txt"
  else
    say "no points"
  fi
  cp "$log" "$w/run.log"
  rm -rf "$w"/conversations_*.db* "$w/model"  # the servers' stores, the chat model directory
  tar czf "$out/churn.tgz" -C "$w" . && rm -rf "$w"
  say "done"
}

# ------------------------------------------------------------------ in process (no server)
if [ "$mode" = inproc ]; then
  start_est=${START_EST:-90}  # model load + graph capture inside multiturn.py
  left=$(( budget - start_est - drain - 40 ))
  if [ $(( warmup + window )) -gt "$left" ]; then
    window=$(( left - warmup ))
    if [ "$window" -lt 60 ]; then
      window=60; warmup=$(( left - window )); [ "$warmup" -lt 10 ] && warmup=10
      say "warm-up cut to $warmup s: the window is unlikely to be at steady state"
    fi
    say "window cut to $window s to fit BUDGET_S=$budget (START_EST=$start_est s assumed)"
  fi
  for s in $sides; do
    if [ $s = A ]; then sys=$sys_a; g=$gpu_a; r=$rate_a; else sys=$sys_b; g=$gpu_b; r=$rate_b; fi
    mkdir -p "$w/$s"
    # shellcheck disable=SC2046
    env $(pin "$g") timeout $(( warmup + window + drain + start_est + 60 )) \
      "$py" -m pensieve.bench.multiturn --engine real --systems "$sys" --rates "$r" "${load_args[@]}" \
      "${model_args[@]}" --duration $(( warmup + window )) --warmup "$warmup" \
      --drain "$drain" --out "$w/$s" "$@" > "$w/$s/client.log" 2> "$w/$s/progress.log" &
    eval "pid_$s=$!"
  done
  wait "$pid_A"; rc_a=$?; rc_b=0; [ "$sides" = A ] || { wait "$pid_B"; rc_b=$?; }
  say "multiturn.py exit status: $sys_a $rc_a, $sys_b $rc_b"
  for s in $sides; do cat "$w/$s/client.log"; done | tee -a "$log"
  finish
  exit $(( rc_a || rc_b ))
fi

# ------------------------------------------------------------------ two servers
. benchmarks/server_deps.sh  # fastapi & co from the carried wheels

serve_model=$model
if [ "$api" = chat ] && [ "$model" != demo ] && [ ! -d "$model" ]; then
  set_args=()
  # The agentic sessions grow past the preset's 4,096 positions (Llama 2); the server refuses
  # contexts beyond max_position_embeddings, so the benchmark's model allows 16,384 (the
  # client's --max-model-len) unless MODEL_SET says otherwise. The shape is unchanged.
  for kv in ${MODEL_SET:-max_position_embeddings=16384}; do set_args+=(--set "$kv"); done
  serve_model=$("$py" benchmarks/chat_model_dir.py "$model" "$w/model" "${set_args[@]}" \
                 --tokenizer "${TOKENIZER:-words}") \
    || { say "could not build a chat model directory for $model"; exit 2; }
  say "serving $model with the ${TOKENIZER:-words} tokenizer from $serve_model"
fi

pids=()
for s in $sides; do
  if [ $s = A ]; then sys=$sys_a; g=$gpu_a; p=$port; extra=${SERVE_ARGS_A:-}; e=${SERVE_ENV_A:-}
  else sys=$sys_b; g=$gpu_b; p=$((port + 1)); extra=${SERVE_ARGS_B:-}; e=${SERVE_ENV_B:-}; fi
  mkdir -p "$w/$s"
  # --shutdown-timeout 10: once the client is done, an overloaded server still has hundreds of
  # queued turns; it aborts them after 10 s, inside stop_servers's 15 s (the default 30 s ran
  # into its SIGKILL). SERVE_ARGS can override it.
  # shellcheck disable=SC2046,SC2086  # pin, SERVE_ENV and SERVE_ARGS are lists of words
  # PENSIEVE_STEP_LOG: every engine step as a JSON line (steps.jsonl.gz in churn.tgz);
  # PROFILE_STEPS=START:COUNT: a profiler trace of those steps (trace.json.gz)
  prof=()
  [ -n "${PROFILE_STEPS:-}" ] && prof=(PENSIEVE_PROFILE_STEPS="$PROFILE_STEPS:$w/$s/trace.json")
  env $(pin "$g") PENSIEVE_STEP_LOG="$w/$s/steps.jsonl" ${prof[@]+"${prof[@]}"} $e "$py" -m pensieve.cli serve "$serve_model" "${model_args[@]}" \
    --cache-policy "$sys" --host 127.0.0.1 --port "$p" --store "$w/conversations_$s.db" \
    --log-level "${LOG_LEVEL:-info}" --shutdown-timeout 10 ${SERVE_ARGS:-} $extra \
    > "$w/server_${s}_$sys.log" 2>&1 &
  pids+=($!)
done
srv_a=${pids[0]}; srv_b=${pids[1]:-}

stop_servers() {  # $1: the first signal, INT (up) or TERM (still starting); see http_point.sh
  local sig pid alive
  for sig in "${1:-INT}" TERM KILL; do  # both servers at once
    alive=()
    for pid in "$srv_a" "$srv_b"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [ ${#alive[@]} -eq 0 ] && break
    [ "$sig" = KILL ] && say "server(s) ${alive[*]} did not stop: killing"
    kill -"$sig" "${alive[@]}" 2>/dev/null
    for _ in $(seq 30); do
      kill -0 "${alive[@]}" 2>/dev/null || break  # true while any is alive
      sleep 0.5
    done
  done
  for pid in "$srv_a" "$srv_b"; do
    [ -n "$pid" ] || continue
    wait "$pid" 2>/dev/null
    say "server $pid exit status $?"
  done
}
trap 'stop_servers TERM; finish' EXIT

ready() {  # no curl on every image: ask with the standard library
  "$py" -c "import sys, urllib.request as u
sys.exit(u.urlopen('http://127.0.0.1:$1/health', timeout=2).status != 200)" 2>/dev/null
}
deadline=$(( $(date +%s) + ${HEALTH_TIMEOUT:-240} ))
up_a=0; up_b=0; [ "$sides" = A ] && up_b=1
while [ $up_a = 0 ] || [ $up_b = 0 ]; do
  for s in $sides; do
    if [ $s = A ]; then pid=$srv_a; p=$port; else pid=$srv_b; p=$((port + 1)); fi
    if ! kill -0 "$pid" 2>/dev/null; then
      say "server $s exited before it was ready; its log:"
      tail -n 30 "$w"/server_"$s"_*.log | tee -a "$log"
      exit 1
    fi
    if [ $s = A ] && [ $up_a = 0 ] && ready "$p"; then up_a=1; say "server A ($sys_a) up"; fi
    if [ $s = B ] && [ $up_b = 0 ] && ready "$p"; then up_b=1; say "server B ($sys_b) up"; fi
  done
  if [ "$(date +%s)" -ge "$deadline" ]; then
    say "servers not ready after ${HEALTH_TIMEOUT:-240} s"
    tail -n 20 "$w"/server_*.log | tee -a "$log"
    exit 1
  fi
  sleep 1
done
trap 'stop_servers INT; finish' EXIT

elapsed=$(( $(date +%s) - t_start ))
left=$(( budget - elapsed - 45 ))  # 45 s: client start, /metrics, stopping, plot, tar
if [ $(( warmup + window + drain )) -gt "$left" ]; then
  window=$(( left - warmup - drain ))
  if [ "$window" -lt "$min_window" ]; then  # keep a 60 s window; the warm-up gives way
    window=$min_window; warmup=$(( left - drain - window )); [ "$warmup" -lt 10 ] && warmup=10
    say "warm-up cut to $warmup s: the window is unlikely to be at steady state"
  fi
  say "window cut to $window s to fit BUDGET_S=$budget"
fi
duration=$(( warmup + window ))
say "both up after $elapsed s: arrivals for $duration s (window $warmup-$duration s), drain $drain s"

for s in $sides; do
  if [ $s = A ]; then sys=$sys_a; p=$port; r=$rate_a; else sys=$sys_b; p=$((port + 1)); r=$rate_b; fi
  timeout $(( duration + drain + 60 )) "$py" -m pensieve.bench.multiturn --engine http --api "$api" \
    --url "http://127.0.0.1:$p" --systems "$sys" --rates "$r" "${load_args[@]}" \
    --duration "$duration" \
    --warmup "$warmup" --drain "$drain" --max-connections "${MAX_CONN:-1024}" \
    --keep-conversations --out "$w/$s" "$@" > "$w/$s/client.log" 2> "$w/$s/progress.log" &
  eval "cl_$s=$!"
done
wait "$cl_A"; rc_a=$?; rc_b=0; [ "$sides" = A ] || { wait "$cl_B"; rc_b=$?; }
say "multiturn.py exit status: $sys_a $rc_a, $sys_b $rc_b"
for s in $sides; do cat "$w/$s/client.log"; done | tee -a "$log"
for s in $sides; do
  if [ $s = A ]; then p=$port; else p=$((port + 1)); fi
  "$py" -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$p/metrics', timeout=10).read().decode())" \
    > "$w/$s/metrics_end.txt" 2>/dev/null || true
done
trap - EXIT
stop_servers INT
for f in "$w"/server_*.log; do
  n=$(grep -c -E 'ERROR|Traceback' "$f")
  [ "$n" -gt 0 ] && say "$(basename "$f") has $n error line(s)"
done
finish
exit $(( rc_a || rc_b ))
