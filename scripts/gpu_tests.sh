#!/usr/bin/env bash
# The CUDA-only tests (marked `gpu`; they skip on the CPU), on a GPU machine, e.g. from a
# snapshot on the device (docs/benchmarks.md):
#   bash scripts/gpu_tests.sh                  # all of them
#   bash scripts/gpu_tests.sh tests/test_graph_waits.py -k ahead
# With $OUT set, the output also goes to $OUT/gpu_tests.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests/)
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  python -m pytest -q -m gpu -p no:cacheprovider "${args[@]}" 2>&1 | tee "$OUT/gpu_tests.txt"
  exit "${PIPESTATUS[0]}"
fi
python -m pytest -q -m gpu -p no:cacheprovider "${args[@]}"
