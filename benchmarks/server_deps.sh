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
