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
marks=()
if [[ ${1:-} == --fast ]]; then  # the development loop: slow tests left out
  marks=(-m "not slow")
  shift
fi
python -c "import xdist" 2>/dev/null && marks+=(-n 2 --dist worksteal)
ruff check src tests benchmarks scripts
mypy src/pensieve/core src/pensieve/config.py src/pensieve/engine/engine_core.py \
  src/pensieve/engine/executor.py src/pensieve/engine/tiers.py src/pensieve/engine/containment.py \
  src/pensieve/engine/step_record.py src/pensieve/engine/request_output.py \
  src/pensieve/sim src/pensieve/bench/serve_metrics.py src/pensieve/kernels/launch_policy.py \
  src/pensieve/options.py src/pensieve/help_text.py src/pensieve/threads.py
python scripts/size_check.py src --results docs/results
# One PostgreSQL server for the tests that use one (each gets a database of its own on it;
# tests/pg_server.py), stopped on exit; without pgserver tests/pg_server.py starts its own.
if python -c "import pgserver" 2>/dev/null; then
  pg_dir=$(mktemp -d)
  trap 'python scripts/pg_ci.py stop "$pg_dir"' EXIT
  PENSIEVE_TEST_POSTGRES_URL=$(python scripts/pg_ci.py start "$pg_dir")
  export PENSIEVE_TEST_POSTGRES_URL
fi
# One torch thread per process: many tests run servers, ranks or replicas as processes of their
# own beside pytest, and more threads than free cores leave most of them waiting (on a loaded
# 2-core machine test_engine.py + test_containment.py took 47.8 s with the default, 10.2 s so).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q -p no:cacheprovider --durations=20 ${marks[@]+"${marks[@]}"} "$@"
