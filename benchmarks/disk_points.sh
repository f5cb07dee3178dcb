#!/usr/bin/env bash
# The disk tier on a device (issue 45), in one device call on one GPU: `pensieve serve` with
# small GPU / CPU tiers (GPU_KV_GB / CPU_KV_GB, 8 / 8) under a long-idle agentic load (think
# times of THINK s, default 90, RATE new sessions a second with a warm start: more live
# conversations than the two tiers hold), llama3.1-8b shape (dummy bf16 weights, the word-level
# tokenizer), through benchmarks/churn_points.sh with one system:
#   (a) no disk tier;
#   (b) the same load with a disk tier of DISK_GB (30) under DISK_DIR (/tmp/pensieve_disk);
#   (c) a restart: a disk server gets CONVS (64) conversations of TURNS (4) turns of WORDS (300)
#       words, built W at a time (benchmarks/disk_restart.py build), is stopped once they are
#       built (SIGINT, between turns, not mid-turn: it writes its tiers' KV to disk), started again on the same store and disk path, and
#       continues each conversation by one greedy turn; a server without the disk tier
#       continues a copy of the same store (recomputing). Reported: the share of the continued
#       turns' context tokens read from disk (usage's pensieve.cache fields) and how many greedy
#       answers equal the no-disk server's.
# Usage: OUT=results bash benchmarks/disk_points.sh [RATE [multiturn args]]   (default 0.1;
#   on a fresh H200 machine (a) and (b) took 204 s and 181 s with POINT_S 185 / 150, and (c)
#   did not finish in the rest of a 600 s call: run POINTS=ab and POINTS=c in separate calls)
# The device image lacks fastapi/uvicorn/pydantic: run bash scripts/device-wheels.sh
# annotated-doc anyio==4.16.0 here first and carry .whl (as churn_points.sh).
# Env: POINT_S (140: each of (a) and (b)'s BUDGET_S), POINTS (abc: which to run), MODEL
# (llama3.1-8b), MODEL_SET, MAX_MODEL_LEN (131072), DTYPE, DEVICE, HEALTH_TIMEOUT (240), PORT (8341), and churn_points.sh's.
# Smoke test on the CPU (demo model, tiny tiers, ~5 minutes):
#   OUT=/tmp/disk_smoke DEVICE=cpu MODEL=demo DTYPE=auto GPU_KV_GB=0.004 CPU_KV_GB=0.004 \
#   DISK_GB=0.05 MAX_MODEL_LEN=2048 THINK=2 POINT_S=100 CONVS=6 TURNS=3 WORDS=40 W=3 \
#   bash benchmarks/disk_points.sh 0.3 --length-scale 0.1
# Writes to $OUT at most seven files (a device call returns eight): no_disk.tgz and disk.tgz
# (churn_points.sh's files) with a copy of each one's summary (NAME.summary.txt), restart.tgz
# (cids.txt, warm.jsonl, cold.jsonl, the servers' logs; refreshed after each server stops),
# run.log and summary.txt (also printed).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t_start=$(date +%s)
out=${OUT:-results_tmp}; mkdir -p "$out"
rate=${1:-0.1}; [ $# -ge 1 ] && shift
py=${PYTHON:-python3}
model=${MODEL:-llama3.1-8b}; device=${DEVICE:-auto}
gpu_kv=${GPU_KV_GB:-8}; cpu_kv=${CPU_KV_GB:-8}; disk_gb=${DISK_GB:-30}
disk_dir=${DISK_DIR:-/tmp/pensieve_disk}
points=${POINTS:-abc}
mml=${MAX_MODEL_LEN:-131072}
[ "$device" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
say() { echo "[$(( $(date +%s) - t_start )) s] $*" | tee -a "$out/run.log"; }
say "disk points: $model, tiers $gpu_kv / $cpu_kv GB, disk $disk_gb GB under $disk_dir," \
    "rate $rate, think ${THINK:-90} s, points $points"

churn() {  # NAME SERVE_ARGS [multiturn args]: one point of churn_points.sh, pensieve on GPU 0
  local name=$1 serve=$2; shift 2
  OUT="$out/$name" BUDGET_S=${POINT_S:-140} MODEL=$model \
    MODEL_SET="${MODEL_SET:-max_position_embeddings=131072}" THINK=${THINK:-90} \
    WARMUP=${WARMUP:-30} WINDOW=${WINDOW:-60} DRAIN=${DRAIN:-15} TAG="$name" \
    GPU_KV_GB=$gpu_kv CPU_KV_GB=$cpu_kv SERVE_ARGS="$serve" GPUS=0 \
    bash benchmarks/churn_points.sh pensieve "$rate" --max-model-len "$mml" \
    --warm-start "${WARM_START:-0.05}" "$@" 2>&1 | tail -n 30 | tee -a "$out/run.log"
  pack "$name"
}
pack() {  # NAME: $out/NAME/ becomes $out/NAME.tgz beside a copy of its summary, so that a
  # device call, which returns at most 8 files of $OUT, brings every point back
  [ -d "$out/$1" ] || return 0
  [ -f "$out/$1/summary.txt" ] && cp "$out/$1/summary.txt" "$out/$1.summary.txt"
  tar czf "$out/$1.tgz" -C "$out" "$1" && rm -rf "${out:?}/$1"
}
shift_args=("$@")
disk_args="--disk-kv-gb $disk_gb --disk-kv-path $disk_dir"
if [[ $points == *a* ]]; then
  say "(a) no disk tier"; churn no_disk "" "${shift_args[@]}"
fi
if [[ $points == *b* ]]; then
  rm -rf "$disk_dir"; say "(b) disk tier"; churn disk "$disk_args" "${shift_args[@]}"
  du -sh "$disk_dir" 2>/dev/null | tee -a "$out/run.log"
  rm -rf "$disk_dir"
fi
[[ $points == *c* ]] || { say "done"; exit 0; }

# ------------------------------------------------------------------ (c) restart
. benchmarks/server_deps.sh
w=$(mktemp -d); r="$w/restart"; mkdir -p "$r"; rm -rf "$disk_dir"
serve_model=$model
if [ "$model" != demo ] && [ ! -d "$model" ]; then
  set_args=()
  for kv in ${MODEL_SET:-max_position_embeddings=131072}; do set_args+=(--set "$kv"); done
  serve_model=$("$py" benchmarks/chat_model_dir.py "$model" "$w/model" "${set_args[@]}" \
                --tokenizer "${TOKENIZER:-words}") || { say "no chat model dir"; exit 2; }
fi
port=${PORT:-8341}; url="http://127.0.0.1:$port"; srv=
start() {  # NAME STORE [disk args...]: one server on GPU 0, waits until it is up
  local name=$1 store=$2; shift 2
  local pin=(); [ "$device" = cpu ] || pin=(CUDA_VISIBLE_DEVICES=0)
  env ${pin[@]+"${pin[@]}"} "$py" -m pensieve.cli serve "$serve_model" \
    --load-format "${LOAD_FORMAT:-dummy}" --dtype "${DTYPE:-bfloat16}" --device "$device" \
    --gpu-kv-gb "$gpu_kv" --cpu-kv-gb "$cpu_kv" --max-model-len "$mml" \
    --host 127.0.0.1 --port "$port" --store "$store" --shutdown-timeout 10 "$@" \
    > "$r/server_$name.log" 2>&1 &
  srv=$!
  local deadline=$(( $(date +%s) + ${HEALTH_TIMEOUT:-240} ))
  until "$py" -c "import sys, urllib.request as u
sys.exit(u.urlopen('$url/health', timeout=2).status != 200)" 2>/dev/null; do
    if ! kill -0 "$srv" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then
      say "server $name did not come up:"; tail -n 20 "$r/server_$name.log" | tee -a "$out/run.log"
      stop; return 1
    fi
    sleep 1
  done
  say "server $name up"
}
stop() {  # SIGINT (the disk server writes its tiers' KV to disk), then TERM, KILL
  local sig
  [ -n "$srv" ] || return 0
  for sig in INT TERM KILL; do
    kill -0 "$srv" 2>/dev/null || break
    kill -"$sig" "$srv" 2>/dev/null
    for _ in $(seq 120); do kill -0 "$srv" 2>/dev/null || break; sleep 0.5; done
  done
  wait "$srv" 2>/dev/null; say "server stopped (exit status $?)"; srv=
  tar czf "$out/restart.tgz" -C "$w" restart  # what (c) has so far, should the call end
}
trap 'stop; rm -rf "$w" "$disk_dir"' EXIT
client=("$py" benchmarks/disk_restart.py)
copts=(--workers "${W:-16}" --max-tokens "${MAX_TOKENS:-32}")
# shellcheck disable=SC2086  # disk_args is a list of words
start disk1 "$w/conv.db" $disk_args || exit 1
"${client[@]}" build "$url" "$r/cids.txt" --conversations "${CONVS:-64}" --turns "${TURNS:-4}" \
  --words "${WORDS:-300}" "${copts[@]}" 2>&1 | tee -a "$out/run.log" || { say "build failed"; exit 1; }
stop
cp "$w/conv.db" "$w/cold.db"
say "disk after the stop: $(du -sh "$disk_dir" 2>/dev/null | cut -f1), $(ls "$disk_dir" | wc -l) files"
# shellcheck disable=SC2086
start disk2 "$w/conv.db" $disk_args || exit 1
"${client[@]}" continue "$url" "$r/cids.txt" "$r/warm.jsonl" "${copts[@]}" 2>&1 \
  | tee -a "$out/run.log"
stop
start cold "$w/cold.db" || exit 1
"${client[@]}" continue "$url" "$r/cids.txt" "$r/cold.jsonl" "${copts[@]}" 2>&1 \
  | tee -a "$out/run.log"
stop
{
  for p in no_disk disk; do
    [ -f "$out/$p.summary.txt" ] && { echo "== ($p)"; cat "$out/$p.summary.txt"; }
  done
  echo "== (c) restart"
  "${client[@]}" compare "$r/warm.jsonl" "$r/cold.jsonl"
} > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
say "done"
