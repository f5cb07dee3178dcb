#!/usr/bin/env bash
# The GPU test pass on the H200 (see docs/performance.md): kernels at real shapes, bf16 models
# against HF, swapper streams, and the stateful invariant in float32 on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-results_tmp}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/h200_tests.log"
python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu_models.py \
  tests/test_swapper.py 2>&1 | tail -15 | tee -a "$out/h200_tests.log"
PENSIEVE_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider \
  tests/test_stateful_invariant.py 2>&1 | tail -15 | tee -a "$out/h200_tests.log"
