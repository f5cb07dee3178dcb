#!/usr/bin/env bash
# A benchmark longer than one device call. The device tool ends a command after 10 minutes, but
# a machine stays held between back-to-back calls (up to 30 minutes) and a process started with
# setsid outlives the call that started it. So: `start` copies this tree (without .git and the
# local caches) to RUN_DIR/tree, where later calls' refreshed working trees cannot touch it,
# and runs the command there, detached, with OUT=RUN_DIR/out; `wait` (each later call) waits
# until it ends or SECONDS pass and prints the log's tail; `collect` copies RUN_DIR/out to $OUT
# (what comes back from the call) once it has ended.
#
# Usage: long_run.sh start CMD [ARGS...]   e.g. start bash benchmarks/churn_points.sh ...
#        long_run.sh wait [SECONDS]         (default 570) exit 0 once ended, 3 while running
#        long_run.sh collect                exit 0 once copied, 3 while running
#        long_run.sh status                 running / ended (exit status N)
# Env: RUN_DIR (default /tmp/pensieve_long_run); the command gets the caller's environment,
# with OUT replaced. A ShareGPT steady point at 40 / 60 GB (~1,000 s warm-up; docs/benchmarks.md):
#   call 1: cd .snap; GPU_KV_GB=40 CPU_KV_GB=60 THINK=6 WARMUP=1000 WINDOW=300 DRAIN=25 \
#             BUDGET_S=1450 MODEL=chatmodel TAG=sharegpt bash scripts/long_run.sh start \
#             bash benchmarks/churn_points.sh stateless,pensieve 0.8,1.0 --workload sharegpt; \
#           bash scripts/long_run.sh wait 560
#   call 2: bash scripts/long_run.sh wait 570            (any directory: RUN_DIR is absolute)
#   call 3: bash scripts/long_run.sh wait 570 && OUT=$OUT bash scripts/long_run.sh collect
# Make each call as soon as the last returns: an idle machine is given back after ~30 s, and
# the run with it. The whole run must end within the 30 minutes a machine may be held.
set -uo pipefail
run_dir=${RUN_DIR:-/tmp/pensieve_long_run}
root=$(cd "$(dirname "$0")/.." && pwd)

running() { [ -f "$run_dir/pid" ] && [ ! -f "$run_dir/rc" ] && kill -0 "$(cat "$run_dir/pid")" 2>/dev/null; }
rc() { cat "$run_dir/rc" 2>/dev/null || echo "unknown: killed"; }

case "${1:-}" in
start)
    shift
    [ $# -ge 1 ] || { echo "long_run.sh start: no command" >&2; exit 2; }
    if running; then echo "long_run.sh: a run is already going in $run_dir" >&2; exit 2; fi
    rm -rf "$run_dir" && mkdir -p "$run_dir/tree" "$run_dir/out"
    tar -C "$root" --exclude=./.git --exclude=./.venv --exclude=./.mypy_cache \
        --exclude=./.ruff_cache --exclude=./.pytest_cache --exclude=./.hypothesis \
        --exclude=./.snap -cf - . | tar -C "$run_dir/tree" -xf -
    # the exit status goes to rc when the command ends; `wait` and `collect` look for it
    # (cd apart: a backgrounded `cd && cmd` list would hold the caller's stdout until the end)
    (cd "$run_dir/tree" || exit 2
     OUT="$run_dir/out" setsid nohup bash -c \
        '"$@"; echo $? > "$0/rc"' "$run_dir" "$@" > "$run_dir/log" 2>&1 < /dev/null &
     echo $! > "$run_dir/pid")
    echo "started in $run_dir/tree (pid $(cat "$run_dir/pid")): $*"
    ;;
wait)
    limit=${2:-570}; t0=$(date +%s)
    [ -f "$run_dir/pid" ] || { echo "long_run.sh: nothing started in $run_dir" >&2; exit 2; }
    while running && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 2; done
    tail -n 30 "$run_dir/log"
    if running; then echo "still running after ${limit} s"; exit 3; fi
    echo "ended (exit status $(rc))"
    ;;
collect)
    [ -f "$run_dir/pid" ] || { echo "long_run.sh: nothing started in $run_dir" >&2; exit 2; }
    if running; then echo "still running: wait first" >&2; exit 3; fi
    dest=${OUT:?set OUT to where the outputs go}
    mkdir -p "$dest" && cp -r "$run_dir/out/." "$dest/" && cp "$run_dir/log" "$dest/long_run.log"
    echo "copied $run_dir/out to $dest (exit status $(rc))"
    ;;
status)
    if [ ! -f "$run_dir/pid" ]; then echo "nothing started in $run_dir"
    elif running; then echo "running (pid $(cat "$run_dir/pid"))"
    else echo "ended (exit status $(rc))"; fi
    ;;
*)
    sed -n '2,23p' "$0"; exit 2
    ;;
esac
