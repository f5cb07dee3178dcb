#!/usr/bin/env bash
# Lint, type-check (strict on the pure-Python core, see pyproject), check sizes and run the tests
# on the CPU. Triton kernels run through Triton's interpreter; GPU-only tests skip without CUDA.
#   bash scripts/check.sh           # everything (CI)
#   bash scripts/check.sh --fast    # the same checks, tests marked slow left out
# Tests run on two workers (pytest-xdist, a dev dependency; work stealing, so the few long
# server tests do not hold one worker's queue back).
#   bash scripts/check.sh [--fast] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is cached (src/ and tests/ __pycache__, tests rewritten by pytest, and the venv's
# packages, which the README's install leaves uncompiled): with PYTHONDONTWRITEBYTECODE set,
# every pytest worker, server and Ray worker compiled the modules it imports again (collecting
# the suite took 17.0 s of one process instead of 10.8 s).
unset PYTHONDONTWRITEBYTECODE
marks=()
if [[ ${1:-} == --fast ]]; then  # the development loop: slow tests left out
  marks=(-m "not slow")
  shift
fi
python -c "import xdist" 2>/dev/null && marks+=(-n 2 --dist worksteal)
ruff check src tests benchmarks scripts
python scripts/size_check.py src --results docs/results
# mypy runs beside the tests, its report printed after theirs: on a fresh clone (no
# .mypy_cache) it takes ~50 s of one core, which run before the tests left the other core idle.
mypy_out=$(mktemp)
pg_dir=
cleanup() {
  if [[ -n $pg_dir ]]; then python scripts/pg_ci.py stop "$pg_dir"; fi
  rm -f "$mypy_out"
}
trap cleanup EXIT
mypy src/pensieve/core src/pensieve/config.py src/pensieve/engine/engine_core.py \
  src/pensieve/engine/executor.py src/pensieve/engine/tiers.py src/pensieve/engine/containment.py \
  src/pensieve/engine/step_record.py src/pensieve/engine/request_output.py \
  src/pensieve/sim src/pensieve/bench/serve_metrics.py src/pensieve/kernels/launch_policy.py \
  src/pensieve/options.py src/pensieve/help_text.py src/pensieve/threads.py >"$mypy_out" 2>&1 &
mypy_pid=$!
# One PostgreSQL server for the tests that use one (each gets a database of its own on it;
# tests/pg_server.py), stopped on exit; without pgserver tests/pg_server.py starts its own.
if python -c "import pgserver" 2>/dev/null; then
  pg_dir=$(mktemp -d)
  PENSIEVE_TEST_POSTGRES_URL=$(python scripts/pg_ci.py start "$pg_dir")
  export PENSIEVE_TEST_POSTGRES_URL
fi
# One torch thread per process: many tests run servers, ranks or replicas as processes of their
# own beside pytest, and more threads than free cores leave most of them waiting (on a loaded
# 2-core machine test_engine.py + test_containment.py took 47.8 s with the default, 10.2 s so).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
tests=0
python -m pytest -q -p no:cacheprovider --durations=20 ${marks[@]+"${marks[@]}"} "$@" || tests=$?
typed=0
wait "$mypy_pid" || typed=$?
echo "mypy:"
cat "$mypy_out"
if (( tests )); then exit "$tests"; fi
exit "$typed"
