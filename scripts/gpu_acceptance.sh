#!/usr/bin/env bash
# Issue 59's GPU acceptance in one device call (one H100 or H200, <= 9 minutes), everything
# under $OUT, the card named in acceptance.txt:
#   tests      the CUDA tests of swaps, kernels, models and graphs (scripts/gpu_tests.sh), while
#              a background process compiles the server's attention kernel variants into
#              TRITON_CACHE_DIR (the llama3.1-8b shape, bf16 and FP8 KV), so the servers of the
#              agent stage start without compiling them;
#   attention  benchmarks/long_attention.py at 32k / 64k / 128k, bf16 and FP8 KV, prefill and
#              decode (ATTN_BATCHES), eager and as CUDA-graph replays, one run per context,
#              then the FP8 prefill with e4m3 operands in both products (fp8dot) apart;
#   agent      two serving points, coding-agent over HTTP with --warm-start
#              (benchmarks/agent_points.sh): pensieve FP8 KV at FP8_RATE and pensieve bf16 at
#              BF16_RATE sessions/s, each cut to its share of the time left;
#   steps      the servers' step totals of those points (benchmarks/step_totals.py).
# Then: python scripts/gpu_acceptance_docs.py $OUT   (tables for the docs, plots)
#
#   OUT=results bash scripts/gpu_acceptance.sh
# Device call (carry .whl: fastapi/uvicorn/pydantic, from scripts/device-wheels.sh; carry
# .triton_cache too when there is one):
#   bash scripts/gpu_acceptance.sh
# Env: STAGES ("tests attention agent steps"), BUDGET_S (540: the whole script; each stage's
# cap is cut to what is left), TESTS_S (200), ATTN_S (120: shared by the runs), ATTN_CONTEXTS
# (32768,65536,131072), ATTN_BATCHES (1,32), ATTN_ITERS (5), FP8_RATE (0.14), BF16_RATE
# (0.07), WARMUP (30), WINDOW (120), DRAIN (10), MIN_WINDOW (30), WARM_START (0.05), MODEL (llama3.1-8b),
# MAX_MODEL_LEN (131072), DEVICE (auto; cpu for a dry run), TRITON_BACK (0; 1: bring the Triton
# cache back as triton_cache.tgz), and agent_points.sh's / churn_points.sh's.
# At the defaults the agent points get what the tests and the sweep leave (~100 s each,
# windows of ~30-60 s): enough to see P90 TTFT, short of the 200-300 s windows of a point
# alone. STAGES="agent steps" alone gives each point ~260 s.
# CPU dry run (no GPU: the tests deselect, the sweep refuses, a demo server serves):
#   OUT=/tmp/acc DEVICE=cpu MODEL=demo DTYPE=auto GPU_KV_GB=0.004 CPU_KV_GB=0.008 \
#   MAX_MODEL_LEN=2048 THINK=1 WARMUP=10 WINDOW=20 FP8_RATE=0.3 BF16_RATE=0.3 BUDGET_S=240 \
#   CLIENT_ARGS="--length-scale 0.05" bash scripts/gpu_acceptance.sh
# Writes to $OUT at most eight files (a device call returns eight): acceptance.txt (the card,
# each stage's status and seconds), gpu_tests.txt, long_attention.json, points.jsonl (the
# agent points), agent_summary.txt, step_totals.txt, step_totals.json, agent.tgz (each point's
# directory: summary, run.log, churn.tgz, time-series plot), and with TRITON_BACK=1
# triton_cache.tgz in place of step_totals.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results_tmp/acceptance}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
py=${PYTHON:-python3}
stages=" ${STAGES:-tests attention agent steps} "
budget=${BUDGET_S:-540}
t_start=$(date +%s)
log="$out/acceptance.txt"; : > "$log"
exec 3>&1  # the terminal: say() and stage() write there and to acceptance.txt, whatever a
           # stage's own output is redirected to
