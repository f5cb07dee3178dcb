#!/usr/bin/env bash
# Download, on the CPU machine, the wheels that the GPU machine's image lacks, into ./.whl/
# (Python 3.12, x86-64), so a device run can carry them. Usage, from the project root:
#   bash scripts/device-wheels.sh [extra-package==version ...]
# Then in the device command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
# and name .whl in `carry`. The image already has torch, triton, transformers, tokenizers,
# sentencepiece, safetensors, numpy, httpx, anyio, h11, click, aiohttp, prometheus-client,
# matplotlib, tqdm, rich, pyyaml; not xgrammar (structured output) and its FFI, fetched here.
# (The openai client is not listed: its chain is long; a load generator there can speak HTTP
# with httpx or aiohttp.) Keep .whl out of git: echo /.whl/ >> .git/info/exclude
set -euo pipefail
dest=.whl
mkdir -p "$dest"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pkgs=(fastapi starlette pydantic pydantic-core typing-inspection annotated-types typing-extensions
      opentelemetry-api uvicorn sse-starlette xgrammar==0.2.8 apache-tvm-ffi "$@")
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d "$dest" "$p"
done
ls -la "$dest"
du -sh "$dest"
