# Sourced by the scripts that start `pensieve serve` on the device machine (churn_points.sh,
# http_point.sh) with $py set: makes fastapi/uvicorn/pydantic/xgrammar importable from the carried
# wheels in .whl (installed once into $SITE, default /tmp/site; fetch them here with
# bash scripts/device-wheels.sh annotated-doc anyio==4.16.0), exits 2 if they are not,
# and raises the open-files limit for hundreds of streams.
site=${SITE:-/tmp/site}
if ! "$py" -c 'import fastapi, uvicorn, pydantic, xgrammar' 2>/dev/null; then
  if [ -d .whl ] && ! PYTHONPATH=$site "$py" -c "import fastapi, uvicorn, xgrammar" 2>/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" .whl/*.whl
  fi
  export PYTHONPATH=$site:$PYTHONPATH
fi
if ! "$py" -c 'import fastapi, uvicorn, pydantic, xgrammar'; then
  echo "fastapi/uvicorn/pydantic/xgrammar not importable: run scripts/device-wheels.sh and" \
       "carry .whl" >&2
  exit 2
fi
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
# Triton's kernel cache in the working tree when one was carried there (.triton_cache: a
# fresh device machine then starts a llama3.1-8b server in ~42 s instead of ~98 s, the kernels'
# compile being most of the difference, docs/long_context.md "Server start"); bring one back
# with: tar czf $OUT/triton_cache.tgz -C "$TRITON_CACHE_DIR" . after a run.
if [ -z "${TRITON_CACHE_DIR:-}" ] && [ -d .triton_cache ]; then
  export TRITON_CACHE_DIR=$PWD/.triton_cache
fi