say() { echo "[$(( $(date +%s) - t_start )) s] $*" | tee -a "$log" >&3; }
left() { echo $(( budget - ($(date +%s) - t_start) )); }

# stage NAME CAP_S MIN_S CMD...: run CMD under a timeout of min(CAP_S, time left); skip it when
# less than MIN_S is left. One line per stage in acceptance.txt: "stage NAME rc=.. s=..".
stage() {
  local name=$1 cap=$2 min=$3; shift 3
  local l; l=$(left)
  [ "$cap" -gt "$l" ] && cap=$l
  if [ "$cap" -lt "$min" ]; then
    say "stage $name skipped: a cap of ${cap} s (${l} s left), it needs ${min} s"
    echo "stage $name rc=skipped s=0" | tee -a "$log" >&3; return 0
  fi
  say "stage $name: up to $cap s"
  local t0; t0=$(date +%s)
  timeout -k 10 "$cap" "$@"; local rc=$?
  [ "$rc" = 124 ] && say "stage $name timed out after $cap s"
  echo "stage $name rc=$rc s=$(( $(date +%s) - t0 ))" | tee -a "$log" >&3
}

card=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
       | head -n 1)
echo "card: ${card:-none (nvidia-smi not found)}" | tee -a "$log"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
     "stages:$stages budget ${budget} s" | tee -a "$log"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$log"
echo "triton cache: $(find "$TRITON_CACHE_DIR" -type f 2>/dev/null | wc -l) files" | tee -a "$log"

# fastapi/uvicorn/pydantic from the carried wheels, once (benchmarks/server_deps.sh checks it)
site=${SITE:-/tmp/site}
if [ -d .whl ] && ! "$py" -c 'import fastapi, uvicorn, pydantic' 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl 2>&1 | tail -n 3 | tee -a "$log"
  export PYTHONPATH=$site:$PYTHONPATH
fi

# ------------------------------------------------------------------ tests
precompile() {  # the server's attention variants (ModelRunner._compile_attention), into the cache
  "$py" - <<'EOF'
import time, torch
from pensieve.kernels.launch import compile_attention_kernels
from pensieve.kernels.fp8_scratch import compile_fp8_scratch
if not torch.cuda.is_available():
    raise SystemExit("precompile: no CUDA device")
t0, dev, bf = time.perf_counter(), torch.device("cuda"), torch.bfloat16
n = compile_attention_kernels(32, 8, 128, 32, bf, dev)
n += compile_attention_kernels(32, 8, 128, 32, bf, dev, kv_dtype=torch.float8_e4m3fn)
n += compile_fp8_scratch(8, 128, 32, bf, dev)
print(f"precompile: {n} attention variants (llama3.1-8b shape) in {time.perf_counter() - t0:.1f} s")
EOF
}
tests=(tests/test_swap_kernel.py tests/test_kernels.py tests/test_swap_streams.py
       tests/test_copy_engine.py tests/test_graph_waits.py tests/test_fused_kernels.py
       tests/test_fp8_kv.py tests/test_gpu_graphs.py tests/test_gpu_models.py)
if [[ $stages == *" tests "* ]]; then
  pre=
  if [[ $stages == *" agent "* ]]; then
    precompile >> "$log" 2>&1 &
    pre=$!
  fi
  have=()
  for f in "${tests[@]}"; do
    if [ -f "$f" ]; then have+=("$f"); else say "missing test file $f"; fi
  done
  OUT=$out stage tests "${TESTS_S:-200}" 30 bash scripts/gpu_tests.sh "${have[@]}" \
    --durations=15 > /dev/null
  tail -n 1 "$out/gpu_tests.txt" 2>/dev/null | tee -a "$log"
  [ -n "$pre" ] && { wait "$pre"; say "precompile exit status $?"; }
fi

