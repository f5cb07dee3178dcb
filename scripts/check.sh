#!/usr/bin/env bash
# Lint, type-check (strict on the pure-Python core, see pyproject) and run the tests on the CPU.
# Triton kernels run through Triton's interpreter; GPU-only tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check src tests benchmarks
mypy src/pensieve/core src/pensieve/config.py src/pensieve/engine/core.py \
  src/pensieve/engine/executor.py src/pensieve/engine/tiers.py src/pensieve/engine/containment.py \
  src/pensieve/engine/step_record.py src/pensieve/engine/outputs.py \
  src/pensieve/bench/simulator.py src/pensieve/bench/step_cost.py
python -m pytest -q -p no:cacheprovider "$@"
