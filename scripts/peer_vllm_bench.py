"""``vllm bench serve --backend openai-chat``, unmodified, against ``pensieve serve`` on the default
model (CPU): random prompts that share a prefix, then a check that every request succeeded and
that the shared prefix was served from the KV cache (the server's ``/v1/usage`` and
``pensieve_prompt_tokens_total`` by source).

    python scripts/peer_vllm_bench.py [--venv /tmp/vllm-bench-venv] [--out DIR]

vLLM lives in a virtual environment of its own (``--venv``; made on first use): its wheel pins
torch 2.14.0 (a CUDA build of several GB) and a long list of GPU packages, none of which the
benchmark client needs. So the venv gets the CPU torch 2.13.0 that pip takes from this disk,
``vllm==0.34.0`` with ``--no-deps``, and the packages that ``vllm bench serve`` imports
(:data:`CLIENT_DEPS`, found by running it until nothing was missing), torch held at 2.13.0 by a
constraint. vLLM's compiled ``vllm._C`` does not load without its torch; the benchmark client
does not use it (vLLM logs "Failed to import from vllm._C" and goes on). About 2-4 minutes to
install on a 2-core machine, 2.8 GB.

Flags: the endpoint (``--base-url``, ``--endpoint /v1/chat/completions``, which ``openai-chat``
needs), ``--model`` and ``--tokenizer`` (the default model's directory: nothing comes from a
hub), and a load a 2-core machine runs in about half a minute: 8 random prompts of 200 tokens,
the first 128 shared (``--random-prefix-len``), 16 tokens out. ``--max-concurrency 2``: with
vLLM's default (every request at once), every prompt is prefilled in the same step and none
finds another's prefix computed; that holds for vLLM's own prefix cache too.
Exits 1 if a request failed or nothing hit the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from peer_aiperf import default_model_server, prompt_tokens_by_source

from pensieve.models.builtin import smollm2_dir

VLLM = "vllm==0.34.0"
CLIENT_DEPS = [
    "transformers>=5.16.1,<5.23", "aiohttp", "pyzmq", "psutil", "pydantic", "pyyaml", "regex",
    "tqdm", "pybase64", "cbor2", "msgspec", "cachetools", "blake3", "py-cpuinfo",
    "openai>=2.25", "openai-harmony", "cloudpickle", "partial-json-parser", "uvicorn",
    "llguidance>=1.7,<1.8", "xgrammar==0.2.8", "watchfiles", "orjson", "einops",
    "fastapi>=0.133,<0.137", "requests", "uvloop", "pillow", "prometheus-client",
]
"""What ``vllm bench serve`` imports, with vLLM 0.34.0's own bounds where it sets them."""


def ensure_venv(venv: Path) -> Path:
    """The ``vllm`` executable of ``venv``, installing it there first if needed."""
    exe = venv / "bin" / "vllm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, "--no-deps", VLLM], check=True)
        constraint = venv / "torch-constraint.txt"
        constraint.write_text("torch==2.13.0\n")
        subprocess.run([*pip, "-c", str(constraint), *CLIENT_DEPS], check=True)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path,
                    default=Path(tempfile.gettempdir()) / "vllm-bench-venv")
    ap.add_argument("--out", type=Path, default=None, help="where vLLM saves its result JSON")
    args = ap.parse_args()
    exe = ensure_venv(args.venv)
    prompts = 8
    with default_model_server("vllm-bench") as (url, model, work):
        out = args.out or work / "vllm-bench"
        cmd = [str(exe), "bench", "serve", "--backend", "openai-chat", "--base-url", url,
               "--endpoint", "/v1/chat/completions", "--model", model,
               "--tokenizer", str(smollm2_dir()), "--dataset-name", "random",
               "--num-prompts", str(prompts), "--random-input-len", "200",
               "--random-output-len", "16", "--random-prefix-len", "128",
               "--max-concurrency", "2", "--save-result", "--result-dir", str(out),
               "--result-filename", "result.json"]
        print(" ".join(cmd), flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        summary = [line for line in run.stdout.splitlines()
                   if ":" in line and not line.startswith(("Namespace", " "))]
        print("\n".join(summary[-30:]))
        if run.returncode != 0:
            print(run.stderr[-5000:])
        report = json.loads((out / "result.json").read_text()) if run.returncode == 0 else {}
        usage = httpx.get(url + "/v1/usage", timeout=10).json()
        sources = prompt_tokens_by_source(url)
    completed, failed = report.get("completed", 0), report.get("failed", prompts)
    print(json.dumps({"vllm_rc": run.returncode, "completed": completed, "failed": failed,
                      "usage": usage, "prompt_tokens": sources}))
    ok = run.returncode == 0 and completed == prompts and not failed \
        and usage["cached_prompt_tokens"] > 0
    print("ok" if ok else "FAILED: a request failed or no prompt token hit the cache")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
