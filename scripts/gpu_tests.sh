#!/usr/bin/env bash
# The CUDA-only tests (marked `gpu`; they skip on the CPU), on a GPU machine, e.g. from a
# snapshot on the device (docs/benchmarks.md):
#   bash scripts/gpu_tests.sh                  # all of them
#   bash scripts/gpu_tests.sh tests/test_graph_waits.py -k ahead
# With $OUT set, the output also goes to $OUT/gpu_tests.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# The device image lacks xgrammar, which an engine imports when it starts (its grammar
# compiler): install the carried wheels (scripts/device-wheels.sh, carry .whl) if so.
if ! python -c "import xgrammar" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests/)
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  python -m pytest -q -m gpu -p no:cacheprovider "${args[@]}" 2>&1 | tee "$OUT/gpu_tests.txt"
  exit "${PIPESTATUS[0]}"
fi
python -m pytest -q -m gpu -p no:cacheprovider "${args[@]}"
