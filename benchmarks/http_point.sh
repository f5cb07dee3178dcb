#!/usr/bin/env bash
# One multi-turn point over the real HTTP path: start `pensieve serve`, drive it with
# `multiturn.py --engine http` (streaming /v1/completions, one server conversation per benchmark
# conversation), stop it. Same set-up as the in-process H200 points of the first engine: Llama
# 2-13B shape with 10 KV heads, dummy weights, bf16, think time 6 s, GPU tier 8 GB, CPU tier
# 22 GB, 60 s of arrivals, 10 s warm-up, 20 s drain; the server's --cache-policy is SYSTEM.
# Usage: http_point.sh SYSTEM RATE [extra multiturn.py args]. Writes to $OUT (default
# results_tmp): http/points.jsonl, http/requests.jsonl.gz, run.log, server.log, metrics.txt.
# The device image lacks fastapi/uvicorn/pydantic: run scripts/device-wheels.sh
# annotated-doc anyio==4.16.0 here first and carry .whl; they are installed into $SITE.
# Env overrides (e.g. the demo model on the CPU): MODEL, LOAD_FORMAT, DTYPE, DEVICE, GPU_KV_GB,
# CPU_KV_GB, THINK, DURATION, WARMUP, DRAIN, TAG, PORT, SERVE_ARGS (more server flags),
# HEALTH_TIMEOUT, PT_TIMEOUT, MAX_CONN, LOG_LEVEL, PYTHON, SITE.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
if [ $# -lt 2 ]; then echo "usage: $0 SYSTEM RATE [multiturn args]" >&2; exit 2; fi
system=$1; rate=$2; shift 2
py=${PYTHON:-python3}
t_start=$(date +%s)

. benchmarks/server_deps.sh  # fastapi & co from the carried wheels

model=${MODEL:-llama2-13b-gqa10}
gpu_kv=${GPU_KV_GB:-8}; cpu_kv=${CPU_KV_GB:-22}
model_args=(--load-format "${LOAD_FORMAT:-dummy}" --dtype "${DTYPE:-bfloat16}"
            --device "${DEVICE:-auto}" --gpu-kv-gb "$gpu_kv" --cpu-kv-gb "$cpu_kv")
port=${PORT:-8321}
url=http://127.0.0.1:$port
tmp=$(mktemp -d)  # the server's conversation store: fresh for each point

# shellcheck disable=SC2086  # SERVE_ARGS is a list of words
"$py" -m pensieve.cli serve "$model" "${model_args[@]}" --cache-policy "$system" \
  --host 127.0.0.1 --port "$port" --store "$tmp/conversations.db" \
  --log-level "${LOG_LEVEL:-warning}" ${SERVE_ARGS:-} > "$out/server.log" 2>&1 &
srv=$!

stop_server() {  # $1: the first signal, INT (server up) or TERM (still starting)
  # Once up, uvicorn shuts down gracefully on either, then serve() stops the engine; on SIGTERM
  # uvicorn re-raises it at the end, which skips that, while a background job ignores SIGINT
  # until uvicorn handles it (so SIGTERM ends a server still starting).
  local sig
  for sig in "${1:-INT}" TERM KILL; do
    kill -0 "$srv" 2>/dev/null || break
    [ "$sig" = KILL ] && echo "server did not stop: killing it" | tee -a "$out/run.log"
    kill -"$sig" "$srv" 2>/dev/null
    for _ in $(seq 40); do kill -0 "$srv" 2>/dev/null || break; sleep 0.5; done
  done
  wait "$srv" 2>/dev/null
  echo "server exit status $?" >> "$out/run.log"
  rm -rf "$tmp"
}
trap "stop_server TERM" EXIT

deadline=$(( $(date +%s) + ${HEALTH_TIMEOUT:-300} ))
ready() {  # no curl on every image: ask with the standard library
  "$py" -c "import sys, urllib.request as u
sys.exit(u.urlopen('$url/health', timeout=2).status != 200)" 2>/dev/null
}
until ready; do
  if ! kill -0 "$srv" 2>/dev/null; then
    echo "server exited before it was ready; server.log tail:" | tee -a "$out/run.log"
    tail -n 40 "$out/server.log" | tee -a "$out/run.log"
    exit 1
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "server not ready after ${HEALTH_TIMEOUT:-300} s; server.log tail:" | tee -a "$out/run.log"
    tail -n 40 "$out/server.log" | tee -a "$out/run.log"
    exit 1
  fi
  sleep 1
done
if ! kill -0 "$srv" 2>/dev/null; then  # another server answered on the port
  echo "server exited; server.log tail:" | tee -a "$out/run.log"
  tail -n 40 "$out/server.log" | tee -a "$out/run.log"
  exit 1
fi
trap "stop_server INT" EXIT
echo "server ready after $(( $(date +%s) - t_start )) s ($model, $system, pid $srv)" \
  | tee -a "$out/run.log"

# --max-connections: at most one turn per conversation is in flight, and a point starts about
# RATE x DURATION conversations, so 512 never holds turns back on the client below ~8/s at 60 s
# (http_throttled in the point says if it did).
timeout "${PT_TIMEOUT:-300}" "$py" -m pensieve.bench.multiturn --engine http --url "$url" \
  --systems "$system" --rates "$rate" --model "$model" "${model_args[@]}" \
  --think-time "${THINK:-6}" --duration "${DURATION:-60}" --warmup "${WARMUP:-10}" \
  --drain "${DRAIN:-20}" --max-connections "${MAX_CONN:-512}" --tag "${TAG:-h200-http}" \
  --out "$out/http" "$@" 2> "$out/progress.log" | tee -a "$out/run.log"
rc=${PIPESTATUS[0]}
echo "multiturn.py exit status $rc after $(( $(date +%s) - t_start )) s" | tee -a "$out/run.log"
"$py" -c "import urllib.request as u; print(u.urlopen('$url/metrics', timeout=10).read().decode())" \
  > "$out/metrics.txt" 2>/dev/null || true

trap - EXIT
stop_server INT
# multiturn.py's warnings (failed requests...), without its progress bar
tr '\r' '\n' < "$out/progress.log" | grep -v -e ' @ ' -e '^\s*$' | tail -n 20
n_err=$(grep -c -E 'ERROR|Traceback' "$out/server.log")
[ "$n_err" -gt 0 ] && echo "server.log has $n_err error line(s)" | tee -a "$out/run.log"
[ -f "$out/http/requests.jsonl" ] && gzip -f "$out/http/requests.jsonl"
for f in "$out/server.log" "$out/progress.log"; do
  [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 1000000 ] && gzip -f "$f"
done
echo "done in $(( $(date +%s) - t_start )) s"
exit "$rc"