# ------------------------------------------------------------------ attention
if [[ $stages == *" attention "* ]]; then
  # one run per context (a hang or a crash costs that context only), then the FP8 prefill
  # with e4m3 operands in both products (fp8dot) apart, merged into long_attention.json
  a_dir=$(mktemp -d)
  contexts=${ATTN_CONTEXTS:-32768,65536,131072}
  a_s=${ATTN_S:-120}; n_runs=$(( $(wc -w <<< "${contexts//,/ }") + 1 ))
  for ctx in ${contexts//,/ } fp8dot; do
    if [ "$ctx" = fp8dot ]; then
      run=(--contexts "$contexts" --kv-dtypes fp8dot --decode-batches "")
    else
      run=(--contexts "$ctx" --kv-dtypes bf16,fp8 --decode-batches "${ATTN_BATCHES:-1,32}")
    fi
    stage "attention $ctx" $(( a_s / n_runs )) 15 "$py" benchmarks/long_attention.py \
      "${run[@]}" --cuda-graphs --warmup 2 --iters "${ATTN_ITERS:-5}" \
      --out "$a_dir/la_$ctx.json" > "$a_dir/log" 2>&1
    tr '\r' '\n' < "$a_dir/log" | grep -v -e "^long-attention:" -e '^\s*$' | tee -a "$log"
  done
  "$py" scripts/gpu_acceptance_docs.py --merge-attention "$out/long_attention.json" \
    "$a_dir"/la_*.json 2>&1 | tee -a "$log"
  rm -rf "$a_dir"
fi

# ------------------------------------------------------------------ agent
if [[ $stages == *" agent "* ]]; then
  points=("pensieve ${FP8_RATE:-0.14} fp8 --kv-cache-dtype fp8_e4m3"
          "pensieve ${BF16_RATE:-0.07} bf16")
  mkdir -p "$out/agent"
  n=${#points[@]}
  for point in "${points[@]}"; do
    share=$(( ($(left) - 20) / n )); n=$(( n - 1 ))  # 20 s: the step totals, the archive
    # MIN_WINDOW 30: churn_points.sh keeps 60 s of window by default, past a short share
    POINT_S=$share WARMUP=${WARMUP:-30} WINDOW=${WINDOW:-120} DRAIN=${DRAIN:-10} \
      MIN_WINDOW=${MIN_WINDOW:-30} OUT="$out/agent" \
      stage "agent: $point" $(( share + 20 )) 60 \
      bash benchmarks/agent_points.sh coding-agent "$point" >> "$log" 2>&1
  done
  cat "$out"/agent/*/points.jsonl > "$out/points.jsonl" 2>/dev/null
  for d in "$out"/agent/*/; do
    [ -f "$d/summary.txt" ] && { echo "== $(basename "$d")"; cat "$d/summary.txt"; }
  done > "$out/agent_summary.txt"
  cat "$out/agent_summary.txt"
fi

# ------------------------------------------------------------------ steps
if [[ $stages == *" steps "* ]] && compgen -G "$out/agent/*/churn.tgz" > /dev/null; then
  # seconds of CPU over what the points left, so outside the budget (a minute at most)
  say "stage steps"
  timeout 60 "$py" benchmarks/step_totals.py "$out"/agent/*/churn.tgz \
    --json "$out/step_totals.json" > "$out/step_totals.txt"
  echo "stage steps rc=$? s=0" | tee -a "$log" >&3
  cat "$out/step_totals.txt"
fi
if [ -d "$out/agent" ]; then
  tar czf "$out/agent.tgz" -C "$out" agent && rm -rf "${out:?}/agent"
fi
if [ "${TRITON_BACK:-0}" = 1 ]; then
  rm -f "$out/step_totals.txt"  # the json keeps them; eight files come back
  tar czf "$out/triton_cache.tgz" -C "$TRITON_CACHE_DIR" .
fi
say "done; $(ls "$out" | wc -l) files in $out: $(ls "$out" | tr '\n' ' ')"
